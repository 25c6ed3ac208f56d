"""What no package module does and every benchmark script needs: composing the project's experiments into
the model and batches they train, timing, memory, load, FLOP counting, the device's matmul rate, tables.

The scripts are plain Python, run from the repository root as ``python benchmarks/<script>.py``; each
prints Markdown tables whose rows carry their configuration. A size is an experiment of ``conf/``
(``demo``, what ``python train.py`` trains, and ``coco_soft``/``coco_hard``, the paper's recipe), composed
with Hydra's compose API as ``train.py`` composes it, parsed once into its ``TrainConfig`` and built into the
same ``CaptionerModule`` (model, loss) training builds. Only what a benchmark cannot have is overridden:
random encoder weights (nothing is downloaded; timing does not depend on the values), and under
``--quick`` a smaller COCO training batch.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from captioner.config import CAPTIONING_BATCH_SIZE, DataConfig, ModelConfig, TrainConfig, from_dict
from captioner.data.scenes import ShapesSpec, make_scene
from captioner.data.vocab import Vocabulary
from captioner.model.captioner import Captioner
from captioner.model.decoder import DecoderOutput
from captioner.training.schemas import register_schemas

ROOT = Path(__file__).resolve().parents[1]

MiB = 2**20
# Tensor methods that copy a value to the host (a device synchronisation on a GPU).
HOST_READS = frozenset({"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy"})
CAPTIONS_PER_IMAGE = 5  # COCO's and the demo's references per image
# The experiments benchmarked: the paper's COCO recipe and the built-in demo (`python train.py`).
EXPERIMENTS = {"soft": ("coco_soft", "demo"), "hard": ("coco_hard", "demo")}
# Nothing can be downloaded, and timing does not depend on the weights' values.
RANDOM_WEIGHTS = ("model.encoder.weights=null",)
# --quick: COCO training batches of fewer images (a 448 px ResNet-101 training step on 32 images takes most of a
# minute on 2 CPU cores); captioning keeps its batch of 32.
QUICK_BATCH = 8
# --tiny (smoke tests): the demo shrunk to 64 px images (an 8x8 layer2 grid), 16-wide layers, 2 images of
# 3-word captions, 4 decoded words, the vocabulary of 50 generated training scenes.
TINY = (
    "data.image_size=64",
    "data.batch_size=2",
    "data.max_len=3",
    "data.source.n_train=50",
    "model.decoder.embed_dim=16",
    "model.decoder.hidden_dim=16",
    "model.decoder.attention_dim=16",
    "model.decoding.max_len=4",
)
# The matmul probe: n x n @ n x n, large enough to reach the device's rate.
PROBE_SIZE = {"cpu": 2048, "cuda": 8192}


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
    parser.add_argument("--tiny", action="store_true", help="a tiny demo model, one iteration: a smoke test")
    parser.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"COCO training batches of {QUICK_BATCH} images instead of the recipe's 32, fewer repeats "
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
    """Parse and resolve the defaults that depend on the device; seed torch; probe the device's matmul rate
    (``args.matmul``)."""
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
    args.matmul = MatmulRate.probe(args)
    return args


# ------------------------------------------------------------------------------------------ the experiments
def compose_config(experiment: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """``python train.py experiment=<experiment> <overrides>``'s config (None: no experiment), composed from
    ``conf/`` by Hydra's compose API, resolved as if started from the repository root; plain data, without
    the ``hydra`` node."""
    chosen = [f"experiment={experiment}"] if experiment else []
    register_schemas()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*chosen, *overrides], return_hydra_config=True)
    cfg.hydra.runtime.cwd = str(ROOT)  # paths.root_dir
    cfg.hydra.runtime.output_dir = str(ROOT / "outputs")
    HydraConfig.instance().set_config(cfg)  # the ${hydra:...} resolver reads it from there
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def vocabulary(data: DataConfig) -> Vocabulary:
    """The vocabulary the ``data`` settings give: for the built-in shapes, the words of its training captions
    (generated, no image drawn) as the data module counts them; for a real dataset ``data.max_vocab`` words
    (COCO's Karpathy train reaches 10,000), named ``w4``, ``w5``, ..."""
    spec = getattr(instantiate(data.source), "spec", None)  # ShapesSource's generator parameters
    if spec is not None:
        return shapes_vocabulary(spec, data.min_word_count, data.max_vocab)
    first = len(Vocabulary.SPECIALS)
    return Vocabulary([f"w{i}" for i in range(first, first + (data.max_vocab or 10_000))])


@functools.cache
def shapes_vocabulary(spec: ShapesSpec, min_count: int, max_size: int | None) -> Vocabulary:
    """The vocabulary of the training captions of the shapes dataset ``spec`` (scenes made, not drawn)."""
    captions = (c for i in range(spec.n_train) for c in make_scene(spec, "train", i).captions)
    return Vocabulary.build(captions, min_count=min_count, max_size=max_size)


@dataclass(frozen=True, eq=False)
class Setup:
    """One benchmarked size: an experiment of ``conf/`` composed with the benchmark's overrides."""

    name: str  # the experiment, or "tiny"
    cfg: dict[str, Any]  # the composed config (plain)
    settings: TrainConfig  # ``cfg`` parsed
    vocab: Vocabulary

    @property
    def model(self) -> ModelConfig:
        """The ``model`` section."""
        return self.settings.model

    @property
    def data(self) -> DataConfig:
        """The ``data`` section."""
        return self.settings.data

    @property
    def batch(self) -> int:
        """Training images per step (``data.batch_size``)."""
        return self.data.batch_size

    @property
    def steps(self) -> int:
        """Teacher-forced steps of a longest training caption: its ``data.max_len`` words and ``<end>``."""
        return self.data.max_len + 1

    @property
    def decode_len(self) -> int:
        """Words decoded per caption (``model.decoding.max_len``)."""
        return self.model.decoding.max_len

    @property
    def caption_batch(self) -> int:
        """Images per captioning batch."""
        return 2 if self.name == "tiny" else CAPTIONING_BATCH_SIZE

    def describe(self) -> str:
        """One line with every number of this size."""
        net = self.model
        encoder, decoder = net.encoder, net.decoder
        height, width, channels = grid_shape(self)
        frozen = "frozen" if encoder.trainable_stages == 0 else f"last {encoder.trainable_stages} stage(s) trained"
        return (
            f"{self.name}: {encoder.name} ({frozen}, random weights, {encoder.stage or 'last stage'}) "
            f"{self.data.image_size} px -> {height}x{width}x{channels} grid, embed/hidden/attention "
            f"{decoder.embed_dim}/{decoder.hidden_dim}/{decoder.attention_dim}, vocab {len(self.vocab):,}, "
            f"{self.data.max_len}-word captions, {CAPTIONS_PER_IMAGE} per image, training batch {self.batch} images, "
            f"decoding {self.decode_len} words, captioning batch {self.caption_batch}"
        )


def setup(experiment: str, args: argparse.Namespace, attention: str = "soft", overrides: Sequence[str] = ()) -> Setup:
    """``experiment`` with ``model=<attention>``, random encoder weights, ``args``' memory format, and
    under --quick (COCO) or --tiny the smaller batches and sizes."""
    extra = [*RANDOM_WEIGHTS, f"model={attention}", f"model.encoder.channels_last={str(args.channels_last).lower()}"]
    if args.tiny:
        extra += TINY
    elif args.quick and experiment.startswith("coco"):
        extra.append(f"data.batch_size={QUICK_BATCH}")
    cfg = compose_config(experiment, [*extra, *overrides])
    settings = from_dict(TrainConfig, cfg)
    return Setup("tiny" if args.tiny else experiment, cfg, settings, vocabulary(settings.data))


def setups(args: argparse.Namespace, attention: str = "soft") -> list[Setup]:
    """The sizes to run with ``attention``: the COCO recipe and the demo, or only the tiny demo."""
    if args.tiny:
        return [setup("demo", args, attention)]
    return [setup(name, args, attention) for name in EXPERIMENTS[attention]]


def build_module(size: Setup, args: argparse.Namespace) -> nn.Module:
    """The ``CaptionerModule`` of ``size`` (its captioner, loss and settings) on the device, built from the
    ``model`` section as ``train.py`` builds it."""
    from captioner.training.module import CaptionerModule

    return CaptionerModule(size.vocab, size.model).to(args.device)


def grid_shape(size: Setup) -> tuple[int, int, int]:
    """(H, W, C) of the grid the decoder attends over for ``size``'s images, from an encoder on the meta device."""
    from captioner.model.encoder import Encoder

    with torch.device("meta"):
        encoder = Encoder(size.model.encoder)
    return *encoder.grid_size(size.data.image_size), encoder.out_channels


def never_end(model: Captioner) -> Captioner:
    """Make ``model`` never emit <end> (a -1e4 bias on its logit), so that decoding always runs ``max_len``
    words: the worst case, and the same work whatever the batch. Untrained weights end at random steps."""
    with torch.no_grad():
        model.decoder.classifier.bias[Vocabulary.end_id] = -1e4
    return model


def random_images(size: Setup, count: int, device: torch.device) -> Tensor:
    """(count, 3, S, S) normalised-looking images."""
    return torch.randn(count, 3, size.data.image_size, size.data.image_size, device=device)


def random_features(model: Captioner, size: Setup, count: int, device: torch.device) -> Tensor:
    """(count, L', C') non-negative features shaped as ``model.encode``'s output (what the feature cache holds:
    the grid of a frozen encoder, the frozen stages' map of one that trains its last stages)."""
    with torch.no_grad():
        shape = model.encode(random_images(size, 1, device))[0].shape[1:]
    return torch.randn(count, *shape, device=device).relu()


def random_captions(size: Setup, images: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``CAPTIONS_PER_IMAGE`` longest captions per image: ids (N, steps + 1) and image_index (N,).

    Each is ``<start>``, ``data.max_len`` random words and ``<end>``: no padding, every step counts.
    """
    count = images * CAPTIONS_PER_IMAGE
    words = torch.randint(Vocabulary.unk_id + 1, len(size.vocab), (count, size.data.max_len), device=device)
    start = torch.full((count, 1), Vocabulary.start_id, device=device)
    end = torch.full((count, 1), Vocabulary.end_id, device=device)
    index = torch.arange(images, device=device).repeat_interleave(CAPTIONS_PER_IMAGE)
    return torch.cat([start, words, end], dim=1), index


def autocast(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """bf16 autocast on the device for --precision bf16, else nothing."""
    return torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")


def model_train_step(size: Setup, args: argparse.Namespace, source: str) -> tuple[Captioner, Callable[[], None], int]:
    """The whole captioner's training step on a random batch of ``size``: the model, the step, its caption count.

    ``source``: "images" (each image once, its captions gathered after the encoder), "per_caption" (one
    copy of the image per caption, as ``data.per_caption=true`` batches them) or "features" (the feature
    cache's content).
    """
    module = build_module(size, args)
    model = module.model
    captions, index = random_captions(size, size.batch, args.device)
    forward: Callable[[], DecoderOutput]
    if source == "features":
        features = random_features(model, size, size.batch, args.device)
        forward = lambda: model.forward_features(features, captions, index)  # noqa: E731
    elif source == "images":
        images = random_images(size, size.batch, args.device)
        forward = lambda: model(images, captions, index)  # noqa: E731
    elif source == "per_caption":
        copies = random_images(size, size.batch, args.device).repeat_interleave(CAPTIONS_PER_IMAGE, 0)
        forward = lambda: model(copies, captions)  # noqa: E731
    else:
        raise ValueError(f"unknown source {source!r}")
    return model, make_train_step(module, model, forward, captions, args), captions.size(0)


def make_train_step(
    module: nn.Module,
    trained: nn.Module,
    forward: Callable[[], DecoderOutput],
    captions: Tensor,
    args: argparse.Namespace,
) -> Callable[[], None]:
    """One optimisation step as training runs it: ``forward`` and the module's loss (its ``criterion``, under
    autocast), backward, and Adam over the trainable parameters of ``trained`` (in train mode; frozen CNN
    stages stay in eval)."""
    module.train()
    trained.train()
    optimizer = torch.optim.Adam([p for p in trained.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        with autocast(args):
            loss = module.criterion(forward(), captions)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


# ---------------------------------------------------------------------------------------- timing and FLOPs
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
        f"- other processes used {_format(others.percent)} % of the cores during the run; "
        f"script wall time {time.perf_counter() - start:.0f} s"
    )
