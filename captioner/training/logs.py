"""What a training run prints and where: Lightning's messages into the run's log, the closing summary, the
resume advice of a stopped run, and the W&B run closed at the end.

stdout and the run's ``train.log`` hold the run's progress (Lightning's messages and Python's warnings
included); stderr holds only the one-line error of a run that fails.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from captioner.training.metrics import BLEU, CIDER, CORRECTNESS, GRAPH_REPLAYS, TEST, TRAIN, VAL, metric

# Overrides that a resumed run must not repeat: it starts from the stopped run's checkpoint. (Hydra's own
# overrides, such as hydra.run.dir, are not among the job's: the resumed run gets a new folder.)
_NOT_REPEATED = ("ckpt_path=", "init_from=")


class _NoTips(logging.Filter):
    """Drops Lightning's advertisements ("💡 Tip: ... try installing litlogger / litmodels")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip:")


def route_lightning_logs() -> None:
    """Send Lightning's messages where the run's own go (stdout and ``train.log``), not to stderr, without
    its advertisements for its cloud services (printed on every run whatever the logger), and silence the
    warnings that are not the user's to act on.

    On import Lightning gives its loggers stderr handlers of their own, so stderr would mix its progress
    messages with the errors.
    """
    logging.captureWarnings(True)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # rank_zero_info's logger
    if not any(isinstance(f, _NoTips) for f in tips.filters):
        tips.addFilter(_NoTips())
    # A frozen encoder stays in eval mode on purpose (its BatchNorm statistics never move): not news.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    # A streamed training split (data.stream.ShardStream) gives each loader worker its own samples and length.
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    # An epoch shorter than trainer.log_every_n_steps is logged all the same: CaptionerModule.on_train_start makes
    # the interval fit it (quick_checks.fit_log_interval) after Lightning warned that it would not be.
    warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging")
    # Under DDP every rank logs the same scores, computed from all ranks' captions (``EvaluationEpoch.finish``), and
    # the same share of replayed steps (the ranks agree on replay or eager): nothing to reduce across the ranks.
    same = "|".join(re.escape(name) for name in (f"{VAL}/", f"{TEST}/", metric(TRAIN, GRAPH_REPLAYS)))
    warnings.filterwarnings("ignore", message=rf"It is recommended to use `self\.log\('({same})")
    # ... and the sampler's padding repeats an image or two in validation and test: their captions are kept once.
    warnings.filterwarnings("ignore", message=r"Using `DistributedSampler` with the dataloaders\. During `trainer\.")
    # Lightning's CombinedLoader builds torch's deprecated LeafSpec for every loader: its change to make.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def summary(
    metrics: dict,
    ckpt_path: str | None,
    bundle: Path,
    output_dir: Path,
    missing: dict[str, str],
    checkpoint_note: str | None,
    decoded: str,
    curves: Path | None = None,
) -> str:
    """The lines a user acts on: the scores that exist, why the others were not computed, where the files are.

    ``missing``: split -> why its scores are not in ``metrics`` (``quick_checks.not_computed``);
    ``checkpoint_note``: why ``ckpt_path`` is the run's last checkpoint rather than its best (None: it is the
    best); ``decoded``: how the captions scored were decoded (never teacher-forced); ``curves``: the picture of
    the run's curves (None: none was drawn).
    """
    lines = [""]
    if metric(VAL, BLEU[-1]) not in metrics:
        lines.append(f"validation scores: not computed ({missing.get(VAL, 'no validation ran')})")
    else:
        lines.append(f"validation BLEU (0-1, nltk corpus BLEU over all references; {decoded}):")
        lines.append("  " + _bleu(metrics, VAL))
        lines.append(f"  CIDEr-D {metrics[metric(VAL, CIDER)]:.4f} (coco-caption's CIDEr on these tokens)")
        if metric(VAL, CORRECTNESS) in metrics:
            lines.append(
                f"  attention correctness (attention mass inside the named object's box): "
                f"{metrics[metric(VAL, CORRECTNESS)]:.3f}"
            )
        else:
            lines.append("  attention correctness: not computed (no decoded word named an object with a box)")
    if metric(TEST, BLEU[-1]) not in metrics:
        lines.append(f"test scores: not computed ({missing.get(TEST, 'no test ran')})")
    else:
        lines.append(f"test BLEU: {_bleu(metrics, TEST)}  CIDEr-D {metrics[metric(TEST, CIDER)]:.4f}")
    note = f" ({checkpoint_note})" if checkpoint_note else ""
    lines.append(f"checkpoint:       {ckpt_path}{note}")
    lines.append(f"inference bundle: {bundle}")
    lines.append(f"run folder:       {output_dir}")
    if curves is not None:
        lines.append(f"training curves:  {curves}")
    lines.append(f"caption images:   captioner caption IMAGE... --model {bundle}")
    return "\n".join(lines)


def _bleu(metrics: dict, split: str) -> str:
    """BLEU-1 to BLEU-4 of ``split``, on one line."""
    return "  ".join(f"BLEU-{n} {metrics[metric(split, name)]:.4f}" for n, name in enumerate(BLEU, 1))


def stopped_message(stop: str, checkpoint: str | None, folder: str, overrides: Sequence[str]) -> str:
    """One line for a run stopped by a signal, ``stop`` saying how and where ("training stopped by SIGTERM at epoch
    2, step 310"): the command that resumes it from its ``checkpoint``, or that none was written yet."""
    if not checkpoint:
        return f"{stop}, before its first checkpoint: nothing to resume, run it again"
    kept = [o for o in overrides if not o.startswith(_NOT_REPEATED)]
    command = shlex.join(["python", "train.py", *kept, f"ckpt_path={folder}"])
    return f"{stop}; its last checkpoint is {checkpoint}: resume it with {command}"


def finish_wandb(failed: bool) -> None:
    """Close the W&B run that ``logger=wandb`` opened, if any, so that the next job of a sweep gets its own."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)
