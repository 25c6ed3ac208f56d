"""Counters of what runs inside a block: the images entering the encoder, torch calls and host reads, and the
operators that compute (a kernel each on a GPU)."""

from __future__ import annotations

from collections import Counter

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from captioner.model.captioner import Captioner

# Tensor methods that copy a value to the host (a device synchronisation on a GPU).
HOST_READS = frozenset({"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy"})


class EncoderCounter:
    """Counts the images that enter the encoder's CNN (a pre-hook on its first stage) inside the block."""

    def __init__(self, model: Captioner) -> None:
        self.model = model
        self.images = 0

    def _count(self, module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        self.images += inputs[0].shape[0]

    def __enter__(self) -> EncoderCounter:
        self._handle = self.model.encoder.stages[0].register_forward_pre_hook(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


class OpCounter(TorchFunctionMode):
    """Counts the torch calls made from Python in the block (``calls``), and among them the reads of a
    tensor's value on the host (``host_reads``: ``bool(t)``, ``t.item()``, ...; each a sync on a GPU).

    Counts that do not grow with the batch show that no Python loop runs per image.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.host_reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch protocol)
        self.calls += 1
        self.host_reads += getattr(func, "__name__", "") in HOST_READS
        return func(*args, **(kwargs or {}))


# aten operators that are not views but compute nothing: no kernel on a GPU.
NO_KERNEL = frozenset({"aten._unsafe_view", "aten.lift_fresh", "aten.empty", "aten.empty_like", "aten.detach_"})


class KernelCounter(TorchDispatchMode):
    """Counts the aten operators that compute in the block, by name (``kernels``): views (``view``, ``t``,
    ``select``, ``expand``, ...) and ``NO_KERNEL`` left out. On a GPU each is a kernel launch, or a node of a CUDA
    graph: the count a call's kernels are, measured on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch protocol)
        name = str(func.overloadpacket)
        if not func.is_view and name not in NO_KERNEL:
            self.kernels[name] += 1
        return func(*args, **(kwargs or {}))
