"""Train (or validate) a Show, Attend and Tell captioner.

    python train.py                                   # built-in dataset, CPU, a few minutes
    python train.py model=hard trainer.max_epochs=3 data.batch_size=64
    python train.py -m model=soft,hard                # a sweep
    python train.py experiment=coco_soft              # the paper's COCO recipe
    python train.py ckpt_path=outputs/train/runs/<run>  # resume a run from its last checkpoint
    python train.py experiment=demo_scst ckpt_path=outputs/train/runs/<run>  # SCST from that run's model
    python train.py train=false ckpt_path=<.ckpt>     # validate a checkpoint only

Everything is composed from conf/ by Hydra; this file only wires the pieces together. Every run writes
into a new folder (its composed config printed and saved there as config.yaml), checkpoints are written
atomically, and a user error (a config value, an override, a file) prints one line ``error: ...`` on
stderr and exits with status 2. A run that fails says so in its folder: the error in ``train.log`` and
in a ``FAILED`` file.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import sys
import typing
import warnings
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import (
    CompactHydraException,
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from captioner.config import SCHEMAS
from captioner.errors import CaptionerError, ConfigError, first_line

log = logging.getLogger("train")


def register_schemas() -> None:
    """Make the settings dataclasses of ``captioner.config`` the schemas of the configs (``schema/<name>``)."""
    store = ConfigStore.instance()
    for name, schema in SCHEMAS.items():
        store.store(group="schema", name=name, node=schema)


register_schemas()


class _NoTips(logging.Filter):
    """Drops Lightning's advertisements ("💡 Tip: ... try installing litlogger / litmodels")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip:")


def log_lightning_to_the_run_log() -> None:
    """Send Lightning's messages where the run's own go (stdout and ``train.log``), not to stderr, without
    its advertisements for its cloud services (printed on every run whatever the logger).

    On import Lightning gives its loggers stderr handlers of their own, so stderr would mix its progress
    messages with the errors.
    """
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # rank_zero_info's logger
    if not any(isinstance(f, _NoTips) for f in tips.filters):
        tips.addFilter(_NoTips())


def train(cfg: DictConfig) -> float | None:
    """Build data, model, callbacks, loggers and trainer from ``cfg``; fit; validate the best; export."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    # Imported here, not at the top: Hydra's own errors (an unknown key or option) are reported at once.
    import lightning as L

    from captioner.evaluation.results import write_metrics, write_results
    from captioner.run_files import BUNDLE_NAME
    from captioner.training.run_folder import print_config_tree
    from captioner.training.start import model_settings, resolve_start
    from captioner.training.validate import check_environment, validate_config

    log_lightning_to_the_run_log()
    # A frozen encoder stays in eval mode on purpose (its BatchNorm statistics never move): not news.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    # Lightning's CombinedLoader builds torch's deprecated LeafSpec for every loader: its change to make.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    output_dir = Path(cfg.paths.output_dir)
    print_config_tree(plain, output_dir)
    validate_config(plain)
    source = build("data.source", plain["data"]["source"])
    check_environment(plain, source)
    start = resolve_start(cfg.ckpt_path, cfg.init_from, cfg.model.objective, cfg.model.scst.after_epochs)
    ckpt_path = start.resume
    L.seed_everything(cfg.seed, workers=True)
    if start.model is not None:  # the model of the checkpoint, not of the config
        with open_dict(cfg):
            for key, value in model_settings(start.model, plain, output_dir).items():
                OmegaConf.update(cfg, key, value, merge=True)  # full sections: a replacement
        plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        print_config_tree(plain, output_dir)  # the config that runs
    trainer = build_trainer(plain)  # before any data work: Lightning checks its arguments as it builds
    datamodule = build("data", {k: v for k, v in plain["data"].items() if k != "source"}, source=source)
    datamodule.setup("fit")
    module = build("model", plain["model"], vocab=datamodule.vocab)
    if start.init is not None:
        module.model.load_state_dict(start.model.model.state_dict())

    if cfg.train:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        ckpt_path = (
            best
            or (ckpt_path if trainer.checkpoint_callback is None else trainer.checkpoint_callback.last_model_path)
            or None
        )
    metrics = trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True, verbose=False)[0]
    if cfg.test:
        metrics.update(
            trainer.test(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True, verbose=False)[0]
        )
    if not trainer.is_global_zero:
        return metrics.get("val/bleu4")

    write_results(output_dir / "val_captions.json", {i: " ".join(w) for i, w in module.predictions["val"].items()})
    write_metrics(output_dir / "metrics.json", {k: float(v) for k, v in metrics.items()})
    bundle = output_dir / BUNDLE_NAME
    module.export_bundle(str(bundle))
    print(summary(metrics, ckpt_path, bundle, output_dir))
    return metrics.get("val/bleu4")


def summary(metrics: dict, ckpt_path: str | None, bundle: Path, output_dir: Path) -> str:
    """The lines a user acts on: the scores and where the files are."""
    lines = ["", "validation BLEU (0-1, nltk corpus BLEU over all references, decoded, not teacher-forced):"]
    lines.append("  " + "  ".join(f"BLEU-{n} {metrics.get(f'val/bleu{n}', float('nan')):.4f}" for n in range(1, 5)))
    if "val/cider" in metrics:
        lines.append(f"  CIDEr-D {metrics['val/cider']:.4f} (coco-caption's CIDEr on these tokens)")
    if "val/attention_correctness" in metrics:
        lines.append(
            f"  attention correctness (attention mass inside the named object's box): "
            f"{metrics['val/attention_correctness']:.3f}"
        )
    if "test/bleu4" in metrics:
        lines.append(
            "test BLEU: "
            + "  ".join(f"BLEU-{n} {metrics[f'test/bleu{n}']:.4f}" for n in range(1, 5))
            + f"  CIDEr-D {metrics.get('test/cider', float('nan')):.4f}"
        )
    lines.append(f"checkpoint:       {ckpt_path}")
    lines.append(f"inference bundle: {bundle}")
    lines.append(f"run folder:       {output_dir}")
    lines.append(f"caption images:   captioner caption IMAGE... --model {bundle}")
    return "\n".join(lines)


def build_trainer(plain: dict) -> object:
    """The Lightning trainer of the config ``plain``, with its callbacks, loggers and atomic checkpoint writes."""
    from captioner.training.checkpoint_io import AtomicCheckpointIO

    callbacks = [build(f"callbacks.{name}", node) for name, node in (plain.get("callbacks") or {}).items() if node]
    loggers = [build(f"logger.{name}", node) for name, node in (plain.get("logger") or {}).items() if node]
    return build(
        "trainer", plain["trainer"], callbacks=callbacks, logger=loggers or False, plugins=[AtomicCheckpointIO()]
    )


def build(section: str, node: dict, **given: object) -> object:
    """``hydra.utils.instantiate`` the plain config ``node`` and call it with ``given``; an argument its class
    refuses (Lightning's own checks of its trainer, callbacks and loggers included) becomes one ConfigError
    naming ``section``."""
    from hydra.utils import instantiate
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        return instantiate(node, _partial_=True, _convert_="all")(**given)
    except InstantiationException as exc:  # the class cannot be found, or its config is malformed
        error: BaseException = exc.__cause__ or exc
        message = " ".join(str(error).split())
    except (CaptionerError, TypeError, ValueError, MisconfigurationException) as exc:
        error, message = exc, first_line(exc)
    ours = isinstance(error, CaptionerError)  # this project's messages start with the key they are about
    if ours and message.startswith(f"{section}."):
        raise error from None
    raise ConfigError(f"{section}{'.' if ours else ': '}{message}") from None


def one_line(exc: BaseException) -> str:
    """A Hydra or OmegaConf error (an unknown key or option, a bad override or value) as one line, from the
    exception's type and fields."""
    schema = exc.object_type if dataclasses.is_dataclass(getattr(exc, "object_type", None)) else None
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)) and schema is not None:
        fields = [f.name for f in dataclasses.fields(schema) if f.name != "_target_"]
        return f"{exc.full_key} is not a known key; valid keys: {', '.join(fields)}"
    if isinstance(exc, ValidationError) and schema is not None and exc.key in typing.get_type_hints(schema):
        kind = typing.get_type_hints(schema)[exc.key]
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return f"{exc.full_key}={exc.value!r} is not valid; choose one of: {', '.join(kind.__members__)}"
        if kind is bool:
            return f"{exc.full_key}={exc.value!r} must be true or false"
        return f"{exc.full_key}={exc.value!r} must be {getattr(kind, '__name__', kind)}"
    if isinstance(exc, OmegaConfBaseException):
        return f"{exc.full_key}: {first_line(exc)}" if exc.full_key else first_line(exc)
    if isinstance(exc, MissingConfigException):
        options = f"; choose one of: {', '.join(exc.options)}" if exc.options else ""
        return f"no config {exc.missing_cfg_file!r}{options}"
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the override {exc.override!r}: {first_line(exc)}"
    if isinstance(exc, ConfigCompositionException):  # Hydra raises it while handling OmegaConf's error
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OmegaConfBaseException):
            return one_line(cause)
    return first_line(exc)


def fail(message: str) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def stop_reason(exc: BaseException) -> str | None:
    """One line for an exception that ends a run (None for a clean ``SystemExit``)."""
    if isinstance(exc, SystemExit):
        return None if exc.code in (0, None) else f"stopped with exit status {exc.code}"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (KeyboardInterrupt)"
    return first_line(exc, with_type=True)


def finish_wandb(failed: bool) -> None:
    """Close the W&B run that ``logger=wandb`` opened, if any, so that the next job of a sweep gets its own."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point: user errors become one line on stderr and exit status 2.

    Python warnings go to the run's log (stdout and ``train.log``), so stderr holds errors only. A run
    that fails, whatever the reason, is marked so in its folder (``run_folder.mark_failed``).
    """
    from captioner.training.run_folder import mark_failed

    logging.captureWarnings(True)
    folder = HydraConfig.get().runtime.output_dir
    failure: str | None = None
    try:
        return train(cfg)
    except CaptionerError as exc:
        failure = str(exc)
    except (CompactHydraException, OmegaConfBaseException) as exc:
        cause = exc.__cause__
        failure = str(cause) if isinstance(cause, CaptionerError) else one_line(exc)
    except BaseException as exc:  # a crash or an interrupt: marked, then reported as Python reports it
        failure = stop_reason(exc)
        if failure is not None:
            mark_failed(folder, failure)
        raise
    finally:
        finish_wandb(failed=failure is not None)
    mark_failed(folder, failure)
    fail(failure)


def cli() -> None:
    """``python train.py``: Hydra's composition errors (before ``main`` runs) also become one line, exit 2.

    Hydra prints those over several lines and exits with status 1; with ``HYDRA_FULL_ERROR=1`` it raises
    them instead, so they are caught here. A user who sets ``HYDRA_FULL_ERROR=1`` gets Hydra's full report.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (CompactHydraException, OmegaConfBaseException) as exc:
        fail(one_line(exc))


if __name__ == "__main__":
    cli()
