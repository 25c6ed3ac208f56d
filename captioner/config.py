"""Every setting of the model, its training and its data: one typed dataclass per concern.

Each field is written here once, with its default, its comment and its valid range (checked in
``__post_init__``); choices are ``StrEnum``s. The Hydra configs in ``conf/`` use these classes as their
schemas (``train.py`` registers them), so a misspelt key fails when the config is composed;
``build_captioner``, the LightningModule, the data module, the bundle and the benchmarks build the same
classes with ``from_dict``, which names the key of a bad value (``model.decoder.dropout=1.5 must be ...``).

The network's defaults are those of the built-in demo (``python train.py``); its recipe (SCST, epochs) is
``conf/experiment/demo.yaml``, and ``conf/experiment/coco_*`` set the paper's.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from captioner.errors import ConfigError, check_range

T = TypeVar("T")
MAX_LEN = 20  # words per caption at most, <end> excluded: training's cut (DataConfig) and decoding's limit
MAX_AUTO_WORKERS = 8  # DataConfig.num_workers=None uses at most this many loader workers


class Attention(enum.StrEnum):
    """How the decoder reads the grid (Xu et al. section 4)."""

    soft = "soft"  # the expected context, a weighted sum (4.2)
    hard = "hard"  # one sampled location (4.1)


class Scorer(enum.StrEnum):
    """How attention scores a location against the decoder state."""

    additive = "additive"  # Bahdanau: w^T tanh(W a_i + U h)  (the paper's f_att)
    dot = "dot"
    scaled_dot = "scaled_dot"
    bilinear = "bilinear"
    multihead = "multihead"  # soft attention only
    mean = "mean"  # no attention: the mean feature at every step (an ablation)


class Positional(enum.StrEnum):
    """How the grid self-attention blocks know where the locations are."""

    none = "none"  # not at all: a set of features
    absolute = "absolute"  # a fixed 2-D sinusoidal encoding of each location, added to the queries' and keys' input
    relative = "relative"  # learned vectors of the row and column offsets, clipped (Shaw et al. 2018)


class Gate(enum.StrEnum):
    """The gating scalar beta of section 4.2.1."""

    scalar = "scalar"
    vector = "vector"  # one gate per feature channel
    none = "none"


class HardInference(enum.StrEnum):
    """What hard attention reads at inference."""

    argmax = "argmax"  # the most likely location
    expectation = "expectation"  # the expected context, as soft attention


class HardEstimator(enum.StrEnum):
    """How hard attention's location choice is trained."""

    reinforce = "reinforce"  # the paper's eq. 12 (with a per-step reward and baseline)
    gumbel = "gumbel"  # straight-through Gumbel-softmax over the locations


class ReinforceReward(enum.StrEnum):
    """The per-step reward of REINFORCE."""

    word = "word"  # log p of word t
    suffix = "suffix"  # log p of words t..end


class Schedule(enum.StrEnum):
    """The learning-rate schedule after warm-up."""

    cosine = "cosine"
    step = "step"
    none = "none"


class DecodeMethod(enum.StrEnum):
    """How validation, test and the CLI turn a model into captions."""

    greedy = "greedy"
    beam = "beam"
    sample = "sample"


class Compile(enum.StrEnum):
    """What ``torch.compile`` does to the decoder's step (``model.compile``); true/false read as default/off."""

    off = "off"  # eager
    default = "default"  # inductor kernels
    reduce_overhead = "reduce-overhead"  # inductor kernels replayed as CUDA graphs (on CUDA)
    max_autotune = "max-autotune"  # inductor with autotuned kernels (long compiles)

    @classmethod
    def _missing_(cls, value: object) -> Compile | None:
        """Old configs' and checkpoints' true/false."""
        return {True: cls.default, False: cls.off}.get(value) if isinstance(value, bool) else None


class NonFinite(enum.StrEnum):
    """What a NaN/inf training loss does (its optimiser step is skipped either way)."""

    stop = "stop"  # raise, naming the last good checkpoint
    skip = "skip"  # warn and go on


class Objective(enum.StrEnum):
    """What training optimises."""

    cross_entropy = "cross_entropy"
    scst = "scst"  # self-critical sequence training of a trained model (Rennie et al. 2017)


class ScstBaseline(enum.StrEnum):
    """The baseline of self-critical training."""

    mean = "mean"  # the mean reward of the image's other samples
    greedy = "greedy"  # the reward of the image's greedy caption (Rennie et al.)


class FeatureDtype(enum.StrEnum):
    """The dtype the feature cache stores grids in."""

    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


class Settings:
    """What every settings dataclass does when built: a choice given as its name becomes its enum member,
    then ``check`` tests the ranges (ConfigError naming the field)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for item in dataclasses.fields(self):
            kind = hints[item.name]
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                setattr(self, item.name, _convert(kind, getattr(self, item.name), item.name))
        self.check()

    def check(self) -> None:
        """Raise ConfigError for a value out of its range (the field named as ``name=value``)."""


@dataclass
class EncoderConfig(Settings):
    """The torchvision CNN that turns an image into a grid of features."""

    name: str = "resnet18"  # any torchvision classification CNN (torchvision.models.get_model)
    weights: str | None = None  # a torchvision weights name (DEFAULT, IMAGENET1K_V2, ...) or None
    # The demo reads resnet18's layer2 (12x12 at 96 px) and trains it: an untrained CNN's layer4 cells all
    # see the whole image, frozen random layer2 features tell the shapes apart poorly.
    stage: str | None = "layer2"  # the trunk stage read as the grid (resnet: layer1..layer4); None: the last
    grid: int | None = None  # pool the feature map down to grid x grid (never up); None keeps it
    trainable_stages: int = 1  # 0 frozen, k the last k stages (the rest is what a feature cache holds), -1 all
    channels_last: bool = False  # run the CNN in channels-last memory format (faster convolutions on GPUs)

    def check(self) -> None:
        if self.grid is not None:
            check_range("grid", self.grid, 1, kind=int)
        check_range("trainable_stages", self.trainable_stages, -1, kind=int)


@dataclass
class SelfAttentionConfig(Settings):
    """Transformer-style self-attention blocks over the grid, before the decoder reads it."""

    blocks: int = 0  # 0: none
    heads: int = 1
    positional: Positional = Positional.none  # where locations are (bundles' old true/false: absolute/none)
    # relative: row and column offsets beyond this many cells share their table's last vector, so each
    # block learns 2 * max_distance + 1 vectors per axis, for keys and for values, per head
    max_distance: int = 4

    def check(self) -> None:
        check_range("blocks", self.blocks, 0, kind=int)
        check_range("heads", self.heads, 1, kind=int)
        check_range("max_distance", self.max_distance, 1, kind=int)


@dataclass
class DecoderConfig(Settings):
    """The LSTM decoder of Show, Attend and Tell (sizes are the demo's; the paper's are 512/1800/512)."""

    embed_dim: int = 128  # word embedding E (m)
    hidden_dim: int = 256  # LSTM state (n)
    # The scorer's hidden size. The demo's 64 spends a quarter less time per step than 128, where the
    # scorer's tanh over (captions, cells, attention_dim) is the largest cost, for as good attention.
    attention_dim: int = 64
    attention_heads: int = 1  # scorer=multihead only
    gate: Gate = Gate.scalar  # the gating scalar beta (4.2.1)
    deep_output: bool = True  # eq. 7; False: a plain linear layer on h_t
    dropout: float = 0.3  # before the output layer
    # Hard attention, training: each image reads the expected context instead of sampled locations with
    # this probability, drawn per image as the paper says (the authors' code drew it per minibatch).
    hard_expectation_prob: float = 0.5
    hard_inference: HardInference = HardInference.argmax
    hard_estimator: HardEstimator = HardEstimator.reinforce
    gumbel_tau: float = 1.0  # gumbel: the temperature at the start of training ...
    gumbel_tau_min: float = 0.5  # ... falling geometrically to this at the end

    def check(self) -> None:
        for name in ("embed_dim", "hidden_dim", "attention_dim", "attention_heads"):
            check_range(name, getattr(self, name), 1, kind=int)
        check_range("dropout", self.dropout, 0.0, 0.99)
        check_range("hard_expectation_prob", self.hard_expectation_prob, 0.0, 1.0)
        check_range("gumbel_tau", self.gumbel_tau, 1e-3)
        check_range("gumbel_tau_min", self.gumbel_tau_min, 1e-3, self.gumbel_tau)


@dataclass
class NetConfig(Settings):
    """The network: what ``build_captioner`` builds and a bundle stores."""

    attention: Attention = Attention.soft
    scorer: Scorer = Scorer.additive
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    feature_norm: bool = True  # standardise each grid channel (BatchNorm over B*L) before attention
    self_attention: SelfAttentionConfig = field(default_factory=SelfAttentionConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)

    def check(self) -> None:
        if self.attention == Attention.hard and self.scorer == Scorer.multihead:
            # Its expected context reads projected values, a sampled location would read a raw a_i.
            raise ConfigError(
                "scorer=multihead works with soft attention only: hard attention samples one "
                "annotation vector a_i, which multihead's projected context is not"
            )


@dataclass
class LossConfig(Settings):
    """The training loss of cross-entropy training (eq. 14; eq. 12 for hard attention)."""

    # Doubly stochastic regularisation (eq. 14). It pulls every cell's attention summed over the words
    # towards 1, so with fewer words than cells (the demo: ~10 words, 144 cells) it spreads each word's
    # attention out; the demo turns it off, the COCO recipes keep the paper's 1.
    ds_lambda: float = 0.0
    # REINFORCE (hard attention): a per-step reward with a baseline per step that starts at the first
    # batch's mean; the weight keeps its gradient on the attention of the order of the cross-entropy's.
    reinforce_reward: ReinforceReward = ReinforceReward.word
    reinforce_weight: float = 0.1
    entropy_weight: float = 0.002  # bonus on the entropy of the sampled locations' distribution
    baseline_decay: float = 0.9  # moving average of the baseline

    def check(self) -> None:
        for name in ("ds_lambda", "reinforce_weight", "entropy_weight"):
            check_range(name, getattr(self, name), 0.0)
        check_range("baseline_decay", self.baseline_decay, 0.0, 1.0)


@dataclass
class OptimizerConfig(Settings):
    """Adam (fused where the device has it)."""

    lr: float = 0.002  # the decoder (and self-attention)
    encoder_lr: float = 0.002  # the encoder's trained stages (the COCO recipes: 1e-4 for pretrained weights)
    weight_decay: float = 0.0

    def check(self) -> None:
        check_range("lr", self.lr, 1e-12)
        check_range("encoder_lr", self.encoder_lr, 0.0)
        check_range("weight_decay", self.weight_decay, 0.0)


@dataclass
class SchedulerConfig(Settings):
    """Linear warm-up, then the learning-rate schedule (stepped every optimiser step)."""

    name: Schedule = Schedule.cosine
    warmup_steps: int = 50
    step_size: int = 10  # step: epochs between decays
    gamma: float = 0.5  # step: the decay factor

    def check(self) -> None:
        check_range("warmup_steps", self.warmup_steps, 0, kind=int)
        check_range("step_size", self.step_size, 1, kind=int)
        check_range("gamma", self.gamma, 0.0, 1.0)


@dataclass
class DecodingConfig(Settings):
    """How captions are decoded: these defaults are validation's and test's (``model.decoding``);
    captioning (``Captioner.generate``, ``caption()``, the CLI's flags) starts from ``captioning()``, the
    same settings with ``CAPTIONING_METHOD``. ``captioner.model.decoding`` takes one, checked here."""

    # greedy for validation and test (one decode per epoch, fast); captioning: CAPTIONING_METHOD
    method: DecodeMethod = DecodeMethod.greedy
    beam_size: int = 3
    max_len: int = MAX_LEN  # words at most, <end> excluded
    length_penalty: float = 0.0  # beam: score / length ** length_penalty
    temperature: float = 1.0  # sample: softmax(logits / temperature)
    min_len: int = 0  # no <end> before this many words (0: off)
    no_repeat_ngram_size: int = 0  # no n-gram of this many words twice in a caption (0: off)

    @classmethod
    def captioning(cls, **settings: Any) -> DecodingConfig:
        """Captioning's settings: ``method=CAPTIONING_METHOD``, then ``settings`` (field names) over them.

        TypeError for a name that is no field (as for any unknown keyword), ConfigError naming a bad value.
        """
        return cls(**{"method": CAPTIONING_METHOD, **settings})

    def check(self) -> None:
        check_range("beam_size", self.beam_size, 1, kind=int)
        check_range("max_len", self.max_len, 1, kind=int)
        check_range("length_penalty", self.length_penalty, 0.0)
        check_range("temperature", self.temperature, 1e-6)
        check_range("min_len", self.min_len, 0, kind=int)
        check_range("no_repeat_ngram_size", self.no_repeat_ngram_size, 0, kind=int)
        if self.min_len >= self.max_len:
            raise ConfigError(f"min_len={self.min_len} must be < max_len={self.max_len}")


# How captioning decodes by default (validation and test: DecodingConfig.method): beam search finds better
# captions than greedy decoding, for a cost paid once per image rather than every epoch.
CAPTIONING_METHOD = DecodeMethod.beam
CAPTIONING_BATCH_SIZE = 32  # images encoded and decoded together (caption(), `captioner caption --batch-size`)


@dataclass
class ScstConfig(Settings):
    """Self-critical sequence training (objective=scst): CIDEr-D of sampled captions as the reward."""

    samples: int = 5  # captions sampled per image, all images and samples at once
    baseline: ScstBaseline = ScstBaseline.mean
    # Cross-entropy epochs before self-critical training starts, in the same run (SCST improves a model
    # trained with cross-entropy); 0: self-critical from the first step, of the model of ckpt_path/init_from.
    after_epochs: int = 5
    # after_epochs > 0: when SCST takes over, the learning-rate schedule starts again (warm-up excepted) from
    # the optimizer's rates times this.
    lr_scale: float = 0.1

    def check(self) -> None:
        check_range("samples", self.samples, 1, kind=int)
        check_range("after_epochs", self.after_epochs, 0, kind=int)
        check_range("lr_scale", self.lr_scale, 1e-6)
        if self.baseline == ScstBaseline.mean and self.samples < 2:
            raise ConfigError(
                f"samples={self.samples}: baseline=mean compares each sample with the image's "
                "other samples, so it needs samples >= 2"
            )


@dataclass
class ModelConfig(NetConfig):
    """The ``model`` config group: the network and how it is trained and evaluated."""

    _target_: str = "captioner.training.module.CaptionerModule"
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    # torch.compile the decoder's step (one LSTM step, reused for every word of training and decoding): a
    # Compile choice (off, default, reduce-overhead, max-autotune; true/false read as default/off; typed
    # Any for Hydra, which reads `off` as false and knows no enum value with a hyphen); on, training pads
    # its captions to data.max_len + 2 tokens. None: reduce-overhead on CUDA, off elsewhere.
    compile: Any = None
    # Decoding (captions and SCST samples) runs all max_len steps with finished captions masked, no early exit
    # and no host read inside the loop: the same shapes on every call, what a captured CUDA graph needs, for
    # the same captions. None: on CUDA only; on a CPU stopping once every caption has ended is cheaper
    # (demo-size decoder, ~10-word captions of max_len 20: static takes 1.55-2.1x the time of greedy and
    # beam 3/5 at batch 125 and 1).
    static_shapes: bool | None = None
    nonfinite: NonFinite = NonFinite.stop
    # Training steps between host reads of the losses (also before every checkpoint and at each epoch
    # end); 1 reads every step, a GPU stall each time.
    nonfinite_check_interval: int = 50
    # Only an experiment switches to SCST: the demo's (cross-entropy for scst.after_epochs epochs, then SCST),
    # demo_scst and coco_scst (which fine-tune a cross-entropy run's model).
    objective: Objective = Objective.cross_entropy
    scst: ScstConfig = field(default_factory=ScstConfig)

    def __post_init__(self) -> None:
        if self.compile is not None:
            self.compile = _convert(Compile, self.compile, "compile")
        super().__post_init__()

    def check(self) -> None:
        super().check()
        check_range("nonfinite_check_interval", self.nonfinite_check_interval, 1, kind=int)

    def net(self) -> NetConfig:
        """The network part (what a bundle stores)."""
        return NetConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(NetConfig)})


@dataclass
class DataConfig(Settings):
    """The ``data`` config group: the dataset source, batching and preprocessing (``CaptionDataModule``)."""

    _target_: str = "captioner.training.datamodule.CaptionDataModule"
    source: Any = None  # the dataset: a ``_target_`` mapping of captioner.data.sources (built by Hydra)
    image_size: int = 224  # images are resized to image_size x image_size
    batch_size: int = 32  # training images (or captions with per_caption) per step and process
    eval_batch_size: int | None = 64  # validation/test images per step; None: batch_size
    # DataLoader worker processes; None: one per CPU this process may use, less one for the main process,
    # at most MAX_AUTO_WORKERS (``workers``)
    num_workers: int | None = None
    min_word_count: int = 5  # words seen fewer times in the training captions become <unk>
    max_vocab: int | None = 10000  # keep at most this many words (most frequent first); None: all
    max_len: int = MAX_LEN  # longer training captions are cut to this many words
    per_caption: bool = False  # one item per (image, caption); the CNN then runs once per caption
    augment: bool = False  # mild colour jitter / crop; never flips (captions say left and right)
    feature_cache: str | None = None  # a folder: cache the encoder's frozen stages' output there
    feature_dtype: FeatureDtype = FeatureDtype.float16  # the cache's dtype
    vocab_file: str | None = None  # load this vocabulary JSON instead of building one from the captions
    # Training captions padded to this many tokens (<start> and <end> included, so max_len + 2 holds every
    # caption) instead of the batch's longest: every step has the same shapes, what a captured CUDA graph
    # needs; the loss is unchanged (pad steps are masked). None: the batch's longest (fewer steps on a CPU), or
    # max_len + 2 when model.compile is on.
    pad_to: int | None = None
    # Where the recipe that trains on this dataset is: the demo's recipe (``demo``) on any dataset but the
    # built-in shapes (``recipe: null``) stops at once, naming it.
    recipe: str | None = "experiment=coco_soft"

    def check(self) -> None:
        check_range("image_size", self.image_size, 32, kind=int)
        check_range("batch_size", self.batch_size, 1, kind=int)
        if self.eval_batch_size is not None:
            check_range("eval_batch_size", self.eval_batch_size, 1, kind=int)
        if self.num_workers is not None:
            check_range("num_workers", self.num_workers, 0, kind=int)
        check_range("min_word_count", self.min_word_count, 1, kind=int)
        if self.max_vocab is not None:
            check_range("max_vocab", self.max_vocab, 4, kind=int)
        check_range("max_len", self.max_len, 1, kind=int)
        if self.pad_to is not None:
            check_range("pad_to", self.pad_to, self.max_len + 2, kind=int)

    @property
    def workers(self) -> int:
        """``num_workers``, or when None the CPUs this process may use less one (the main process), at most
        ``MAX_AUTO_WORKERS``."""
        if self.num_workers is not None:
            return self.num_workers
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(0, min(cpus - 1, MAX_AUTO_WORKERS))


# ------------------------------------------------------------------------------------------------ building
def _convert(kind: Any, value: Any, key: str) -> Any:
    """``value`` as the annotated type ``kind`` (a dataclass from a mapping, an enum from its name)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        kind = next(k for k in options if k is not type(None))
    if dataclasses.is_dataclass(kind):
        return from_dict(kind, {} if value is None else value, key)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        if isinstance(value, kind):
            return value
        if value in kind.__members__:
            return kind[value]
        try:  # by value (reduce-overhead), or an old spelling the enum reads (true/false)
            return kind(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(kind)}") from None
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} must be a string")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def from_dict(cls: type[T], values: Mapping[str, Any] | T, where: str = "") -> T:
    """Build the settings dataclass ``cls`` from a (nested) mapping, or return an instance as it is.

    Missing keys take their defaults. ConfigError for a key ``cls`` has no field for, a value of the
    wrong type or choice, or one out of range; the message names the key under ``where``
    (``from_dict(ModelConfig, cfg, "model")`` -> ``model.decoder.dropout=1.5 must be in [0.0, 0.99]``).
    """
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where or cls.__name__} must be a mapping, got {values!r}")
    prefix = f"{where}." if where else ""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in values if key not in fields]
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]} is not a known key; valid keys: {', '.join(f for f in fields if f != '_target_')}"
        )
    kwargs = {key: _convert(hints[key], value, f"{prefix}{key}") for key, value in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}") from None


def to_dict(settings: Any) -> dict[str, Any]:
    """A settings dataclass as plain data (enums as their names): what YAML, checkpoints and bundles hold."""
    return dataclasses.asdict(settings, dict_factory=_plain_items)


def _plain_items(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: (value.value if isinstance(value, enum.Enum) else value) for key, value in items}


@dataclass
class TrainConfig(Settings):
    """The whole training config (``conf/config.yaml``): the run's own keys and every group's section."""

    task_name: str = "train"  # names the run folders: outputs/<task_name>/runs/<date>
    seed: int = 0  # seeds Python, NumPy and torch in every process and worker
    # Resume a run: a run folder (its checkpoints/last.ckpt) or a .ckpt file; SCST also starts from a
    # cross-entropy run or bundle here (see conf/config.yaml).
    ckpt_path: str | None = None
    init_from: str | None = None  # start a new run from this run folder's, checkpoint's or bundle's model
    train: bool = True  # False: only validate (and test) the checkpoint in ckpt_path
    test: bool = True  # evaluate the best checkpoint on the test split after training
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: Any = None  # lightning.Trainer's arguments (conf/trainer)
    callbacks: Any = None  # name -> a Lightning callback (conf/callbacks)
    logger: Any = None  # name -> a Lightning logger (conf/logger)
    paths: Any = None  # where data, caches and outputs go (conf/paths)
    demo: bool = False  # set by experiment=demo (and demo_scst): a recipe for the built-in shapes only

    def check(self) -> None:
        check_range("seed", self.seed, 0, 2**32 - 1, kind=int)
        if self.demo and self.data.recipe is not None:
            raise ConfigError(
                "the demo's recipe (a small model with random weights, SCST after a few epochs) is for the "
                f"built-in shapes; for this dataset train with {self.data.recipe}"
            )


# The schemas of the configs: train.py stores each as <name>_schema.
SCHEMAS: dict[str, type] = {"train": TrainConfig, "model": ModelConfig, "data": DataConfig}
