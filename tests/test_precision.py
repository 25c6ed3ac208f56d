"""Real optimisation steps under every precision the CPU can run, with gradient clipping on: the loss stays
finite and falls, the optimiser sees gradients clipped to the bound, and a non-finite loss still skips its step.
The fault matrix of the same steps (empty batches, NaN loss, inf gradient, old-format resume) is
test_precision_faults.py; its tiny captioner, batches and trainer are this file's ``tiny_module``, ``one_batch``
and ``steps_trainer`` (test_ddp.py's trainer too).

The optimiser is the fused Adam of every run; under mixed precision the module clips the unscaled gradients
itself (``training.optimization.clip_gradients``), as Lightning's plugin refuses to for a fused optimiser.
16-mixed: Lightning turns ``precision="16-mixed"`` on the CPU into bf16-mixed, so the test passes its
plugin (fp16 autocast and a GradScaler on the CPU) explicitly. DDP: two CPU processes, one precision.

    python tests/test_precision.py OUT.json --precision bf16-mixed --devices 2   # what the DDP test runs
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from captioner.config import ModelConfig, from_dict
from captioner.data.vocab import Vocabulary
from captioner.training.module import CaptionerModule
from conftest import run_script

CLIP = 1e-3  # far below the gradients' norm, so every step clips
STEPS = 8
NAN_STEP = 3  # the batch whose features are NaN: its loss is NaN, its step must be skipped
WORDS = [f"w{i}" for i in range(12)]


class GradientNorms(L.Callback):
    """Records the total gradient norm each ``optimizer.step()`` used (clipped) and each loss."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.losses: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(self._record)  # the closure runs inside step()

    def _record(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        grads = [p.grad.float() for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def one_batch(channels: int, nan: bool = False, empty: bool = False) -> dict:
    """Four images' cached features (4, 4, C) (a 2x2 grid), two captions each; none when ``empty`` (all four
    images unreadable)."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(4, 4, channels, generator=generator)
    words = torch.randint(4, 4 + len(WORDS), (8, 5), generator=generator)
    captions = torch.cat([torch.ones(8, 1, dtype=torch.long), words, torch.full((8, 1), 2)], dim=1)  # <start> <end>
    kept = 0 if empty else 4
    return {
        "features": (features * math.nan if nan else features)[:kept],
        "captions": captions[: 2 * kept],  # (8, 7)
        "image_index": torch.arange(kept).repeat_interleave(2),
        "skipped": [],
    }


def tiny_module(kind: type[CaptionerModule] = CaptionerModule, **settings) -> CaptionerModule:
    """The tiny captioner of these tests (resnet18's layer1 pooled to a 2x2 grid, a 16-wide decoder); ``settings``:
    other ``model`` settings, each replacing the one of the same name (tests/test_gpu.py and test_scst_graphs.py use
    it too)."""
    torch.manual_seed(0)
    return kind(
        Vocabulary(WORDS),
        from_dict(
            ModelConfig,
            dict(
                encoder={"name": "resnet18", "weights": None, "stage": "layer1", "grid": 2},
                decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16, "dropout": 0.0},
                objective="cross_entropy",
                optimizer={"lr": 0.01},
                scheduler={"name": "none"},
                nonfinite="skip",
            )
            | settings,
        ),
    )


def steps_trainer(max_steps: int, recorder: L.Callback, **options) -> L.Trainer:
    """A CPU trainer that only trains: ``max_steps`` steps watched by ``recorder``, without validation, logger,
    checkpoints, progress bar or model summary (the trainer of these tests, test_precision_faults.py's and
    test_ddp.py's); ``options``: its other arguments (devices, strategy, clipping, precision)."""
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        limit_val_batches=0,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def train_steps(devices: int = 1, **trainer_options) -> dict:
    """``STEPS`` optimiser steps of a tiny captioner on one batch (NaN at ``NAN_STEP``), clipping at ``CLIP``."""
    module = tiny_module()
    channels = module.model.encoder.out_channels
    batches = [one_batch(channels, nan=step == NAN_STEP) for step in range(STEPS)]
    recorder = GradientNorms()
    trainer = steps_trainer(
        STEPS,
        recorder,
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        gradient_clip_val=CLIP,
        use_distributed_sampler=False,
        **trainer_options,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch))
    optimizer = trainer.optimizers[0]
    return {
        "losses": recorder.losses,
        "norms": recorder.norms,
        "fused": all(group["fused"] for group in optimizer.param_groups),
        "adam_steps": sorted({float(state["step"]) for state in optimizer.state.values()}),
        "rank": trainer.global_rank,
    }


def check(result: dict, tolerance: float) -> None:
    """Finite, falling losses (but the NaN batch's), every step clipped to ``CLIP``, the NaN step skipped."""
    losses = result["losses"]
    assert len(losses) == STEPS and math.isnan(losses[NAN_STEP])
    finite = [loss for step, loss in enumerate(losses) if step != NAN_STEP]
    assert all(math.isfinite(loss) for loss in finite)
    assert max(finite[-2:]) < finite[0] - 0.01, losses  # it learns, through gradients clipped 1000-fold
    clipped = [norm for step, norm in enumerate(result["norms"]) if step != NAN_STEP]
    assert len(clipped) == STEPS - 1 and all(CLIP * 0.9 < norm <= CLIP * (1 + tolerance) for norm in clipped), clipped
    assert result["fused"]  # the device-side skip of the non-finite-loss guard
    assert result["adam_steps"] == [STEPS - 1.0]  # the NaN batch's step updated nothing


@pytest.mark.parametrize(
    ("precision", "tolerance"),
    [("32-true", 1e-4), ("bf16-mixed", 1e-4), ("bf16-true", 1e-2)],  # bf16 gradients: the norm to ~3 digits
)
def test_training_clips_and_learns_at_every_precision(precision: str, tolerance: float) -> None:
    check(train_steps(precision=precision), tolerance)


def test_fp16_mixed_precision_clips_the_unscaled_gradients() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    result = train_steps(plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    check(result, 1e-4)  # norms of the scaled gradients would be ~1000x the bound


@pytest.mark.slow
def test_two_ddp_processes_clip_and_learn_under_bf16_mixed(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run_script(__file__, str(out), "--precision", "bf16-mixed", "--devices", "2")
    check(json.loads(out.read_text()), 1e-4)


def main() -> None:
    """Train as ``train_steps`` does and write rank 0's result to a JSON file."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    result = train_steps(devices=args.devices, precision=args.precision)
    if result["rank"] == 0:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
