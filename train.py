"""Train (or validate) a Show, Attend and Tell captioner.

    python train.py                                   # built-in dataset, CPU, a few minutes
    python train.py model=hard trainer.max_epochs=3 data.batch_size=64
    python train.py -m model=soft,hard                # a sweep
    python train.py experiment=coco_soft              # the paper's COCO recipe
    python train.py ckpt_path=outputs/train/runs/<run>  # resume a run from its last checkpoint
    python train.py train=false ckpt_path=<.ckpt>     # validate a checkpoint only

Everything is composed from conf/ by Hydra; this file only wires the pieces together.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from captioner.errors import CaptionerError, ConfigError
from captioner.evaluation.results import write_metrics, write_results
from captioner.fileio import load_torch
from captioner.training.validate import validate_config

log = logging.getLogger("train")


def resolve_checkpoint(path: str | None) -> str | None:
    """A checkpoint file, or a run folder whose ``checkpoints/last.ckpt`` is used; checked loadable."""
    if path is None:
        return None
    ckpt = Path(path)
    if ckpt.is_dir():
        ckpt = ckpt / "checkpoints" / "last.ckpt"
    checkpoint = load_torch(ckpt, "checkpoint")
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(f"ckpt_path={path!r}: {ckpt} is not a Lightning checkpoint of this project")
    return str(ckpt)


def train(cfg: DictConfig) -> float | None:
    """Build data, model, callbacks, loggers and trainer from ``cfg``; fit; validate the best; export."""
    validate_config(OmegaConf.to_container(cfg, resolve=True))
    L.seed_everything(cfg.seed, workers=True)
    ckpt_path = resolve_checkpoint(cfg.ckpt_path)
    output_dir = Path(cfg.paths.output_dir)

    datamodule = instantiate(cfg.data, _convert_="all")
    datamodule.setup("fit")
    module = instantiate(cfg.model, vocab=datamodule.vocab, _convert_="all")
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)

    if cfg.train:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        ckpt_path = best or (ckpt_path if trainer.checkpoint_callback is None else
                             trainer.checkpoint_callback.last_model_path) or None
    metrics = trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True,
                               verbose=False)[0]
    if cfg.test:
        metrics.update(trainer.test(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True,
                                    verbose=False)[0])
    if not trainer.is_global_zero:
        return metrics.get("val/bleu4")

    write_results(output_dir / "val_captions.json",
                  {i: " ".join(w) for i, w in module.predictions["val"].items()})
    write_metrics(output_dir / "metrics.json", {k: float(v) for k, v in metrics.items()})
    bundle = output_dir / "bundle.pt"
    module.export_bundle(str(bundle))
    print(summary(metrics, ckpt_path, bundle, output_dir))
    return metrics.get("val/bleu4")


def summary(metrics: dict, ckpt_path: str | None, bundle: Path, output_dir: Path) -> str:
    """The lines a user acts on: the scores and where the files are."""
    lines = ["", "validation BLEU (0-1, nltk corpus BLEU over all references, decoded, not teacher-forced):"]
    lines.append("  " + "  ".join(f"BLEU-{n} {metrics.get(f'val/bleu{n}', float('nan')):.4f}" for n in range(1, 5)))
    if "val/attention_correctness" in metrics:
        lines.append(f"  attention correctness (attention mass inside the named object's box): "
                     f"{metrics['val/attention_correctness']:.3f}")
    if "test/bleu4" in metrics:
        lines.append("test BLEU: " + "  ".join(f"BLEU-{n} {metrics[f'test/bleu{n}']:.4f}" for n in range(1, 5)))
    lines.append(f"checkpoint:       {ckpt_path}")
    lines.append(f"inference bundle: {bundle}")
    lines.append(f"run folder:       {output_dir}")
    lines.append(f"caption images:   captioner caption IMAGE... --model {bundle}")
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point: user errors become one line on stderr and exit status 2."""
    try:
        return train(cfg)
    except CaptionerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except hydra.errors.InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, CaptionerError):
            print(f"error: {cause}", file=sys.stderr)
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
