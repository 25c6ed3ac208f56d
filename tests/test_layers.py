"""The layers point one way: the plain-PyTorch layers (``data``, ``model``, the bundle file format) import
neither what builds on them (inference, training, the CLI, viz) nor Lightning or Hydra."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import captioner.data
import captioner.model
from conftest import ROOT, subprocess_env

LOWER = sorted(
    [f"captioner.data.{m.name}" for m in pkgutil.iter_modules(captioner.data.__path__)]
    + [f"captioner.model.{m.name}" for m in pkgutil.iter_modules(captioner.model.__path__)]
    + ["captioner.bundle", "captioner.bundle_v1", "captioner.bundle_versions", "captioner.run_files"]
    + ["captioner.config", "captioner.errors", "captioner.fileio"]
)
UPPER = ("captioner.inference", "captioner.training", "captioner.cli", "captioner.viz", "lightning", "hydra")


def _loaded_above(modules: list[str]) -> list[str]:
    """The modules of UPPER (or inside them) that importing ``modules`` in a fresh interpreter loads."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"upper = {UPPER!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if any(m == u or m.startswith(u + '.') for u in upper))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_no_lower_layer_imports_an_upper_one() -> None:
    assert "captioner.model.captioner" in LOWER and "captioner.data.vocab" in LOWER
    assert _loaded_above(LOWER) == []


def test_the_check_sees_an_upper_import() -> None:
    loaded = _loaded_above(["captioner.inference", "captioner.training.checkpoint_io"])
    assert {"captioner.inference", "captioner.training.checkpoint_io", "lightning"} <= set(loaded)
