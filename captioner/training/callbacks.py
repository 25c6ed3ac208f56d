"""Training callbacks of the captioner: the non-finite-loss guard.

A NaN/inf loss is handled without reading it back every step (a host synchronisation that stalls a GPU):
the optimiser skips its step on the device, and the host looks at the losses every ``check_interval``
steps, before every checkpoint and at the end of each epoch. ``CaptionerModule.configure_callbacks`` adds
the guard to every run, with the module's ``nonfinite`` settings.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning as L
import torch

from captioner.config import NonFinite
from captioner.errors import CaptionerError

log = logging.getLogger(__name__)


class NonFiniteLossError(CaptionerError):
    """The training loss became NaN or infinite (``model.nonfinite=stop``)."""

    def __init__(self, value: float, where: str, checkpoint: str | None) -> None:
        """``value`` the loss at training step ``where``; ``checkpoint`` the last one written (None: none yet)."""
        kept = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint had been saved yet"
        super().__init__(
            f"non-finite loss ({value}) at {where}; training stopped, {kept} "
            "(model.nonfinite=skip skips such batches instead)"
        )


class NonFiniteLossGuard(L.Callback):
    """Skip the optimiser step of a NaN/inf loss on the device; report it (``skip``) or stop (``stop``).

    Every rank takes the same decision (the flags are summed over ranks), so a NaN on one rank never
    leaves the others updating with the NaN gradients it shares with them.
    """

    def __init__(self, action: NonFinite = NonFinite.stop, check_interval: int = 50) -> None:
        """``action``: what a non-finite loss does once the host sees it; ``check_interval``: training steps
        between host reads of the losses."""
        self.action = NonFinite(action)
        self.check_interval = check_interval
        self.unchecked: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (epoch, step, loss, non-finite)
        self.step_nonfinite: torch.Tensor | None = None  # whether the coming optimiser step must be skipped

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        """Flag the coming optimiser step on the device when ``loss`` is not finite; keep it for the host check."""
        nonfinite = (~torch.isfinite(loss.detach())).float()
        nonfinite = trainer.strategy.reduce(nonfinite, reduce_op="sum") > 0  # () bool, on the device
        self.unchecked.append((trainer.current_epoch, trainer.global_step, loss.detach(), nonfinite))
        pending = self.step_nonfinite
        self.step_nonfinite = nonfinite if pending is None else pending | nonfinite  # accumulated batches

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Skip the whole optimiser step of a non-finite loss, on the device; see ``skip_flagged_step``."""
        nonfinite, self.step_nonfinite = self.step_nonfinite, None
        skip_flagged_step(optimizer, nonfinite)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Look at the recorded losses every ``check_interval`` training steps."""
        if len(self.unchecked) >= self.check_interval:
            self.check(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Look at the last losses of the epoch."""
        self.check(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """Look at the losses before a checkpoint is written: with ``stop`` a non-finite one stops before it."""
        self.check(trainer)

    def check(self, trainer: L.Trainer) -> None:
        """Read the losses recorded since the last check back to the host (one synchronisation) and report
        the non-finite ones: with ``skip`` one warning each, with ``stop`` NonFiniteLossError for the first.

        Their optimiser steps were skipped on the device, so the weights, and every checkpoint (this check
        runs before each one is written), hold no update from a non-finite loss; stopping raises within
        ``check_interval`` steps, and the last checkpoint written is from before the bad step. The step
        counter and the schedule still advanced.
        """
        if not self.unchecked:
            return
        unchecked, self.unchecked = self.unchecked, []
        flags = torch.stack([nonfinite for *_, nonfinite in unchecked]).float()
        losses = torch.stack([loss.float() for _, _, loss, _ in unchecked])
        for (epoch, step, _, _), bad, value in zip(unchecked, *torch.stack([flags, losses]).tolist()):
            if not bad:
                continue
            where = f"epoch {epoch}, step {step}"
            if self.action == NonFinite.skip:
                log.warning("non-finite loss (%s) at %s: batch skipped, no parameter update", value, where)
            else:
                raise NonFiniteLossError(value, where, _last_checkpoint(trainer))


def skip_flagged_step(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor | None) -> None:
    """Make the coming ``optimizer.step()`` change nothing when ``nonfinite`` (a () bool tensor) is set.

    A skipped step changes nothing: not the parameters, not Adam's moments, not its step count (the
    learning-rate schedule still advances, as Lightning steps it). Zeroing the loss would not do: Adam
    would still move every parameter by its momentum and decay its moments, and NaN gradients can come out
    of a zeroed NaN graph. A fused optimiser (``training.optimization.build_optimizer``'s) takes the flag as
    ``found_inf`` (the mechanism of ``torch.amp.GradScaler``, which sets its own in place of this one under
    16-mixed: the gradients of a non-finite loss are non-finite, so it skips the step too); an optimiser
    without it (one loaded from an older checkpoint, or on a device without fused kernels) drops the
    gradients instead, which needs a host read of the flag every step.
    """
    if all(group.get("fused") for group in optimizer.param_groups):
        if nonfinite is None:
            optimizer.__dict__.pop("found_inf", None)
        else:
            optimizer.found_inf = nonfinite.float()  # 1.0: skip (GradScaler's convention)
    elif nonfinite is not None and bool(nonfinite):
        optimizer.zero_grad(set_to_none=True)  # parameters without gradients are not updated


def _last_checkpoint(trainer: L.Trainer) -> str | None:
    """The checkpoint file the run wrote last, if any."""
    saved = [
        path
        for c in trainer.checkpoint_callbacks
        for path in (c.last_model_path, c.best_model_path)
        if path and os.path.isfile(path)
    ]
    return max(saved, key=os.path.getmtime) if saved else None
