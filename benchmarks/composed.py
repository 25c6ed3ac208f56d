"""The benchmarked sizes: the project's experiments composed from ``conf/`` as ``train.py`` composes them,
parsed once into their ``TrainConfig``, and the models, random inputs and training steps built from them.

A size is an experiment (``demo``, what ``python train.py`` trains, and ``coco_soft``/``coco_hard``, the
paper's recipe) built into the same ``CaptionerModule`` (model, loss) training builds. Only what a benchmark
cannot have is overridden: random encoder weights (nothing is downloaded; timing does not depend on the
values), and under ``--quick`` a smaller COCO training batch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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

from captioner.config import CAPTIONING_BATCH_SIZE, DataConfig, ModelConfig, ShapesSpec, TrainConfig, from_dict
from captioner.data.scenes import make_scene
from captioner.data.vocab import END_ID, SPECIALS, START_ID, UNK_ID, Vocabulary
from captioner.model.captioner import Captioner
from captioner.model.decoder import DecoderOutput
from captioner.training.schemas import register_schemas

ROOT = Path(__file__).resolve().parents[1]
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
    first = len(SPECIALS)
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
        model.decoder.classifier.bias[END_ID] = -1e4
    return model


@contextlib.contextmanager
def eager_decoding(model: Captioner) -> Iterator[None]:
    """Decode eagerly inside (no CUDA graph of the call): what FLOP counting needs, which sees no replayed kernel."""
    graphs, model.decoder.decoding_graphs = model.decoder.decoding_graphs, None
    try:
        yield
    finally:
        model.decoder.decoding_graphs = graphs


def random_images(size: Setup, count: int, device: torch.device) -> Tensor:
    """(count, 3, S, S) normalised-looking images."""
    return torch.randn(count, 3, size.data.image_size, size.data.image_size, device=device)


def random_grid(size: Setup, count: int, device: torch.device) -> Tensor:
    """(count, H*W, C) non-negative features of ``size``'s grid: what the decoder attends over."""
    height, width, channels = grid_shape(size)
    return torch.randn(count, height * width, channels, device=device).relu()


def random_features(model: Captioner, size: Setup, count: int, device: torch.device) -> Tensor:
    """(count, L', C') non-negative features shaped as ``model.encode``'s output (what the feature cache holds:
    the grid of a frozen encoder, the frozen stages' map of one that trains its last stages)."""
    with torch.no_grad():
        shape = model.encode(random_images(size, 1, device))[0].shape[1:]
    return torch.randn(count, *shape, device=device).relu()


def random_captions(
    size: Setup, images: int, device: torch.device, gathered: bool = False
) -> tuple[Tensor, Tensor | int]:
    """``CAPTIONS_PER_IMAGE`` longest captions per image: ids (N, steps + 1) and their images as the decoder reads
    them: K = ``CAPTIONS_PER_IMAGE`` per image, the layout of training's batches (``collate``'s
    ``captions_per_image``), or with ``gathered`` each caption's image (N,), the layout of batches whose images
    have unequal numbers of captions (each image's features copied to each of its captions).

    Each is ``<start>``, ``data.max_len`` random words and ``<end>``: no padding, every step counts.
    """
    count = images * CAPTIONS_PER_IMAGE
    words = torch.randint(UNK_ID + 1, len(size.vocab), (count, size.data.max_len), device=device)
    start = torch.full((count, 1), START_ID, device=device)
    end = torch.full((count, 1), END_ID, device=device)
    if not gathered:
        return torch.cat([start, words, end], dim=1), CAPTIONS_PER_IMAGE
    index = torch.arange(images, device=device).repeat_interleave(CAPTIONS_PER_IMAGE)
    return torch.cat([start, words, end], dim=1), index


def autocast(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """bf16 autocast on the device for --precision bf16, else nothing."""
    return torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")


def model_train_step(
    size: Setup, args: argparse.Namespace, source: str, graphs: bool = False
) -> tuple[Captioner, Callable[[], None], int]:
    """The whole captioner's training step on a random batch of ``size``: the model, the step, its caption count.

    ``source``: "images" (each image once, its captions gathered after the encoder), "per_caption" (one
    copy of the image per caption, as ``data.per_caption=true`` batches them) or "features" (the feature
    cache's content). ``graphs``: the step as ``model.graphs`` trains it, forward, loss and backward one CUDA graph.
    """
    from captioner.training.objectives import teacher_forced

    module = build_module(size, args)
    model = module.model
    captions, index = random_captions(size, size.batch, args.device)
    weights = torch.ones(captions.size(0), device=args.device)  # collate's caption_weights: every caption counts
    batch: dict[str, Any] = {"captions": captions, "captions_per_image": index, "caption_weights": weights}
    if source == "features":
        batch["features"] = random_features(model, size, size.batch, args.device)
    elif source == "images":
        batch["images"] = random_images(size, size.batch, args.device)
    elif source == "per_caption":
        batch["images"] = random_images(size, size.batch, args.device).repeat_interleave(CAPTIONS_PER_IMAGE, 0)
        batch["captions_per_image"], batch["image_index"] = None, torch.arange(captions.size(0), device=args.device)
    else:
        raise ValueError(f"unknown source {source!r}")
    forward = functools.partial(teacher_forced, model, dtype=torch.float32)
    return model, make_train_step(module, model, lambda b: forward(batch=b), batch, args, graphs), captions.size(0)


def decoder_training(
    decoder: nn.Module, features: Tensor, captions: Tensor, index: Tensor | int
) -> tuple[Callable[[dict], DecoderOutput], dict[str, Any]]:
    """The decoder alone's teacher forcing on grid ``features`` as ``make_train_step``'s forward, and its batch
    (``index`` as ``random_captions`` gives it: K per image, or each caption's image)."""
    key = "image_index" if isinstance(index, Tensor) else "captions_per_image"

    def forward(batch: dict[str, Any]) -> DecoderOutput:
        return decoder(batch["features"], batch["captions"], batch[key])

    return forward, {"features": features, "captions": captions, key: index}


def make_train_step(
    module: nn.Module,
    trained: nn.Module,
    forward: Callable[[dict], DecoderOutput],
    batch: dict[str, Any],
    args: argparse.Namespace,
    graphs: bool = False,
) -> Callable[[], None]:
    """One optimisation step as training runs it: ``forward(batch)`` and the module's loss (its ``criterion``,
    under autocast), backward, and Adam as training builds it (fused on a GPU) over the trainable parameters of
    ``trained`` (in train mode; frozen CNN stages stay in eval). ``graphs``: forward, loss and backward replay one
    CUDA graph (``training.graphed.GraphedSteps``, as ``model.graphs`` trains), the first call capturing it."""
    from captioner.training.graphed import GraphedSteps
    from captioner.training.optimization import build_optimizer

    module.train()
    trained.train()
    optimizer = build_optimizer([p for p in trained.parameters() if p.requires_grad], [], module.settings.optimizer)

    def terms(given: dict[str, Any]) -> dict[str, Tensor]:
        with autocast(args):
            return module.criterion(forward(given), given["captions"], given.get("caption_weights"))

    if graphs:
        graphed = GraphedSteps(nn.ModuleList([trained, module.criterion]), terms)

        def replay() -> None:
            graphed.step(batch)
            optimizer.zero_grad(set_to_none=True)
            graphed.attach_gradients()
            optimizer.step()

        return replay

    def step() -> None:
        loss = terms(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step
