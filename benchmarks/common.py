"""What the benchmark scripts share: options, the model sizes, batches, the training step, timing, memory, tables.

The scripts are plain Python, run from the repository root as ``python benchmarks/<script>.py``; each
prints Markdown tables whose rows carry their configuration. Models have random weights (timing does
not depend on the values, and nothing is downloaded), built through ``build_captioner`` exactly as
training builds them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from captioner.config import Attention, DecoderConfig, EncoderConfig, LossConfig, NetConfig
from captioner.data.vocab import Vocabulary
from captioner.model.captioner import Captioner, build_captioner
from captioner.model.decoder import DecoderOutput
from captioner.model.encoder import Encoder
from captioner.model.losses import CaptionLoss

MiB = 2**20
# Tensor methods that copy a value to the host (a device synchronisation on a GPU).
HOST_READS = frozenset({"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy"})


@dataclass(frozen=True)
class Size:
    """A model size and its training batch (images per batch, each with ``captions_per_image`` captions)."""

    name: str
    encoder: str
    image_size: int
    grid: int | None
    embed_dim: int
    hidden_dim: int
    attention_dim: int
    vocab_size: int
    steps: int  # teacher-forced words per caption (<end> included): caption tensors hold steps + 1 ids
    batch: int  # images per training batch
    dropout: float
    captions_per_image: int = 5
    caption_batch: int = 32  # images per captioning batch

    def describe(self) -> str:
        """One line with every number of this size."""
        height, width, channels = encoder_grid(self)
        return (
            f"{self.name}: {self.encoder} (frozen, random weights) {self.image_size} px -> "
            f"{height}x{width}x{channels} grid, "
            f"embed/hidden/attention {self.embed_dim}/{self.hidden_dim}/{self.attention_dim}, "
            f"vocab {self.vocab_size:,}, {self.steps}-word captions, {self.captions_per_image} per image, "
            f"training batch {self.batch} images, captioning batch {self.caption_batch}"
        )


# The COCO recipe (conf/experiment/coco_soft.yaml) and the built-in demo (conf/experiment/demo.yaml).
COCO = Size("coco", "resnet101", 448, 14, 512, 512, 512, 10_000, 20, 32, 0.5)
DEMO = Size("demo", "resnet18", 96, None, 128, 256, 128, 40, 16, 32, 0.3)
# Smoke tests only: the smallest images resnet18 maps to a 2x2 grid.
TINY = Size("tiny", "resnet18", 64, None, 16, 16, 16, 20, 4, 2, 0.0, caption_batch=2)
# --quick: COCO training batches of fewer images (a 448 px ResNet-101 training step on 32 images takes most of a
# minute on 2 CPU cores); captioning keeps its batch of 32.
QUICK_COCO_BATCH = 8


def make_parser(description: str) -> argparse.ArgumentParser:
    """The options every script takes: device, precision, channels-last, --tiny/--quick and iteration counts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32, or bf16 autocast as Lightning's bf16-mixed (default: fp32)",
    )
    parser.add_argument("--channels-last", action="store_true", help="run the CNN in channels-last memory format")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, one iteration: a smoke test")
    parser.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"COCO training batches of {QUICK_COCO_BATCH} images instead of 32, fewer repeats "
        "(default: on for CPU, off for GPU)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="intra-op CPU threads (default: torch's, one per core)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default: 1)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs, the median is reported (default: 2 quick, 5 otherwise)"
    )
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and resolve the defaults that depend on the device; seed torch."""
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.quick is None:
        args.quick = args.device.type == "cpu"
    if args.tiny:
        args.warmup, args.repeats = 0, 1
    elif args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return args


def sizes(args: argparse.Namespace) -> list[Size]:
    """The sizes to run: COCO and demo (COCO batch shrunk by --quick), or only the tiny one."""
    if args.tiny:
        return [TINY]
    return [replace(COCO, batch=QUICK_COCO_BATCH) if args.quick else COCO, DEMO]


def build_model(size: Size, args: argparse.Namespace, mode: str = "soft") -> Captioner:
    """The captioner of ``size`` as the training config builds it (frozen encoder, feature norm) on the device."""
    net = NetConfig(
        attention=Attention(mode),
        encoder=encoder_config(size, args.channels_last),
        decoder=DecoderConfig(
            embed_dim=size.embed_dim, hidden_dim=size.hidden_dim, attention_dim=size.attention_dim, dropout=size.dropout
        ),
    )
    return build_captioner(net, size.vocab_size).to(args.device)


def encoder_config(size: Size, channels_last: bool) -> EncoderConfig:
    """The encoder of ``size``: frozen, its last stage pooled to ``size.grid``."""
    return EncoderConfig(name=size.encoder, stage=None, grid=size.grid, trainable_stages=0, channels_last=channels_last)


@functools.lru_cache
def encoder_grid(size: Size) -> tuple[int, int, int]:
    """(H, W, C) of the encoder's grid for ``size``'s images, from an encoder on the meta device (no compute)."""
    with torch.device("meta"):
        encoder = Encoder(encoder_config(size, channels_last=False))  # the memory format leaves shapes alone
    return *encoder.grid_size(size.image_size), encoder.out_channels


def never_end(model: Captioner) -> Captioner:
    """Make ``model`` never emit <end> (a -1e4 bias on its logit), so that decoding always runs ``max_len``
    words: the worst case, and the same work whatever the batch. Untrained weights end at random steps."""
    with torch.no_grad():
        model.decoder.classifier.bias[Vocabulary.end_id] = -1e4
    return model


def random_images(size: Size, count: int, device: torch.device) -> Tensor:
    """(count, 3, S, S) normalised-looking images."""
    return torch.randn(count, 3, size.image_size, size.image_size, device=device)


def random_features(size: Size, count: int, device: torch.device) -> Tensor:
    """(count, L, C) non-negative features, like a ReLU CNN's grid."""
    height, width, channels = encoder_grid(size)
    return torch.randn(count, height * width, channels, device=device).relu()


def random_captions(size: Size, images: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``captions_per_image`` full-length captions per image: ids (N, steps + 1) and image_index (N,).

    Each is ``<start>``, ``steps - 1`` random words and ``<end>``: no padding, every step counts.
    """
    count = images * size.captions_per_image
    words = torch.randint(Vocabulary.unk_id + 1, size.vocab_size, (count, size.steps - 1), device=device)
    start = torch.full((count, 1), Vocabulary.start_id, device=device)
    end = torch.full((count, 1), Vocabulary.end_id, device=device)
    index = torch.arange(images, device=device).repeat_interleave(size.captions_per_image)
    return torch.cat([start, words, end], dim=1), index


def autocast(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """bf16 autocast on the device for --precision bf16, else nothing."""
    return torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")


def model_train_step(
    size: Size, args: argparse.Namespace, mode: str, source: str
) -> tuple[Captioner, Callable[[], None], int]:
    """The whole captioner's training step on a random batch of ``size``: the model, the step, its caption count.

    ``source``: "images" (each image once, its captions gathered after the encoder), "per_caption" (one
    copy of the image per caption, as ``per_caption=True`` batches them) or "features" (cached features).
    """
    model = build_model(size, args, mode)
    captions, index = random_captions(size, size.batch, args.device)
    forward: Callable[[], DecoderOutput]
    if source == "features":
        features = random_features(size, size.batch, args.device)
        forward = lambda: model.forward_features(features, captions, index)  # noqa: E731
    elif source == "images":
        images = random_images(size, size.batch, args.device)
        forward = lambda: model(images, captions, index)  # noqa: E731
    elif source == "per_caption":
        copies = random_images(size, size.batch, args.device).repeat_interleave(size.captions_per_image, 0)
        forward = lambda: model(copies, captions)  # noqa: E731
    else:
        raise ValueError(f"unknown source {source!r}")
    return model, make_train_step(model, forward, captions, args), captions.size(0)


def make_train_step(
    trained: nn.Module, forward: Callable[[], DecoderOutput], captions: Tensor, args: argparse.Namespace
) -> Callable[[], None]:
    """One optimisation step as training runs it: ``forward`` and CaptionLoss (under autocast), backward,
    and Adam over the trainable parameters of ``trained`` (in train mode; frozen CNN stages stay in eval)."""
    trained.train()
    criterion = CaptionLoss(LossConfig(), Vocabulary.pad_id).to(args.device).train()
    optimizer = torch.optim.Adam([p for p in trained.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        with autocast(args):
            loss = criterion(forward(), captions)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


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


def _format(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "n/a"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    """Print a Markdown table under a ``### title`` line (floats to 3 significant digits)."""
    cells = [columns] + [[_format(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |"

    print(f"\n### {title}\n")
    print(line(columns))
    print("|" + "|".join("-" * (width + 2) for width in widths) + "|")
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()


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
        f"- other processes used {_format(others.percent)} % of the cores during the run; "
        f"script wall time {time.perf_counter() - start:.0f} s"
    )
