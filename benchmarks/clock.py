"""Timing a step (median of repeats), counting its FLOPs and the device's matmul rate they are compared with."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

# The matmul probe: n x n @ n x n, large enough to reach the device's rate.
PROBE_SIZE = {"cpu": 2048, "cuda": 8192}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of the timed runs."""

    runs: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median run: what the tables report."""
        return statistics.median(self.runs)

    @property
    def spread(self) -> float:
        """Slowest run / fastest run: how steady the machine was (1.0: perfectly)."""
        return max(self.runs) / min(self.runs)


def measure(
    fn: Callable[[], object], args: argparse.Namespace, warmup: int | None = None, repeats: int | None = None
) -> Timing:
    """Time ``repeats`` (default ``args.repeats``) runs of ``fn`` after ``warmup`` (default ``args.warmup``)
    untimed ones, the device synchronised around each run."""
    for _ in range(args.warmup if warmup is None else warmup):
        fn()
    runs = []
    for _ in range(args.repeats if repeats is None else repeats):
        synchronize(args.device)
        start = time.perf_counter()
        fn()
        synchronize(args.device)
        runs.append(time.perf_counter() - start)
    return Timing(tuple(runs))


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one run of ``fn`` as ``torch.utils.flop_counter.FlopCounterMode`` counts them (matrix products
    and convolutions, forward and backward; elementwise work is not counted)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@dataclass(frozen=True)
class MatmulRate:
    """The device's dense matmul rate in this run, at the benchmark's precision: the yardstick of every row."""

    flops_per_s: float
    size: int
    dtype: torch.dtype

    @classmethod
    def probe(cls, args: argparse.Namespace) -> MatmulRate:
        """Time a square matmul (best of 3 after a warm-up; 256 wide and one run under --tiny)."""
        size = 256 if args.tiny else PROBE_SIZE.get(args.device.type, PROBE_SIZE["cpu"])
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        a, b = (torch.randn(size, size, device=args.device, dtype=dtype) for _ in range(2))
        timing = measure(lambda: a @ b, args, warmup=0 if args.tiny else 1, repeats=1 if args.tiny else 3)
        return cls(2 * size**3 / min(timing.runs), size, dtype)

    def describe(self) -> str:
        """One line: what was probed and its rate."""
        name = str(self.dtype).removeprefix("torch.")
        n = self.size
        return f"matmul probe: {name} {n}x{n} @ {n}x{n}, {self.flops_per_s / 1e9:,.1f} GFLOP/s"


FLOP_COLUMNS = ["GFLOP", "GFLOP/s", "matmul %"]


def flop_cells(flops: int, seconds: float, args: argparse.Namespace) -> list[float]:
    """The cells of ``FLOP_COLUMNS``: FLOPs of the timed work, its rate, and that rate as a percentage of the
    device's matmul rate probed again now, just after the row was timed: on a shared machine the row and its
    yardstick then see the same contention (the probe is kept in ``args.matmul``)."""
    args.matmul = MatmulRate.probe(args)
    rate = flops / seconds
    return [flops / 1e9, rate / 1e9, 100 * rate / args.matmul.flops_per_s]
