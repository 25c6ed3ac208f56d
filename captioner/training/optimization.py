"""The optimiser, and what every precision needs of its step: true gradients to clip, and a skip on non-finite ones.

Adam is fused where torch has fused kernels for the parameters' device and dtype (one kernel per step, and it
can skip a step on the device: ``found_inf``). That is decided from torch's list of fused-capable devices
(``Adam(fused=True)`` builds on any device and fails only at its first step), and where the list says yes, by a
one-element trial step that must skip when given ``found_inf``: on a device whose fused kernel refuses or
ignores it (Apple's MPS on some torch versions) Adam is plain, with a warning. A checkpoint's optimiser
state never changes that choice (``keep_implementation``): one saved before Adam was fused resumes fused, one
saved on a fused device resumes plain where there are no kernels.

Under 16-mixed Lightning's plugin steps through its ``GradScaler``: it unscales the gradients of a plain Adam
before ``on_before_optimizer_step`` and leaves a fused one's to the fused step, which cannot be clipped. So
``unscale_for_step``, called by the non-finite guard in its ``on_before_optimizer_step``, unscales a fused
Adam's gradients when the plugin will step, and adds the guard's non-finite-loss flag to the scaler's
``found_inf``: the scaler then skips the step of a non-finite loss even when its gradients are finite. The
guard is the module's callback, which Lightning places after the config's callbacks (``conf/callbacks``): their
``on_before_optimizer_step`` runs before it and sees a fused Adam's gradients still scaled; the module's own
hook and ``clip_gradients`` run after it. ``clip_gradients`` then clips true gradients under every precision; a
step whose ``training_step`` returned None is never unscaled (the plugin skips its ``step`` and ``update``, so an
unscale would be left pending).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.utils import _foreach_utils

from captioner.config import OptimizerConfig

log = logging.getLogger(__name__)

# The param-group entries that say how Adam runs on this device, not what it optimises: never a checkpoint's.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")
# A param group's name, which LearningRateMonitor logs its rate under (train/lr/<name>): this run's, never a
# checkpoint's (one written before the groups had names has none).
NAME = "name"


def fused_kernels(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch has fused Adam kernels for every one of ``params`` (its device type and a floating dtype)."""
    devices = _foreach_utils._get_fused_kernels_supported_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


@functools.cache
def fused_takes_found_inf(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a fused Adam step on ``device`` for ``dtype`` skips when ``found_inf`` is set: a trial step of a
    one-element parameter, which must stay unchanged (once per device and dtype)."""
    param = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
    param.grad = torch.ones_like(param)
    trial = torch.optim.Adam([param], fused=True)
    trial.found_inf = torch.ones((), device=device)  # 1.0: skip (GradScaler's convention)
    try:
        trial.step()
    except (RuntimeError, AssertionError, NotImplementedError):
        return False
    return not bool(param.detach().any())


def build_optimizer(
    rest: Iterable[torch.nn.Parameter], encoder: list[torch.nn.Parameter], settings: OptimizerConfig
) -> torch.optim.Adam:
    """Adam over the decoder's (and self-attention's) parameters ``rest`` at ``settings.lr`` and the encoder's
    trained ones at ``settings.encoder_lr``; fused where the parameters' device has the kernels and its fused step
    can be skipped on the device (``fused_takes_found_inf``), else plain (with a warning when only the latter fails)."""
    groups = [{"params": list(rest), "lr": settings.lr, NAME: "decoder"}]
    if encoder:
        groups.append({"params": encoder, "lr": settings.encoder_lr, NAME: "encoder"})
    params = [p for group in groups for p in group["params"]]
    fused = fused_kernels(params)
    refused = sorted({str(p.device) for p in params if fused and not fused_takes_found_inf(p.device, p.dtype)})
    if refused:
        fused = False
        log.warning(
            "fused Adam cannot skip a step on %s (found_inf) with torch %s: plain Adam instead, which reads each "
            "step's non-finite flag on the host",
            ", ".join(refused),
            torch.__version__,
        )
    optimizer = torch.optim.Adam(groups, weight_decay=settings.weight_decay, fused=fused or None)
    optimizer.register_load_state_dict_pre_hook(keep_implementation)
    return optimizer


def keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict`` (an optimiser state being loaded) with ``optimizer``'s own ``IMPLEMENTATION_KEYS`` (and
    names) in its param groups, so that loading it never turns a fused Adam plain or a plain one fused.

    A load-state-dict pre-hook: torch then moves each ``step`` count where the kept choice needs it (on the
    parameters' device in float32 for a fused Adam). The caller's dict is not changed. A state with another
    number of param groups is returned as it is, for torch to refuse.
    """
    if len(state_dict["param_groups"]) != len(optimizer.param_groups):
        return state_dict
    groups = []
    for saved, current in zip(state_dict["param_groups"], optimizer.param_groups):
        group = {**saved, **{key: current.get(key) for key in IMPLEMENTATION_KEYS}}
        if NAME in current:
            group[NAME] = current[NAME]
        groups.append(group)
    return {**state_dict, "param_groups": groups}


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every param group of ``optimizer`` runs fused (and so takes ``found_inf``)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def unscale_for_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """Before a 16-mixed step that the plugin will take: unscale ``optimizer``'s gradients if the plugin did
    not (a fused Adam: it leaves them to the step), and make the scaler skip the step when ``nonfinite`` (the
    loss's flag, a () bool tensor) is set, as it does for non-finite gradients.

    The scaler keeps each device's non-finite-gradient flag after unscaling; the step (fused or plain) and
    ``update`` read them. There is no public setter: the flags are ``GradScaler``'s ``found_inf_per_device``.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):  # Lightning's rule for who unscales
        scaler.unscale_(optimizer)
    for found_inf in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        found_inf.copy_(torch.maximum(found_inf, nonfinite.to(found_inf)))


def clip_gradients(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    clip_val: float | None,
    algorithm: str | None,
) -> None:
    """Clip ``optimizer``'s gradients to ``clip_val`` (by their total norm, or by value) under any precision.

    Called from ``LightningModule.configure_gradient_clipping``, after ``on_before_optimizer_step`` (where
    ``unscale_for_step`` made 16-mixed gradients true ones). Mixed precision: clipped here, as Lightning's
    plugin refuses to clip the gradients of a fused optimiser; every other precision through Lightning.
    """
    if not clip_val or not isinstance(module.trainer.precision_plugin, MixedPrecision):
        module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if GradClipAlgorithmType(algorithm or GradClipAlgorithmType.NORM) == GradClipAlgorithmType.VALUE:
        torch.nn.utils.clip_grad_value_(params, clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip_val)


def nonfinite_gradients(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """Whether any gradient of ``optimizer`` holds a NaN or inf: a () bool tensor on their device, computed
    there without a host read (GradScaler's check, with a scale of 1: the gradients are unchanged); None
    when no parameter has a gradient."""
    grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    if not grads:
        return None
    device = next(iter(grads))[0]
    found = torch.zeros((), device=device)
    for (where, _), tensors in grads.items():
        found_here = torch.zeros((), device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_here, torch.ones((), device=where))
        found = torch.maximum(found, found_here.to(device))
    return found > 0
