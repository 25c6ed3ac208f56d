"""``train.py`` run in a process of its own, as a user runs it: for the benchmarks that measure a whole run."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_train(overrides: Sequence[str], line: re.Pattern[str]) -> re.Match[str]:
    """Run ``python train.py *overrides`` from the repository's root and return the match of ``line`` in what it
    printed; exit (status 1) with its status and the tail of its output when it fails or prints no such line."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, capture_output=True, text=True
    )
    found = line.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        sys.exit(f"train.py failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return found
