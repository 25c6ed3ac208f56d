"""The optimiser, and gradient clipping that works with it under every precision.

Adam is fused where the device has the kernels: one kernel per step, and it can skip a step on the device
(``found_inf``: the non-finite-loss guard, ``callbacks.skip_flagged_step``). Lightning's mixed-precision
plugin refuses to clip the gradients of an optimiser that can unscale them itself (a fused one: it cannot
know whether the gradients it would clip are still scaled). ``clip_gradients`` clips them itself under
mixed precision: the gradients are unscaled first (16-mixed: by the plugin's ``GradScaler``, which then
steps the optimiser without unscaling again; bf16-mixed has no scale), so the bound applies to the true
gradients, and the optimiser stays the fused one with its device-side skip. Every other precision clips
through Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType

from captioner.config import OptimizerConfig


def build_optimizer(
    rest: Iterable[torch.nn.Parameter], encoder: list[torch.nn.Parameter], settings: OptimizerConfig
) -> torch.optim.Adam:
    """Adam over the decoder's (and self-attention's) parameters ``rest`` at ``settings.lr`` and the encoder's
    trained ones at ``settings.encoder_lr``; fused where the parameters' device has the kernels."""
    groups = [{"params": list(rest), "lr": settings.lr}]
    if encoder:
        groups.append({"params": encoder, "lr": settings.encoder_lr})
    try:
        return torch.optim.Adam(groups, weight_decay=settings.weight_decay, fused=True)
    except RuntimeError:  # no fused kernels for these parameters' device
        return torch.optim.Adam(groups, weight_decay=settings.weight_decay)


def clip_gradients(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    clip_val: float | None,
    algorithm: str | None,
) -> None:
    """Clip ``optimizer``'s gradients to ``clip_val`` (by their total norm, or by value) under any precision.

    Called from ``LightningModule.configure_gradient_clipping``, after ``on_before_optimizer_step``.
    """
    plugin = module.trainer.precision_plugin
    if not clip_val or not isinstance(plugin, MixedPrecision):
        module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
        return
    if plugin.scaler is not None:
        plugin.scaler.unscale_(optimizer)  # its step() then leaves them unscaled (and skips on inf/NaN)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if GradClipAlgorithmType(algorithm or GradClipAlgorithmType.NORM) == GradClipAlgorithmType.VALUE:
        torch.nn.utils.clip_grad_value_(params, clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip_val)
