"""Training callbacks of the captioner: the non-finite guard, and the best checkpoint and early stopping of the
epochs that have their metric, outside hard attention's warm-up.

A NaN/inf loss, or NaN/inf gradients, are handled without reading them back every step (a host
synchronisation that stalls a GPU): the optimiser skips its step on the device, and the host looks at the
flags every ``check_interval`` steps, before every checkpoint and at the end of each epoch.
``CaptionerModule.configure_callbacks`` adds the guard to every run, with the module's ``nonfinite`` settings.

Under 16-mixed the plugin's ``GradScaler`` already skips the step of non-finite gradients (an fp16 overflow
while the scale settles is routine, not reported); the guard adds the loss's flag to it
(``optimization.unscale_for_step``). Under every other precision the guard checks the gradients itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from captioner.config import NonFinite
from captioner.errors import CaptionerError
from captioner.training.optimization import is_fused, nonfinite_gradients, unscale_for_step

log = logging.getLogger(__name__)


class NonFiniteLossError(CaptionerError):
    """The training loss or its gradients became NaN or infinite (``model.nonfinite=stop``)."""

    def __init__(self, value: float, where: str, checkpoint: str | None, gradients: bool = False) -> None:
        """``value`` the loss at training step ``where`` (``gradients``: finite, its gradients were not);
        ``checkpoint`` the last one written (None: none yet)."""
        kept = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint had been saved yet"
        what = f"gradients (loss {value})" if gradients else f"loss ({value})"
        super().__init__(
            f"non-finite {what} at {where}; training stopped, {kept} (model.nonfinite=skip skips such batches instead)"
        )


class NonFiniteLossGuard(L.Callback):
    """Skip the optimiser step of a NaN/inf loss or gradient on the device; report it (``skip``) or stop (``stop``).

    Every rank takes the same decision (the loss flags are summed over ranks, the gradients are the
    all-reduced ones), so a NaN on one rank never leaves the others updating with the NaN gradients it
    shares with them.
    """

    def __init__(self, action: NonFinite = NonFinite.stop, check_interval: int = 50) -> None:
        """``action``: what a non-finite loss does once the host sees it; ``check_interval``: training steps
        between host reads of the flags."""
        self.action = NonFinite(action)
        self.check_interval = check_interval
        # (epoch, step, [loss, loss non-finite, gradients non-finite]) of each optimiser step, on the device
        self.unchecked: list[tuple[int, int, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []  # [loss, non-finite] of each backward since the last step
        self.backward_in_batch = False  # whether this batch's training_step returned a loss

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """A new batch: no backward yet."""
        self.backward_in_batch = False

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        """Flag the coming optimiser step on the device when the training step's loss is not finite on a rank.

        ``loss`` is what Lightning back-propagates: the training step's divided by ``accumulate_grad_batches``
        and, under 16-mixed, multiplied by the scaler's scale; the loss recorded is the training step's, the
        mean over the ranks (NaN when a rank's is), reduced with the flag in one collective."""
        value = loss.detach().float() * trainer.accumulate_grad_batches
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            value = value / scaler._get_scale_async()  # the scale as a tensor: no host read
        record = torch.stack([value, (~torch.isfinite(value)).float()])
        self.losses.append(trainer.strategy.reduce(record, reduce_op="mean"))  # [loss, share of ranks non-finite]
        self.backward_in_batch = True

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Make the coming step skip a non-finite loss (accumulated batches: any of them) or gradient, on the
        device; see ``skip_flagged_step`` and ``optimization.unscale_for_step``."""
        losses, self.losses = self.losses, []
        if not losses:  # no backward since the last step: no gradients, or Lightning takes no step
            skip_flagged_step(optimizer, None)
            return
        loss, nonfinite = torch.stack(losses).mean(dim=0)  # over the accumulated batches: the step's loss
        nonfinite = nonfinite > 0
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        gradients = None
        if scaler is not None:
            if self.backward_in_batch:  # else the plugin takes no step (its training_step returned None)
                unscale_for_step(scaler, optimizer, nonfinite)
        else:
            gradients = nonfinite_gradients(optimizer)
            skip_flagged_step(optimizer, nonfinite if gradients is None else nonfinite | gradients)
        flags = [loss, nonfinite.float(), torch.zeros_like(loss) if gradients is None else gradients.to(loss)]
        self.unchecked.append((trainer.current_epoch, trainer.global_step, torch.stack(flags)))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Look at the recorded flags every ``check_interval`` training steps."""
        if len(self.unchecked) >= self.check_interval:
            self.check(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Look at the last flags of the epoch."""
        self.check(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """Look at the flags before a checkpoint is written: with ``stop`` a non-finite one stops before it."""
        self.check(trainer)

    def check(self, trainer: L.Trainer) -> None:
        """Read the flags recorded since the last check back to the host (one synchronisation) and report
        the skipped steps: with ``skip`` one warning each, with ``stop`` NonFiniteLossError for the first.

        Their optimiser steps were skipped on the device, so the weights, and every checkpoint (this check
        runs before each one is written), hold no update from a non-finite loss or gradient; stopping raises
        within ``check_interval`` steps, and the last checkpoint written is from before the bad step. The
        step counter and the schedule still advanced.
        """
        if not self.unchecked:
            return
        unchecked, self.unchecked = self.unchecked, []
        rows = torch.stack([flags for *_, flags in unchecked]).tolist()
        for (epoch, step, _), (value, bad_loss, bad_gradients) in zip(unchecked, rows):
            if not (bad_loss or bad_gradients):
                continue
            where = f"epoch {epoch}, step {step}"
            if self.action == NonFinite.stop:
                raise NonFiniteLossError(value, where, _last_checkpoint(trainer), gradients=not bad_loss)
            what = f"loss ({value})" if bad_loss else f"gradients (loss {value})"
            log.warning("non-finite %s at %s: batch skipped, no parameter update", what, where)


def skip_flagged_step(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor | None) -> None:
    """Make the coming ``optimizer.step()`` change nothing when ``nonfinite`` (a () bool tensor) is set.

    A skipped step changes nothing: not the parameters, not Adam's moments, not its step count (the
    learning-rate schedule still advances, as Lightning steps it). Zeroing the loss would not do: Adam
    would still move every parameter by its momentum and decay its moments, and NaN gradients can come out
    of a zeroed NaN graph. A fused optimiser (``training.optimization.build_optimizer``'s) takes the flag as
    ``found_inf`` (the mechanism of ``torch.amp.GradScaler``); a plain one (on a device without fused
    kernels, or whose fused step cannot take ``found_inf``) drops the gradients instead, which needs a host
    read of the flag every step.
    """
    if is_fused(optimizer):
        if nonfinite is None:
            optimizer.__dict__.pop("found_inf", None)
        else:
            optimizer.found_inf = nonfinite.float()  # 1.0: skip (GradScaler's convention)
    elif nonfinite is not None and bool(nonfinite):
        optimizer.zero_grad(set_to_none=True)  # parameters without gradients are not updated


def in_warmup(trainer: L.Trainer) -> bool:
    """Whether the model being trained is inside hard attention's warm-up, where a validation neither gives the
    best checkpoint nor counts for early stopping (``CaptionerModule.in_warmup``; False for another module)."""
    return getattr(trainer.lightning_module, "in_warmup", False)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, for which a validation without the monitored metric (an attention
    correctness that no caption allowed, a metric a quick-check override left out) makes that epoch no
    candidate for the best checkpoint, with a warning, where Lightning raises once a validation has run; nor
    does a validation inside hard attention's warm-up (unless ``model.select_in_warmup``).
    ``last.ckpt`` is written after every save all the same (``save_last``), where Lightning writes it only
    after a save that made a new best checkpoint.

    A run resumed into a new folder (``ckpt_path=`` an earlier run: every run has its own folder) keeps the
    earlier run's best checkpoints as candidates, where Lightning forgets their scores once the folder changes
    and makes the first epoch after the resume the best, however it scores: they are linked (else copied) into
    this run's folder, under their names, when training starts, and an epoch must beat them. The earlier
    folder is left as it is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._earlier: dict[str, Any] | None = None  # the state of a run resumed from another folder

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's; the state of a checkpoint written in another folder is kept for :meth:`on_train_start`
        (Lightning's warning that it forgets the scores is left out: they are carried over there)."""
        moved = state_dict.get("dirpath", self.dirpath) != self.dirpath
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed")
            super().load_state_dict(state_dict)
        self._earlier = dict(state_dict) if moved and state_dict.get("best_k_models") else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Lightning's; then the best checkpoints of the run this one resumed from another folder, carried over."""
        super().on_train_start(trainer, pl_module)
        if self._earlier is not None:
            self._carry_over(trainer, self._earlier)
            self._earlier = None

    def _carry_over(self, trainer: L.Trainer, earlier: dict[str, Any]) -> None:
        """Make the earlier run's best checkpoints that still exist this run's candidates: each linked (a copy
        where the file system has no links) into ``dirpath`` by rank 0, under its name, with its score. At most
        as many as this run keeps, the best by its ``mode``: ``save_top_k`` of them, none with 0, and with -1
        (every epoch kept, none ever compared away) only the best, the one to beat. Lightning's top-k then
        removes them as this run's epochs beat them, as it does its own."""
        count = 1 if self.save_top_k < 0 else self.save_top_k
        candidates = {path: score for path, score in earlier["best_k_models"].items() if Path(path).is_file()}
        ranked = sorted(candidates, key=lambda path: float(candidates[path]), reverse=self.mode == "max")
        kept: dict[str, torch.Tensor] = {}
        for path in ranked:
            if len(kept) == count:
                break
            source, target = Path(path), Path(self.dirpath) / Path(path).name
            if target.exists() and not os.path.samefile(source, target):
                continue  # a file of that name is here already: never replaced
            if trainer.is_global_zero and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(source, target)
                except OSError:  # another file system, or one without links
                    shutil.copy2(source, target)
            kept[str(target)] = candidates[path]
        if not kept:  # Lightning kept the earlier best's path: this run's best is chosen among its own epochs
            self.best_model_path, self.best_model_score = "", None
            if count > 0:
                log.warning(
                    "the best checkpoints of the resumed run (%s) are gone: the best is chosen among this run's epochs",
                    earlier.get("dirpath"),
                )
            return
        best, worst = (max, min) if self.mode == "max" else (min, max)
        self.best_k_models = kept
        self.best_model_path = best(kept, key=lambda path: float(kept[path]))
        self.best_model_score = kept[self.best_model_path]
        self.kth_best_model_path = worst(kept, key=lambda path: float(kept[path]))
        self.kth_value = kept[self.kth_best_model_path]
        log.info(
            "resumed from %s: its best checkpoint (%s %.4f) is in %s too, the best until an epoch beats it",
            earlier.get("dirpath"),
            self.monitor,
            float(self.best_model_score),
            self.best_model_path,
        )

    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        """Lightning's top-k save, skipped when ``monitor`` is not among this save's metrics or inside the
        warm-up; then ``last.ckpt``."""
        selecting = self.monitor is not None and self.save_top_k != 0
        if selecting and in_warmup(trainer):
            log.info(
                "epoch %d, step %d: inside hard attention's warm-up, so no candidate for the best checkpoint "
                "(model.select_in_warmup=true makes it one)",
                trainer.current_epoch,
                trainer.global_step,
            )
        elif selecting and self.monitor not in monitor_candidates:
            log.warning(
                "epoch %d, step %d: no %s, so no candidate for the best checkpoint",
                trainer.current_epoch,
                trainer.global_step,
                self.monitor,
            )
        else:
            super()._save_topk_checkpoint(trainer, monitor_candidates)
        self._save_last_checkpoint(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        """Lightning's, once a training step (Lightning calls it again after a new best)."""
        if getattr(self, "_last_written_step", None) != trainer.global_step:
            self._last_written_step = trainer.global_step
            super()._save_last_checkpoint(trainer, monitor_candidates)


class WarmupEarlyStopping(EarlyStopping):
    """Lightning's ``EarlyStopping``, for which a validation inside hard attention's warm-up (unless
    ``model.select_in_warmup``) does not count: its patience and best score start when the warm-up ends."""

    def _run_early_stopping_check(self, trainer: L.Trainer) -> None:
        """Lightning's check, outside the warm-up."""
        if not in_warmup(trainer):
            super()._run_early_stopping_check(trainer)


def _last_checkpoint(trainer: L.Trainer) -> str | None:
    """The checkpoint file the run wrote last, if any."""
    saved = [
        path
        for c in trainer.checkpoint_callbacks
        for path in (c.last_model_path, c.best_model_path)
        if path and os.path.isfile(path)
    ]
    return max(saved, key=os.path.getmtime) if saved else None
