"""AtomicCheckpointIO: Lightning's checkpoints written atomically and loaded weights-only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from captioner.errors import BundleError
from captioner.training.checkpoint_io import AtomicCheckpointIO


def test_a_checkpoint_write_killed_half_way_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, checkpoint)
    real_save = torch.save

    def killed_half_way(obj: object, handle) -> None:
        real_save(obj, handle)
        handle.truncate(handle.tell() // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, checkpoint)
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(checkpoint)["state_dict"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left
    (tmp_path / "plain.txt").write_text("")
    assert checkpoint.stat().st_mode == (tmp_path / "plain.txt").stat().st_mode  # not private like mkstemp's


def test_a_checkpoint_is_loaded_weights_only_whatever_lightning_asks(tmp_path: Path) -> None:
    checkpoint = tmp_path / "code.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "hook": os.system}, checkpoint)
    for weights_only in (None, False, True):
        with pytest.raises(BundleError, match=f"^checkpoint {checkpoint} was refused: it contains pickled Python"):
            AtomicCheckpointIO().load_checkpoint(checkpoint, weights_only=weights_only)
    torch.save({"state_dict": {"w": torch.ones(1)}, "epoch": 2}, tmp_path / "plain.ckpt")
    loaded = AtomicCheckpointIO().load_checkpoint(tmp_path / "plain.ckpt", map_location="cpu", weights_only=False)
    assert loaded["epoch"] == 2 and torch.equal(loaded["state_dict"]["w"], torch.ones(1))
