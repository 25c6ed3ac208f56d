"""CUDA graphs of whole calls: every word of a decoding call, or a training step's forward and backward, captured
once per input shape and replayed for each new input copied into the captured one.

On a GPU the decoder is launch-bound: a word costs a few hundred small kernels, each launched from Python, so
beam search at batch 1 takes as long as at batch 128 (docs/performance.md). A replay launches the whole call at
once. What a capture needs, and what the model keeps true for it:

- static shapes and no host read inside: every decoding method runs all ``max_len`` words with static shapes
  (``steps.run_steps``), the host trims the result once after the replay; training pads its captions to one
  width (``DataConfig.pad_to``);
- tensors that keep their storage: the weights, which Adam updates in place, and what training changes as it
  goes (the Gumbel temperature, the expected context's share) are buffers written in place;
- random numbers from torch's default CUDA generator, which gives every replay fresh ones (dropout, sampled
  words and locations). A call with a generator of its own runs eagerly.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

WARMUP_CALLS = 2  # eager calls on a side stream before a capture (cuBLAS workspaces, lazy initialisation)
DECODING_GRAPHS = 8  # decoding graphs kept per decoder (batch sizes, methods); the least recently used goes


class CapturedCall:
    """``function(*inputs)`` captured as one CUDA graph on static copies of ``inputs``.

    ``function`` is first called ``WARMUP_CALLS`` times (on a side stream on CUDA), then the buffers of ``keep``
    (the modules it runs) and the random state are put back as they were before those calls: the warm-up leaves
    no trace, and the first replay draws what one eager call would have drawn. Then it is captured. Calling the
    object copies new inputs of the same shapes into the static ones, replays the graph and returns the captured
    outputs: the same tensors every time, overwritten by the next replay.

    ``capture=False`` runs all of that but the capture: each call runs ``function`` eagerly on the static
    inputs (what a CPU can check of a capture: ``GraphedSteps``' and ``GraphCache``'s ``capture``).
    """

    def __init__(
        self,
        function: Callable[..., Any],
        inputs: Sequence[Tensor],
        keep: nn.Module | None = None,
        capture: bool = True,
        warmed: bool = False,
        pool: tuple[int, int] | None = None,
    ) -> None:
        """``warmed``: the caller ran ``warm_up`` itself, so none is run here (a forward captured apart from its
        backward warms up with it: ``training.graphed``'s SCST steps); ``pool``: the memory pool of a graph captured
        before (``graph.pool()``), shared with it (a backward's graph reads what its forward's wrote)."""
        self.inputs = [tensor.clone() for tensor in inputs]
        self.function = function
        self.graph: torch.cuda.CUDAGraph | None = None
        if not warmed:
            warm_up(lambda: function(*self.inputs), keep, self.inputs[0].device, capture)
        if not capture:
            return
        self.graph = torch.cuda.CUDAGraph()
        # Autocast caches each weight's low-precision copy until its region ends: a copy cached before the capture
        # would be read by every replay, stale once Adam moves the weight. Emptied, the copies are made inside the
        # capture (one cast per weight per replay), and emptied after it, so that no eager code reads the graph's.
        torch.clear_autocast_cache()
        # thread_local: what other threads do meanwhile (a DataLoader's pin-memory thread) cannot break the capture
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = function(*self.inputs)
        torch.clear_autocast_cache()

    def __call__(self, *inputs: Tensor) -> Any:
        """Replay on ``inputs`` (the captured shapes and dtypes); the static outputs."""
        for static, tensor in zip(self.inputs, inputs):
            static.copy_(tensor)
        if self.graph is None:
            self.outputs = self.function(*self.inputs)
        else:
            self.graph.replay()
        return self.outputs


def warm_up(run: Callable[[], Any], keep: nn.Module | None, device: torch.device, capture: bool) -> Any:
    """``WARMUP_CALLS`` eager calls of ``run`` before a capture (cuBLAS workspaces, lazy initialisation), on a side
    stream when capturing; ``keep``'s buffers and the random state of the CPU and of ``device`` (when a GPU) put back
    as they were before them, so that they leave no trace. Returns the last call's result."""
    saved = [buffer.detach().clone() for buffer in keep.buffers()] if keep is not None else []
    side = torch.cuda.Stream() if capture else None  # None: the current stream
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.cuda.stream(side):
        for _ in range(WARMUP_CALLS):
            result = run()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        for buffer, value in zip(keep.buffers() if keep is not None else (), saved):
            buffer.copy_(value)
    return result


class GraphCache:
    """Captured calls by key (the shapes, dtypes and settings a capture depends on), the ``size`` most recently
    used kept, all captured on the module's tensors where they are now (``tensors_at``): moved, cast or given new
    tensors, the module empties the cache at its next call, whose graphs would replay freed memory. A copy
    (``deepcopy``: ``AveragedModel``'s copy of a decoder, say; a pickle) gets an empty cache: graphs replay the
    tensors they were captured on, never a copy's. ``capture``: ``CapturedCall``'s.

    A replay overwrites the graph's static inputs and outputs: a caller holds ``lock`` from copying its inputs in
    until it has its outputs copied out, so that threads calling one model take turns (``decoding.decode``)."""

    def __init__(self, size: int = DECODING_GRAPHS, capture: bool = True) -> None:
        self.size = size
        self.capture = capture
        self.calls: OrderedDict[Hashable, CapturedCall] = OrderedDict()
        self.captures = 0  # graphs captured so far (a test reads it: one per shape, not one per call)
        self.tensors: Hashable = None  # ``tensors_at`` of the module when its calls were captured
        self.lock = threading.Lock()

    def serves(self, features: Tensor, static: bool) -> bool:
        """Whether a call on ``features`` with ``static`` shapes goes through the cache: on CUDA with static shapes
        (every call when not capturing: what a CPU can check of it)."""
        return not self.capture or (features.is_cuda and static)

    def get(self, key: Hashable, capture: Callable[[], CapturedCall], tensors: Hashable) -> CapturedCall:
        """The call captured for ``key``, captured now by ``capture()`` the first time; every call captured before
        dropped when the module's ``tensors`` (``tensors_at``) are no longer those they were captured on."""
        if tensors != self.tensors:
            self.calls.clear()
            self.tensors = tensors
        if key in self.calls:
            self.calls.move_to_end(key)
            return self.calls[key]
        while len(self.calls) >= self.size:
            self.calls.popitem(last=False)
        self.calls[key] = call = capture()
        self.captures += 1
        return call

    def __reduce__(self) -> tuple[type[GraphCache], tuple[int, bool]]:
        return GraphCache, (self.size, self.capture)


def tensors_at(module: nn.Module) -> tuple[tuple[int, torch.dtype, torch.Size], ...]:
    """Where ``module``'s parameters and buffers are (address, dtype, shape): what a graph captured on them reads.
    Moving the module (``.cpu().cuda()``), casting it (``.half().float()``) or giving it new tensors
    (``load_state_dict(..., assign=True)``) changes it; updating them in place (Adam) does not."""
    return tuple((t.data_ptr(), t.dtype, t.shape) for t in itertools.chain(module.parameters(), module.buffers()))


def capture_state(device: torch.device) -> tuple[bool, torch.dtype, bool]:
    """The state a capture bakes in: whether autocast is on for ``device``'s type, its dtype, and whether inference
    mode is (a graph's static inputs made in inference mode take no copy outside it)."""
    kind = device.type
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), torch.is_inference_mode_enabled()
