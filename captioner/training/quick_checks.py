"""Lightning's quick-check overrides (``max_steps``, ``limit_*_batches``, ``fast_dev_run``, ...) said plainly.

Users shorten runs with trainer overrides; each one leaves out part of what the recipe does. ``start_notes``
gives one line, before training, for each part an override leaves out (SCST after an epoch that never comes,
no validation during training, so no best checkpoint and no early stopping); ``fit_val_fraction`` turns a
``limit_val_batches`` fraction of fewer than one batch into one batch (Lightning refuses it after setting
up); ``check_val_interval`` refuses a ``val_check_interval`` longer than an epoch with one line, where
Lightning's refusal is a traceback. ``not_computed`` says why a metric group is missing from the final scores,
``checkpoint_note`` why the checkpoint evaluated is ``last.ckpt``, for the closing summary (``logs.summary``).
``fit_log_interval`` gives an epoch of few steps several points of the training curves where
``log_every_n_steps`` would give it one.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L

from captioner.config import Objective
from captioner.errors import ConfigError
from captioner.training.metrics import PROGRESS, VAL, metric
from captioner.training.schedule import steps_per_epoch

POINTS_PER_EPOCH = 4  # the fewest points of the training curves an epoch gets (fit_log_interval), if it has the steps


def _batches(count: int, limit: int | float) -> int:
    """The batches Lightning runs of ``count`` with ``limit_*_batches=limit`` (an int: at most that many)."""
    if isinstance(limit, int):
        return min(count, limit)
    return int(count * limit) if limit < 1 else count


def train_batches(trainer: L.Trainer, datamodule: Any) -> int:
    """Training batches per epoch, with the trainer's ``limit_train_batches``."""
    return _batches(math.ceil(datamodule.train_items() / datamodule.settings.batch_size), trainer.limit_train_batches)


def val_batches(datamodule: Any) -> int:
    """Validation batches of the whole split."""
    return math.ceil(len(datamodule.splits[VAL]) / datamodule.eval_batch_size)


def epochs_run(trainer: L.Trainer, datamodule: Any) -> int:
    """The epochs a fit will run (started ones included), as far as ``max_epochs``, ``max_steps`` and
    ``fast_dev_run`` say (``max_time`` and early stopping may end it sooner)."""
    if trainer.fast_dev_run:
        return 1
    epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else math.inf
    if trainer.max_steps not in (None, -1):
        steps_per_epoch = max(1, math.ceil(train_batches(trainer, datamodule) / trainer.accumulate_grad_batches))
        epochs = min(epochs, math.ceil(trainer.max_steps / steps_per_epoch))
    return int(epochs)


def fit_val_fraction(trainer: L.Trainer, datamodule: Any) -> str | None:
    """Make a ``limit_val_batches`` fraction that gives no batch of this split validate one batch, and say so
    (None: nothing to change)."""
    limit = trainer.limit_val_batches
    count = val_batches(datamodule)
    if isinstance(limit, float) and 0 < limit < 1 and count > 0 and int(count * limit) == 0:
        trainer.limit_val_batches = 1
        return (
            f"trainer.limit_val_batches={limit} of {count} validation batch(es) is less than one batch: "
            "validating 1 batch"
        )
    return None


def check_val_interval(trainer: L.Trainer, datamodule: Any) -> None:
    """ConfigError for a ``val_check_interval`` of more training batches than an epoch has, which Lightning
    refuses with a traceback once training starts (unless ``check_val_every_n_epoch`` is null: it counts batches
    across epochs). The batches of all ranks are counted: one rank's of several may be fewer still."""
    interval, batches = trainer.val_check_interval, train_batches(trainer, datamodule)
    if isinstance(interval, int) and trainer.check_val_every_n_epoch is not None and interval > batches:
        raise ConfigError(
            f"trainer.val_check_interval={interval} is more than the {batches} training batches of an epoch: give at "
            "most that many, a fraction of an epoch (0.5), or trainer.check_val_every_n_epoch=null to count batches "
            "across epochs"
        )


def no_validation_reason(trainer: L.Trainer, datamodule: Any) -> str | None:
    """Why training will run no validation (None: it will validate)."""
    if trainer.limit_val_batches == 0:
        return f"trainer.limit_val_batches={trainer.limit_val_batches}"
    epochs = epochs_run(trainer, datamodule)
    every = trainer.check_val_every_n_epoch
    if every is not None and epochs < every:
        return f"trainer.check_val_every_n_epoch={every} with {epochs} epoch(s) to run"
    if epochs == 1 and trainer.max_steps not in (None, -1) and not trainer.fast_dev_run:
        steps = math.ceil(train_batches(trainer, datamodule) / trainer.accumulate_grad_batches)
        if trainer.max_steps < steps and trainer.val_check_interval == 1.0:
            return f"trainer.max_steps={trainer.max_steps} ends the only epoch (of {steps} steps) before its validation"
    return None


def start_notes(trainer: L.Trainer, settings: Any, datamodule: Any) -> list[str]:
    """One line for each part of the recipe that the trainer's settings leave out (``settings``: the model's
    ``ModelConfig``): SCST that never starts, validation that never runs."""
    notes = []
    epochs = epochs_run(trainer, datamodule)
    after = settings.scst.after_epochs
    if settings.objective == Objective.scst and after > 0 and epochs <= after:
        notes.append(
            f"model.objective=scst switches to self-critical training after {after} cross-entropy epoch(s) "
            f"(model.scst.after_epochs), but this run ends within {epochs} epoch(s): it trains with cross-entropy only"
        )
    reason = no_validation_reason(trainer, datamodule)
    if reason is not None:
        notes.append(
            f"{reason}: no validation during training, so no early stopping and no best checkpoint "
            f"(the last one, last.ckpt, is evaluated and exported)"
        )
    return notes


def fit_log_interval(trainer: L.Trainer) -> str | None:
    """Make an epoch of fewer than ``POINTS_PER_EPOCH`` times ``trainer.log_every_n_steps`` optimiser steps log the
    training metrics (and learning rates) every ``steps // POINTS_PER_EPOCH`` steps (at least every step), and say
    so; None: nothing to change (the epoch is long enough, or has no length). Lightning logs every
    ``log_every_n_steps`` steps, so a small run (10 steps an epoch, the default 10) would draw one training-loss
    point an epoch."""
    steps, every = steps_per_epoch(trainer), trainer.log_every_n_steps
    if steps is None or every * POINTS_PER_EPOCH <= steps:
        return None
    interval = max(1, steps // POINTS_PER_EPOCH)
    if interval >= every:
        return None
    trainer.log_every_n_steps = interval
    points = steps // interval
    return (
        f"trainer.log_every_n_steps={every} with {steps} optimiser steps an epoch: the training metrics are logged "
        f"every {interval} step(s) instead, {points} points an epoch"
    )


def checkpoint_note(trainer: L.Trainer, datamodule: Any) -> str | None:
    """Why the run's evaluated checkpoint is its last one, not the best by the monitored metric (None: it is
    the best, or the run trained nothing)."""
    callback = trainer.checkpoint_callback
    if callback is None or callback.best_model_path or callback.monitor is None:
        return None
    if trainer.fast_dev_run:
        why = "trainer.fast_dev_run selects no best checkpoint"
    else:
        why = no_validation_reason(trainer, datamodule) or "no validation during training computed it"
    return f"the last one: no epoch logged {callback.monitor}; {why}"


def not_computed(metrics: dict[str, float], split: str, wanted: bool, trainer: L.Trainer) -> str | None:
    """Why the metrics of ``split`` (``wanted``: the run asked for them) are missing (None: they exist)."""
    if metric(split, PROGRESS) in metrics:
        return None
    if not wanted:
        return f"{split}=false"
    limit = getattr(trainer, f"limit_{split}_batches")
    if limit == 0:
        return f"trainer.limit_{split}_batches=0"
    return f"no {split} image could be decoded"
