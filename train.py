"""Train (or validate) a Show, Attend and Tell captioner.

    python train.py                                   # built-in dataset: about 5 minutes on 2 CPU cores
    python train.py model=hard trainer.max_epochs=3 data.batch_size=64
    python train.py -m model=soft,hard                # a sweep, one job after another
    python train.py -m hydra/launcher=local model=soft,hard   # each job in a process of its own (submitit)
    python train.py -m hydra/launcher=slurm hydra.launcher.partition=gpu model=soft,hard   # SLURM jobs
    python train.py experiment=coco_soft              # the paper's COCO recipe
    python train.py ckpt_path=outputs/train/runs/<run>  # resume a run from its last checkpoint
    python train.py experiment=demo_scst ckpt_path=outputs/train/runs/<run>  # SCST from that run's model
    python train.py train=false ckpt_path=<.ckpt>     # validate a checkpoint only

Everything is composed from conf/ by Hydra; this file only wires the pieces together. Every run writes
into a new folder (its composed config printed and saved there as config.yaml), checkpoints are written
atomically, and a user error (a config value, an override, a file) prints one line ``error: ...`` on
stderr and exits with status 2; a wrong value (an argument the trainer, a callback or a logger does not take, or
of a type it does not take, included) is found before the config is printed and the run's folder is created
(``training/validate.py``), and so is every missing file or device and a checkpoint the run cannot start from,
all listed at once (``training/preflight.py``). A run that fails says so in its folder: the error in ``train.log``
and in a ``FAILED`` file. A run stopped by SIGTERM or Ctrl-C says how to resume it (in its folder too: a
``STOPPED`` file) and exits with 128 + the signal's number (143, 130). A job of a sweep that fails is marked so and
the sweep goes on; the sweep then ends with every failed or stopped job's line (``training/run_folder.py``),
status 2.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, InstantiationException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from captioner.errors import CaptionerError, RunStopped, first_line, stop_reason
from captioner.training.command_line import error_line, refused_override, section_error
from captioner.training.run_folder import JobsFailed
from captioner.training.schemas import register_schemas
from captioner.training.validate import ConfigRefused, check_run

log = logging.getLogger("train")
# The launcher of ``-m`` that runs each job in the sweep's own process, one after another (Hydra's default).
IN_PROCESS_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def train(cfg: DictConfig) -> float | None:
    """Build data, model, callbacks, loggers and trainer from ``cfg``; fit; validate the best; export."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    # Imported here, not at the top: a config error is reported before torch is imported.
    import lightning as L

    from captioner.config import to_dict
    from captioner.evaluation.results import write_metrics, write_results
    from captioner.model.vocab_transfer import load_trained_weights
    from captioner.run_files import BUNDLE_NAME, CURVES_FILE, METRICS_FILE, VAL_CAPTIONS_FILE
    from captioner.training import quick_checks
    from captioner.training.datamodule import CaptionDataModule
    from captioner.training.loggers import log_final, loggers_aside
    from captioner.training.logs import route_lightning_logs, summary
    from captioner.training.metrics import PROGRESS, TEST, VAL, metric
    from captioner.training.module import CaptionerModule
    from captioner.training.run_folder import print_config_tree
    from captioner.training.start import model_settings, resolve_start, vocab_grows
    from captioner.training.validate import validate_config

    route_lightning_logs()
    output_dir = Path(cfg.paths.output_dir)
    print_config_tree(plain, output_dir)
    source = build("data.source", plain["data"]["source"])
    start = resolve_start(cfg.ckpt_path, cfg.init_from, cfg.model.objective, cfg.model.scst.after_epochs)
    if start.model is not None:  # the model of the checkpoint, not of the config
        with open_dict(cfg):
            for key, value in model_settings(start, plain, output_dir).items():
                OmegaConf.update(cfg, key, value, merge=True)
        plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        print_config_tree(plain, output_dir)  # the config that runs
    settings = validate_config(plain)  # the typed config, from here on
    grow_vocab = vocab_grows(start, settings)
    ckpt_path = start.resume
    L.seed_everything(settings.seed, workers=True)
    trainer = build_trainer(plain)  # before any data work: Lightning checks its arguments as it builds
    with building("data"):
        datamodule = CaptionDataModule(source, settings.data, grow_vocab=grow_vocab)
        datamodule.setup("fit")
    with building("model"):
        module = CaptionerModule(datamodule.vocab, settings.model, pretrained=start.model is None)
    if start.init is not None:  # with init_vocab=grow, the new words' rows as the new model drew them
        load_trained_weights(module.model, start.model.model, datamodule.vocab.itos, start.model.vocab.itos)

    checkpoint_note = None
    if settings.train:
        quick_checks.check_val_interval(trainer, datamodule)
        fraction = quick_checks.fit_val_fraction(trainer, datamodule)  # first: the notes read the limit it sets
        for note in [fraction, *quick_checks.start_notes(trainer, module.settings, datamodule)]:
            if note is not None:
                log.warning(note)
        with stoppable(trainer, "training"):
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        ckpt_path = (
            best
            or (ckpt_path if trainer.checkpoint_callback is None else trainer.checkpoint_callback.last_model_path)
            or None
        )
        checkpoint_note = quick_checks.checkpoint_note(trainer, datamodule)
    epochs_decoding = module.settings.decoding
    module.settings.decoding = epochs_decoding.for_captioning()  # the scores `captioner evaluate` gives
    evaluate = {"datamodule": datamodule, "ckpt_path": ckpt_path, "weights_only": True, "verbose": False}
    with loggers_aside(trainer) as run_loggers:  # logged below as final/<split>/<name>, not as another epoch
        with stoppable(trainer, "validation"):
            metrics = next(iter(trainer.validate(module, **evaluate)), {})  # none: no validation batch
        if settings.test:
            with stoppable(trainer, "test"):
                metrics.update(next(iter(trainer.test(module, **evaluate)), {}))
    if not trainer.is_global_zero:
        return metrics.get(metric(VAL, PROGRESS))

    decoded = f"{module.settings.decoding.describe()} as `captioner evaluate` decodes"
    if settings.train and epochs_decoding != module.settings.decoding:
        decoded += f"; each epoch's validation, which picked the checkpoint: {epochs_decoding.describe()}"
    if (read := module.model.decoder.hard_read) is not None:
        decoded += f"; {read.describe()}"
    if VAL in module.predictions:
        write_results(output_dir / VAL_CAPTIONS_FILE, {i: " ".join(w) for i, w in module.predictions[VAL].items()})
    final_scores = log_final(run_loggers, metrics, trainer.global_step, decoded)
    write_metrics(output_dir / METRICS_FILE, {"decoding": to_dict(module.settings.decoding), **final_scores})
    bundle = output_dir / BUNDLE_NAME
    module.export_bundle(str(bundle))
    missing = {
        split: reason
        for split, wanted in ((VAL, True), (TEST, settings.test))
        if (reason := quick_checks.not_computed(metrics, split, wanted, trainer)) is not None
    }
    curves = output_dir / CURVES_FILE  # callbacks.samples draws it when training ends
    curves = curves if curves.is_file() else None
    print(summary(metrics, ckpt_path, bundle, output_dir, missing, checkpoint_note, decoded, curves))
    return metrics.get(metric(VAL, PROGRESS))


@contextmanager
def stoppable(trainer: object, stage: str) -> Iterator[None]:
    """A stop by SIGTERM or Ctrl-C while ``trainer`` runs ``stage`` ("training", "validation", "test") becomes
    RunStopped, whose message resumes the run."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from captioner.training.logs import stopped_message

    try:
        yield
    except SystemExit as exc:  # Lightning raises SIGTERMException on SIGTERM, and exits with 1 after Ctrl-C
        if isinstance(exc, SIGTERMException):
            signum = signal.SIGTERM
        elif trainer.interrupted:
            signum = signal.SIGINT
        else:
            raise
        saved = (p for cb in trainer.checkpoint_callbacks for p in (cb.last_model_path, cb.best_model_path) if p)
        checkpoint = next((p for p in saved if Path(p).is_file()), None)
        run = HydraConfig.get()
        stop = f"{stage} stopped by {signum.name} at epoch {trainer.current_epoch}, step {trainer.global_step}"
        message = stopped_message(stop, checkpoint, run.runtime.output_dir, run.overrides.task)
        raise RunStopped(message, signum) from None


def build_trainer(plain: dict) -> object:
    """The Lightning trainer of the config ``plain``, with its callbacks, loggers and atomic checkpoint writes."""
    from captioner.training.checkpoint_io import AtomicCheckpointIO

    callbacks = [build(f"callbacks.{name}", node) for name, node in (plain.get("callbacks") or {}).items() if node]
    loggers = [build(f"logger.{name}", node) for name, node in (plain.get("logger") or {}).items() if node]
    return build(
        "trainer", plain["trainer"], callbacks=callbacks, logger=loggers or False, plugins=[AtomicCheckpointIO()]
    )


def build(section: str, node: dict, **given: object) -> object:
    """``hydra.utils.instantiate`` the plain config ``node`` (a ``_target_`` and its arguments) and call it with
    ``given``; errors as ``building(section)`` reports them."""
    from hydra.utils import instantiate

    with building(section):
        return instantiate(node, _partial_=True, _convert_="all")(**given)


@contextmanager
def building(section: str) -> Iterator[None]:
    """An argument the object of config ``section`` refuses as it is built (Lightning's own checks of its
    trainer, callbacks and loggers included) becomes one ConfigError naming ``section``."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        yield
    except InstantiationException as exc:  # the class cannot be found, or its config is malformed
        error: BaseException = exc.__cause__ or exc
        raise section_error(section, error, " ".join(str(error).split())) from None
    except (CaptionerError, TypeError, ValueError, MisconfigurationException) as exc:
        raise section_error(section, exc, first_line(exc)) from None


def fail(message: str, status: int = 2) -> NoReturn:
    """Print ``error: <line>`` on stderr for each line of ``message`` and exit with ``status``."""
    for line in message.splitlines():
        print(f"error: {line}", file=sys.stderr)
    sys.exit(status)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point: user errors become one line on stderr and exit status 2, a stop by a signal one
    line and 128 + its number.

    Python warnings go to the run's log (stdout and ``train.log``), so stderr holds errors only. A run
    that fails, whatever the reason, is marked so in its folder (``run_folder.mark_failed``), and one stopped by
    SIGTERM or Ctrl-C, wherever it was, is marked stopped (``run_folder.mark_stopped``: how to resume it). A job of a
    sweep is checked as a single run is before it starts (``validate.check_run``); when it fails the sweep
    goes on (``sweep_goes_on``) and reports it at its end. A launcher that runs a job in a process of its own
    (submitit's) pickles this function by value, with the functions of this file it calls; the job's process
    imports the rest (captioner, Lightning) from the same installation.
    """
    from captioner.run_files import CHECKPOINT_DIR, LAST_CHECKPOINT
    from captioner.training.logs import finish_wandb, stopped_message
    from captioner.training.run_folder import mark_failed, mark_stopped

    run = HydraConfig.get()
    failure: str | None = None
    status, stopped = 2, False
    if own_process(run):
        share_ranks()
    try:
        if run.mode == RunMode.MULTIRUN:
            check_run(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
        return train(cfg)
    except CaptionerError as exc:
        failure = str(exc)
    except RunStopped as exc:
        failure, status, stopped = str(exc), exc.status, True
    except KeyboardInterrupt:  # Ctrl-C outside the trainer's loops (``stoppable``'s): reading data, exporting
        last = Path(run.runtime.output_dir) / CHECKPOINT_DIR / LAST_CHECKPOINT
        checkpoint = str(last) if last.is_file() else None
        failure = stopped_message("run stopped by SIGINT", checkpoint, run.runtime.output_dir, run.overrides.task)
        status, stopped = 128 + signal.SIGINT, True
    except (CompactHydraException, OmegaConfBaseException) as exc:
        failure = error_line(exc)
    except BaseException as exc:  # a crash: marked, then reported as Python reports it
        failure = stop_reason(exc)
        if failure is not None:
            mark_failed(run.runtime.output_dir, failure)
            if own_process(run):  # the sweep's process gets the exception without its traceback
                log.exception("the job crashed")
        raise
    finally:
        finish_wandb(failed=failure is not None)
    (mark_stopped if stopped else mark_failed)(run.runtime.output_dir, failure)
    if sweep_goes_on(run, status):
        return None
    fail(failure, status)


def sweep_goes_on(run: DictConfig, status: int) -> bool:
    """Whether the job (of Hydra config ``run``) that failed with exit ``status`` is one of a sweep whose other
    jobs go on: always, but after a stop by a signal (Ctrl-C, SIGTERM) in the sweep's own process, which stops
    the sweep there."""
    return run.mode == RunMode.MULTIRUN and (status == 2 or own_process(run))


def share_ranks() -> None:
    """Give each task of a job that submitit's local executor started as several (``hydra/launcher=local``: one
    per device) its rank's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as torchrun would,
    before anything reads them: Lightning then takes the tasks as its DDP ranks instead of starting processes
    of its own (which would run submitit's command again: facebookresearch/hydra#2231), and only rank 0 checks
    files, prints and marks the folder. SLURM's tasks have their variables from SLURM."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "local":
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks > 1:
        ranks = TorchDistributedEnvironment()
        ranks.master_addr = "127.0.0.1"  # one machine, whatever its host name resolves to
        ranks.export(set_cuda_visible_devices=False, overwrite=True)


def own_process(run: DictConfig) -> bool:
    """Whether the Hydra config ``run`` is that of a job of a sweep that runs in a process of its own
    (``hydra/launcher=local`` or ``slurm``), not in the sweep's."""
    return run.mode == RunMode.MULTIRUN and run.launcher._target_ != IN_PROCESS_LAUNCHER


def cli() -> None:
    """``python train.py``: Hydra's composition errors, a wrong value and what preflight found (before ``main``
    runs) also become one line each, exit 2; ``--help`` shows the settings (``training/command_line.py``).

    Hydra prints its errors over several lines and exits with status 1; with ``HYDRA_FULL_ERROR=1`` it raises
    them instead, so they are caught here. A user who sets ``HYDRA_FULL_ERROR=1`` gets Hydra's full report.
    """
    args = sys.argv[1:]
    if "--help" in args or "-h" in args:
        from captioner.training.command_line import help_page

        print(help_page())
        return
    register_schemas()  # before main() composes conf/ with them
    full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    refused = refused_override(args)
    if refused and not full:
        fail(refused)
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except ConfigRefused as exc:  # training/validate.py's ValidateConfig, before the run's folder exists
        if full:
            raise exc.error from None
        fail(error_line(exc.error))
    except JobsFailed as exc:  # a sweep whose jobs failed, each marked in its folder
        fail(exc.message)
    except (CaptionerError, CompactHydraException, OmegaConfBaseException) as exc:
        if full:
            raise
        fail(error_line(exc))


if __name__ == "__main__":
    cli()
