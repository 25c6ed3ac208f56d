"""Reliability of whole runs (train.py): crash and resume, run folders, bad checkpoints, bad data, bad configs,
determinism; non-finite losses are test_nonfinite_loss.py. The parts they rest on are tested with their modules
(test_fileio, test_checkpoint_io, test_features, test_start, test_validate, ...)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from captioner.fileio import save_torch
from conftest import (
    ROOT,
    TINY,
    copy_dataset,
    error_line,
    logged,
    run_train,
    snapshot,
    subprocess_env,
    tiny_overrides,
)

STEPS_PER_EPOCH = TINY.n_train // 16  # tiny_overrides: data.batch_size=16


# ----------------------------------------------------------------------------------------------- helpers
def first_logged_lr(run: Path) -> tuple[int, float]:
    """The first ``(step, learning rate of the decoder's group)`` a run's LearningRateMonitor logged."""
    return next(iter(logged(run, "train/lr/decoder").items()))  # beside train/lr/encoder


# ---------------------------------------------------------------------------------- 1. crash and resume
@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_continues_from_the_last_checkpoint(tiny_shapes: Path, tmp_path: Path) -> None:
    common = [
        *tiny_overrides(tiny_shapes, tmp_path),
        "trainer.max_epochs=2",
        "test=false",
        "callbacks.early_stopping=null",
        "callbacks.last_checkpoint.every_n_train_steps=2",
        "trainer.log_every_n_steps=1",
    ]
    first, second = tmp_path / "first", tmp_path / "second"
    last = first / "checkpoints" / "last.ckpt"
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *common, f"hydra.run.dir={first}"],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while not last.exists():  # decoding images (no feature cache) keeps each step well over 20 ms
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed = torch.load(last, weights_only=True)
    step = killed["global_step"]
    assert killed["epoch"] == 0 and 0 < step < STEPS_PER_EPOCH  # saved mid-epoch, by the every-N-steps callback
    before = snapshot(first)

    resumed = run_train([*common, f"ckpt_path={first}", f"hydra.run.dir={second}"])
    assert f"Restored all states from the checkpoint at {last}" in resumed.stdout
    assert snapshot(first) == before  # the killed run's folder is never modified
    final = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)
    total = 2 * STEPS_PER_EPOCH
    assert final["epoch"] == 1 and final["global_step"] == total  # finished, and no step was redone or skipped
    assert float(final["optimizer_states"][0]["state"][0]["step"]) == total  # Adam's moments carried over
    assert float(killed["optimizer_states"][0]["state"][0]["step"]) == step
    assert final["lr_schedulers"][0]["last_epoch"] == total  # the schedule carried over
    assert first_logged_lr(second) == (step, pytest.approx(killed["optimizer_states"][0]["param_groups"][0]["lr"]))
    assert sorted(logged(second, "train/loss")) == list(range(step, total))  # only the steps after the checkpoint ran


def test_runs_asking_for_an_existing_folder_at_once_each_get_a_new_one(tmp_path: Path) -> None:
    earlier = tmp_path / "run"
    earlier.mkdir()
    (earlier / "metrics.json").write_text("{}")
    train = [sys.executable, str(ROOT / "train.py")]
    invalid = "+trainer.max_time=soon"  # each run stops at once, after Hydra made its folder (Lightning refuses it)
    commands = [
        [*train, invalid, f"hydra.run.dir={earlier}"],
        [*train, invalid, f"hydra.run.dir={earlier}"],
        [*train, "-m", invalid, f"hydra.sweep.dir={earlier}"],
    ]
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2 and stderr.startswith("error: trainer: `Timer(duration='soon')`")
    assert snapshot(earlier) == {"metrics.json": hashlib.sha256(b"{}").hexdigest()}
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert folders == ["run", "run_1", "run_2", "run_3"]
    layouts = sorted(sorted(p.name for p in (tmp_path / name).iterdir()) for name in folders[1:])
    # each failed run says so in its folder (FAILED); the sweep's job folder 0 holds its own
    run = [".hydra", "FAILED", "config.yaml", "train.log"]
    assert layouts == [run, run, ["0", "multirun.yaml"]]


# ---------------------------------------------------------------------------------------------- 2. loading
@pytest.mark.parametrize(
    "damage,message",
    [
        ("truncated", "is truncated or corrupt"),
        ("code", "was refused: it contains pickled Python objects (posix.system)"),
    ],
)
def test_a_bad_checkpoint_is_one_line_through_train_py(damage: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / f"{damage}.ckpt"
    if damage == "truncated":
        save_torch({"state_dict": {"w": torch.randn(50_000)}, "epoch": 3}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        save_torch({"state_dict": {}, "hook": os.system}, path)
    proc = run_train([f"ckpt_path={path}", f"paths.log_dir={tmp_path}"], check=False, timeout=300)
    assert message in error_line(proc) and str(path) in error_line(proc)


# --------------------------------------------------------------------------------------------- 3. bad data
@pytest.mark.slow
@pytest.mark.parametrize("cache", [False, True], ids=["images", "feature-cache"])
def test_unreadable_images_are_skipped_and_reported(cache: bool, tiny_shapes: Path, tmp_path: Path) -> None:
    root = copy_dataset(tiny_shapes, tmp_path / "shapes")
    train_images = root / "images" / "train"
    (train_images / "000002.png").unlink()
    (train_images / "000005.png").write_bytes(b"")
    corrupt = train_images / "000007.png"
    corrupt.write_bytes(corrupt.read_bytes()[:200])
    (root / "images" / "val" / "000250.png").write_bytes(b"not an image")
    base = tiny_overrides(root, tmp_path, cache=tmp_path / "cache" if cache else None)
    proc = run_train([*base, "trainer.max_epochs=1", "test=false"])
    reports = [line for line in proc.stdout.splitlines() if "unreadable image" in line]
    assert len(reports) == 1 and "skipped 4 unreadable images: " in reports[0], proc.stdout[-3000:]
    for name in (
        f"{train_images / '000002.png'} (file not found)",
        f"{train_images / '000005.png'} (file is empty)",
        f"{corrupt} (truncated or corrupt image data",
        f"{root / 'images' / 'val' / '000250.png'} (not an image file",
    ):
        assert name in reports[0]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["final/val/bleu1"] > 0.0


@pytest.mark.parametrize(
    "damage,problem",
    [
        (lambda text: text[: len(text) // 2], "is not valid JSON"),
        (lambda text: text.replace('"caption":', '"text":', 1), "annotation 0 has no 'caption'"),
        (
            lambda text: json.dumps(
                {
                    **json.loads(text),
                    "annotations": [
                        {**a, "caption": 7} if i == 3 else a for i, a in enumerate(json.loads(text)["annotations"])
                    ],
                }
            ),
            "annotation 3 has 'caption' of type int, expected str",
        ),
    ],
    ids=["not-json", "missing-key", "caption-not-a-string"],
)
def test_a_malformed_annotation_file_is_one_line_naming_it(
    damage, problem: str, tiny_shapes: Path, tmp_path: Path
) -> None:
    root = copy_dataset(tiny_shapes, tmp_path / "shapes", images=False)
    annotations = root / "annotations" / "captions_train.json"
    annotations.write_text(damage(annotations.read_text()))
    proc = run_train(tiny_overrides(root, tmp_path), check=False, timeout=300)
    line = error_line(proc)
    assert str(annotations) in line and problem in line


# -------------------------------------------------------------------------------- 4. bad configs and args


def test_a_missing_dataset_stops_train_py_before_any_work(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = run_train(
        ["experiment=flickr30k_soft", "model.encoder.weights=null", "trainer=cpu", f"paths.data_dir={data}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        check=False,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: data.source.split_file='{data}/karpathy/dataset_flickr30k.json': file not found; see the guide "
        "for where this split file comes from (docs/datasets.md#split-files)",
        f"error: data.source.image_root='{data}/flickr30k/images': folder not found; unzip the dataset's images "
        "there (docs/datasets.md#images)",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run folder, nothing created under data


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.foo=1", "error: model.foo is not a known key; valid keys: attention, scorer"),
        ("model=medium", "error: model=medium is not an option; choose one of: hard, soft"),
        ("trainer.max_epochs", "error: the override 'trainer.max_epochs' has no value: write trainer.max_epochs="),
        ("model.decoder.dropout=1.5", "error: model.decoder.dropout=1.5 must be in [0.0, 0.99]"),
    ],
)
def test_hydra_errors_are_one_line_without_a_traceback(override: str, message: str, tmp_path: Path) -> None:
    proc = run_train([override, f"hydra.run.dir={tmp_path / 'run'}"], check=False, timeout=120)
    assert error_line(proc).startswith(message)


# ------------------------------------------------------------------------------------------ 5. determinism
@pytest.mark.slow
def test_two_runs_with_one_seed_give_identical_losses_and_captions(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = [
        *tiny_overrides(tiny_shapes, tmp_path),
        "trainer.max_epochs=1",
        "test=false",
        "+trainer.limit_train_batches=6",
        "trainer.log_every_n_steps=1",
        "data.augment=true",
        "data.num_workers=1",
    ]
    runs = []
    for n in range(2):
        monkeypatch.setenv("PYTHONHASHSEED", str(n))  # nothing may depend on the order of a set or dict of str
        runs.append(tmp_path / f"run{n}")
        run_train([*args, f"hydra.run.dir={runs[-1]}"])
    losses = [logged(run, "train/loss") for run in runs]
    assert sorted(losses[0]) == list(range(6)) and losses[0] == losses[1]
    captions = [json.loads((run / "val_captions.json").read_text()) for run in runs]
    assert len(captions[0]) == TINY.n_val and captions[0] == captions[1]
    weights = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for run in runs]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
