"""Peak memory of a step: the GPU's allocator, or the process's peak RSS on a CPU."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys

import torch

from clock import synchronize

MiB = 2**20


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _release_free_heap() -> None:
    """Hand freed heap memory back to the OS (glibc malloc_trim), so it is not counted in the baseline RSS."""
    gc.collect()
    with contextlib.suppress(AttributeError, OSError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)


def memory_method(device: torch.device) -> str:
    """How ``PeakMemory`` measures on ``device``."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated (tensors only)"
    return (
        "peak RSS: /proc/self/status VmHWM, reset through /proc/self/clear_refs before each row "
        "(the ru_maxrss high-water mark, made resettable); the whole process, ~0.7 GiB of it the "
        "imported libraries"
    )


class PeakMemory:
    """Peak memory while the block runs: ``peak_mib`` in all, ``added_mib`` above what was held at its start
    (the model, its inputs and the libraries), i.e. what the step itself needs (activations, gradients, Adam)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_mib = self.added_mib = float("nan")
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif sys.platform == "linux":
            _release_free_heap()
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
            self._base = _proc_status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif sys.platform == "linux":
            peak = _proc_status_kib("VmHWM") * 1024
        else:
            return
        self.peak_mib, self.added_mib = peak / MiB, (peak - self._base) / MiB
