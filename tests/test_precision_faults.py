"""The fault matrix of the training step: every precision the CPU can run x {an empty batch at step 0 and at step 2,
a NaN loss with finite gradients, an inf gradient with a finite loss, a resume from a checkpoint saved before Adam was
fused}, with the fused Adam of every run and with the plain one of a device without fused kernels: a skipped step
changes no weight, training goes on, every later loss is finite. The tiny captioner and its batches are those of
test_precision.py, where the same steps clip and learn."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils import _foreach_utils
from torch.utils.data import DataLoader

from captioner.config import OptimizerConfig
from captioner.training import optimization
from captioner.training.callbacks import NonFiniteLossError
from captioner.training.module import CaptionerModule
from test_precision import CLIP, one_batch, steps_trainer, tiny_module

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
FAULTS = ("empty batch at step 0", "empty batch at step 2", "nan loss", "inf gradient", "old-format resume")
FAULT_STEP = 2  # the step of every fault but the first
MATRIX_STEPS = 5
RESUMED_AT = 3  # the old-format checkpoint's step


def precision_options(precision: str) -> dict:
    """The trainer arguments of ``precision``; 16-mixed as the fp16 autocast and GradScaler of a GPU run."""
    if precision == "16-mixed":
        return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))]}
    return {"precision": precision}


class InfGradient(torch.autograd.Function):
    """Adds nothing to the loss and an inf gradient to its input."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.shape = tensor.shape
        return tensor.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_full(ctx.shape, math.inf)


class FaultyModule(CaptionerModule):
    """The tiny captioner with a fault at training step ``fault_step``: a NaN loss with finite gradients, or an
    inf gradient with a finite loss; checkpoints without the bundle metadata (no data module here)."""

    fault: str | None = None

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        if self.global_step != FAULT_STEP or loss is None:
            return loss
        if self.fault == "nan loss":
            return loss + math.nan  # the gradients stay those of the finite loss
        if self.fault == "inf gradient":
            return loss + InfGradient.apply(next(self.model.decoder.parameters()))
        return loss

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        pass


class WeightChanges(L.Callback):
    """Whether each training step changed a weight, and its loss (None: the step returned none)."""

    def __init__(self) -> None:
        self.changed: list[bool] = []
        self.losses: list[float | None] = []
        self.before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.changed.append(any(not torch.equal(b, p) for b, p in zip(self.before, pl_module.parameters())))
        self.losses.append(float(outputs["loss"]) if outputs else None)


def fit_faulty(
    precision: str, fault: str, steps: int, ckpt_path: Path | None = None
) -> tuple[L.Trainer, WeightChanges]:
    """Train the tiny captioner for ``steps`` steps (in all, a resumed run's included) with ``fault``."""
    module = tiny_module(FaultyModule)
    module.fault = fault
    channels = module.model.encoder.out_channels
    empty = {"empty batch at step 0": 0, "empty batch at step 2": FAULT_STEP}.get(fault)
    batches = [one_batch(channels, empty=step == empty) for step in range(steps)]
    recorder = WeightChanges()
    trainer = steps_trainer(steps, recorder, gradient_clip_val=CLIP, **precision_options(precision))
    loader = DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch)
    trainer.fit(module, loader, ckpt_path=ckpt_path, weights_only=True)
    return trainer, recorder


def old_format_checkpoint(precision: str, path: Path) -> Path:
    """A checkpoint of ``RESUMED_AT`` steps whose optimiser state is as Adam saved it before it was fused."""
    trainer, _ = fit_faulty(precision, "old-format resume", RESUMED_AT)
    trainer.save_checkpoint(path, weights_only=False)
    checkpoint = torch.load(path, weights_only=True)
    for state in checkpoint["optimizer_states"]:
        for group in state["param_groups"]:
            group["fused"] = group["foreach"] = None
    torch.save(checkpoint, path)
    return path


@pytest.fixture(params=["fused", "plain"])
def adam(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Adam as built on the CPU (fused), or as on a device that torch says has no fused kernels (plain)."""
    if request.param == "plain":
        cpu_less = [device for device in _foreach_utils._get_fused_kernels_supported_devices() if device != "cpu"]
        monkeypatch.setattr(_foreach_utils, "_get_fused_kernels_supported_devices", lambda: cpu_less)
        monkeypatch.setattr(
            sys.modules["torch.optim.optimizer"], "_get_fused_kernels_supported_devices", lambda: cpu_less
        )
    return request.param


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_skipped_step_changes_nothing_and_training_goes_on(
    precision: str, fault: str, adam: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    resumed = tmp_path / "old.ckpt" if fault == "old-format resume" else None
    if resumed is not None:
        old_format_checkpoint(precision, resumed)
    trainer, recorder = fit_faulty(precision, fault, MATRIX_STEPS, resumed)
    skipped = {"empty batch at step 0": 0}.get(fault, FAULT_STEP) if resumed is None else None
    first = RESUMED_AT if resumed is not None else 0
    assert len(recorder.changed) == MATRIX_STEPS - first
    for step, (changed, loss) in enumerate(zip(recorder.changed, recorder.losses), first):
        if step == skipped:
            assert not changed, f"step {step} ({fault}) changed the weights"
        else:
            assert changed and loss is not None and math.isfinite(loss), (step, recorder.changed, recorder.losses)
    optimizer = trainer.optimizers[0]
    assert all(bool(group["fused"]) == (adam == "fused") for group in optimizer.param_groups)
    reported = [r.getMessage() for r in caplog.records if r.getMessage().startswith("non-finite")]
    if fault == "nan loss":
        assert reported == [f"non-finite loss (nan) at epoch 0, step {FAULT_STEP}: batch skipped, no parameter update"]
    elif fault == "inf gradient" and precision != "16-mixed":  # under 16-mixed the scaler's routine skip
        assert len(reported) == 1 and reported[0].startswith("non-finite gradients (loss "), reported
        assert reported[0].endswith(f") at epoch 0, step {FAULT_STEP}: batch skipped, no parameter update")
    else:
        assert reported == []
    updates = MATRIX_STEPS - (skipped is not None)
    assert {float(state["step"]) for state in optimizer.state.values()} == {float(updates)}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_a_resume_from_an_old_checkpoint_is_fused_again(precision: str, tmp_path: Path) -> None:
    path = old_format_checkpoint(precision, tmp_path / "old.ckpt")
    trainer, _ = fit_faulty(precision, "old-format resume", RESUMED_AT + 1, path)
    assert all(group["fused"] for group in trainer.optimizers[0].param_groups)
    assert all(state["step"].dtype == torch.float32 for state in trainer.optimizers[0].state.values())


def test_adam_is_plain_where_torch_has_no_fused_kernels_for_the_device(adam: str) -> None:
    params = [torch.nn.Parameter(torch.randn(3))]
    optimizer = optimization.build_optimizer(params, [], OptimizerConfig())
    params[0].sum().backward()
    optimizer.step()  # a fused Adam on a device without the kernels raises here, not when it is built
    assert all(bool(group["fused"]) == (adam == "fused") for group in optimizer.param_groups)
    assert not torch.equal(params[0].detach(), params[0].detach() * 0)


def test_the_stop_error_of_nonfinite_gradients_names_their_finite_loss() -> None:
    error = NonFiniteLossError(2.5, "epoch 0, step 3", None, gradients=True)
    assert str(error) == (
        "non-finite gradients (loss 2.5) at epoch 0, step 3; training stopped, no checkpoint had been saved yet "
        "(model.nonfinite=skip skips such batches instead)"
    )
