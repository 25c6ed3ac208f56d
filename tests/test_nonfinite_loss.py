"""Non-finite losses in whole runs (train.py) and in its training loop: a NaN loss stops a run with one line and
keeps the last good checkpoint; ``model.nonfinite=skip`` skips the optimiser step instead; the loss is read back
every ``model.nonfinite_check_interval`` steps, never inside a training step. The faults are injected by replacing
``CaptionLoss.forward`` (``nan_loss_at``), in this process or in a train.py subprocess (``NAN_AT_STEP``). The same
faults under every precision: test_precision_faults.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from captioner.fileio import save_torch
from captioner.model.losses import CaptionLoss
from conftest import ROOT, compose_cfg, error_line, subprocess_env, tiny_overrides


def nan_loss_at(step: int):
    """A ``CaptionLoss.forward`` whose training loss is NaN at optimiser step ``step`` (fault injection)."""
    forward = CaptionLoss.forward
    calls = [0]

    def poisoned(self: CaptionLoss, *args, **kwargs) -> dict:
        terms = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():  # training; validation runs under inference mode
            calls[0] += 1
            if calls[0] == step + 1:
                terms["loss"] = terms["loss"] * float("nan")
        return terms

    return poisoned


# ``python nan_at_step.py STEP train.py OVERRIDES...``: train.py, the way users run it, with nan_loss_at(STEP).
NAN_AT_STEP = f"""import runpy, sys
sys.path[:0] = [{str(ROOT)!r}, {str(Path(__file__).parent)!r}]  # this checkout's captioner, then the tests
from test_nonfinite_loss import CaptionLoss, nan_loss_at
CaptionLoss.forward = nan_loss_at(int(sys.argv.pop(1)))
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_nan_loss_stops_with_one_line_and_keeps_the_last_good_checkpoint(tiny_shapes: Path, tmp_path: Path) -> None:
    script = tmp_path / "nan_at_step.py"
    script.write_text(NAN_AT_STEP)
    run = tmp_path / "run"
    args = [
        *tiny_overrides(tiny_shapes, tmp_path, cache=tmp_path / "cache"),
        "trainer.max_epochs=1",
        "callbacks.last_checkpoint.every_n_train_steps=3",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), "5", str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = run / "checkpoints" / "last.ckpt"
    assert error_line(proc) == (
        f"error: non-finite loss (nan) at epoch 0, step 5; training stopped, the last good "
        f"checkpoint is {last} (model.nonfinite=skip skips such batches instead)"
    )
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())
    assert not (run / "bundle.pt").exists()


def test_nonfinite_skip_skips_the_optimiser_step(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import train
    from captioner.training import checkpoint_io

    saved: list[str] = []
    monkeypatch.setattr(checkpoint_io, "save_torch", lambda obj, path: (saved.append(str(path)), save_torch(obj, path)))
    monkeypatch.setattr(CaptionLoss, "forward", nan_loss_at(4))
    cfg = compose_cfg(
        [
            *tiny_overrides(tiny_shapes, tmp_path, cache=tmp_path / "cache"),
            "model.nonfinite=skip",
            "trainer.max_epochs=1",
            "test=false",
            "+trainer.limit_train_batches=8",
        ],
        tmp_path,
    )
    train.train(cfg)
    assert "non-finite loss (nan) at epoch 0, step 4: batch skipped, no parameter update" in caplog.text
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 8
    adam = checkpoint["optimizer_states"][0]["state"]
    assert {float(state["step"]) for state in adam.values()} == {7.0}  # one of the 8 steps updated nothing
    assert str(last) in saved  # Lightning wrote its checkpoints through AtomicCheckpointIO


def test_the_loss_is_read_back_every_n_steps_not_every_step(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import train
    from captioner.training.callbacks import NonFiniteLossGuard
    from captioner.training.module import CaptionerModule

    in_step, host_reads, checked = [False], [], []
    for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, original=original, name=name):
            if in_step[0]:
                host_reads.append(name)
            return original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    training_step, check = CaptionerModule.training_step, NonFiniteLossGuard.check

    def watched_step(self, *args):
        in_step[0] = True
        try:
            return training_step(self, *args)
        finally:
            in_step[0] = False

    def counted_check(self, trainer):
        if self.unchecked:
            checked.append(len(self.unchecked))
        check(self, trainer)

    monkeypatch.setattr(CaptionerModule, "training_step", watched_step)
    monkeypatch.setattr(NonFiniteLossGuard, "check", counted_check)
    monkeypatch.setattr(CaptionLoss, "forward", nan_loss_at(1))
    cfg = compose_cfg(
        [
            *tiny_overrides(tiny_shapes, tmp_path, cache=tmp_path / "cache"),
            "model.nonfinite=skip",
            "model.nonfinite_check_interval=4",
            "trainer.max_epochs=1",
            "test=false",
            "+trainer.limit_train_batches=6",
        ],
        tmp_path,
    )
    train.train(cfg)
    assert host_reads == []  # no training step read a value back
    assert checked == [4, 2]  # after step 4, then before the end-of-epoch checkpoint
    assert "non-finite loss (nan) at epoch 0, step 1: batch skipped, no parameter update" in caplog.text
    checkpoint = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert {float(state["step"]) for state in checkpoint["optimizer_states"][0]["state"].values()} == {5.0}
