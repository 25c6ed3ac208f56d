"""Shared fixtures: a tiny built-in dataset, Hydra configs composed for a temporary folder, subprocess runs."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from captioner.data.shapes import ShapesSpec, generate_shapes

import train  # noqa: F401  registers the config schemas (captioner.config) with Hydra

ROOT = Path(__file__).resolve().parents[1]

# A dataset small enough to train on in seconds; the same parameters everywhere so it is generated once.
TINY = ShapesSpec(n_train=240, n_val=24, n_test=24)


@pytest.fixture(scope="session")
def tiny_shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated built-in dataset (240/24/24 images, 96 px) shared by the whole session."""
    root = tmp_path_factory.mktemp("data") / "shapes"
    generate_shapes(root, TINY)
    return root


def tiny_overrides(data_root: Path, out: Path, cache: Path | None = None) -> list[str]:
    """Hydra overrides that point the default config at the tiny dataset and a temporary run folder."""
    cache_value = "null" if cache is None else str(cache)
    return [
        f"data.source.root={data_root}",
        *(f"data.source.{k}={v}" for k, v in asdict(TINY).items()),
        f"data.feature_cache={cache_value}",
        "data.num_workers=0",
        "data.batch_size=16",
        "data.eval_batch_size=24",
        f"paths.log_dir={out}",
        f"hydra.run.dir={out / 'run'}",
        "logger=csv",
        "trainer.enable_progress_bar=false",
    ]


def run_train(args: list[str], timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` in a subprocess (the way users run it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc
