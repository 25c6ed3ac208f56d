"""The machine a benchmark runs on: its name and software, and the load other processes put on it."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import sys
import time
from collections.abc import Iterator, Sequence

import torch

from tables import format_value


def _busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (first line of /proc/stat; idle and iowait left out)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and its finished children (DataLoader workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OtherLoad:
    """The share of all cores that other processes kept busy while the block ran (``percent``; Linux only).

    The machine is shared: above ~10 % the block's timings are slowed by contention, and small operators
    on 2 threads suffer most (each waits for the thread that lost its core).
    """

    def __init__(self) -> None:
        self.percent = float("nan")
        self._start = (0.0, 0.0, 0.0)

    def __enter__(self) -> OtherLoad:
        if sys.platform == "linux":
            self._start = (_busy_seconds(), _own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        if sys.platform == "linux":
            busy, own, wall = (
                end - start for end, start in zip((_busy_seconds(), _own_seconds(), time.perf_counter()), self._start)
            )
            self.percent = max(0.0, 100 * (busy - own) / (wall * (os.cpu_count() or 1)))


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model and its core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    return f"{model}, {os.cpu_count()} cores"


def print_environment(title: str, args: argparse.Namespace, extra: Sequence[str] = ()) -> None:
    """Header: what is measured, on which machine and software, with which options, and the load."""
    print(f"## {title}\n")
    print(
        f"- device: {args.device} ({device_name(args.device)}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads"
    )
    print(
        f"- precision {args.precision}, channels-last {args.channels_last}, quick {args.quick}, "
        f"warm-up {args.warmup}, median of {args.repeats} timed runs"
    )
    for line in extra:
        print(f"- {line}")
    print(
        f"- {args.matmul.describe()} at start; probed again after every row, that row's 100 % in the "
        "'matmul %' columns; 'GFLOP' per timed run as torch.utils.flop_counter counts it (matrix products and "
        "convolutions, forward and backward)"
    )
    print_load("at start")


def print_load(when: str) -> None:
    """The 1/5/15-minute load averages (other processes share the cores when they exceed the core count)."""
    if hasattr(os, "getloadavg"):
        print("- load average {}: {:.2f} {:.2f} {:.2f} on {} cores".format(when, *os.getloadavg(), os.cpu_count()))
    sys.stdout.flush()


@contextlib.contextmanager
def timed_section() -> Iterator[None]:
    """Print, after the block, the load, the share of the cores other processes took, and the wall time."""
    start = time.perf_counter()
    with OtherLoad() as others:
        yield
    print()
    print_load("at end")
    print(
        f"- other processes used {format_value(others.percent)} % of the cores during the run; "
        f"script wall time {time.perf_counter() - start:.0f} s"
    )
