"""The network's settings: what ``build_captioner`` builds and a bundle stores."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from captioner.config.settings import Settings
from captioner.errors import ConfigError, check_range

# Upper bounds of the sizes a config (and so a bundle, which may come from anyone) can set, far above any model
# this project trains (the paper's widest layer is 1,800): a bundle never makes its reader allocate without end.
MAX_WIDTH = 8192  # embed_dim, hidden_dim, attention_dim
MAX_COUNT = 64  # attention heads, self-attention heads and blocks, trainable encoder stages
MAX_CELLS = 256  # a grid side (encoder.grid) and a relative-position clipping distance (max_distance)
# The weights and buffers a network holds at most (its state dict, a bundle's tensors): the largest torchvision CNN
# (regnet_y_128gf, 2.6 GB) with a decoder of the paper's widths over 100,000 words fits; the widths above allow
# far more (an 8192-wide embedding of a million words alone is 32 GB), so a model is bounded by this too.
MAX_MODEL_BYTES = 4 * 2**30
MAX_TAU = 100.0  # gumbel_tau: softmax(logits / 100) is all but uniform already


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

    def describe(self) -> str:
        """What is read, in words, with the setting's value: what a reported figure says it used."""
        read = "the most likely location" if self == HardInference.argmax else "the expected context"
        return f"hard attention reading {read} ({self.value})"


class HardEstimator(enum.StrEnum):
    """How hard attention's location choice is trained."""

    reinforce = "reinforce"  # the paper's eq. 12 (with a per-step reward and baseline)
    gumbel = "gumbel"  # straight-through Gumbel-softmax over the locations


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
            check_range("grid", self.grid, 1, MAX_CELLS, kind=int)
        check_range("trainable_stages", self.trainable_stages, -1, MAX_COUNT, kind=int)


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
        check_range("blocks", self.blocks, 0, MAX_COUNT, kind=int)
        check_range("heads", self.heads, 1, MAX_COUNT, kind=int)
        check_range("max_distance", self.max_distance, 1, MAX_CELLS, kind=int)


@dataclass
class DecoderConfig(Settings):
    """The LSTM decoder of Show, Attend and Tell (sizes are the demo's; the paper's are 512/1800/512)."""

    embed_dim: int = 128  # word embedding E (m)
    hidden_dim: int = 256  # LSTM state (n)
    # The scorer's hidden size. Its tanh over (captions, cells, attention_dim) is the largest cost of a demo
    # decoder step, so the demo keeps it small.
    attention_dim: int = 64
    attention_heads: int = 1  # scorer=multihead only
    gate: Gate = Gate.scalar  # the gating scalar beta (4.2.1)
    deep_output: bool = True  # eq. 7; False: a plain linear layer on h_t
    dropout: float = 0.3  # before the output layer
    # Hard attention, training: each image reads the expected context instead of sampled locations with
    # this probability, drawn per image as the paper says (the authors' code drew it per minibatch).
    hard_expectation_prob: float = 0.5
    # ... after this fraction of training; before, that share falls linearly from 1 (every image reads the
    # expected context, as soft attention) to hard_expectation_prob. Sampled locations only teach once the
    # attention finds the objects: on the scenes benchmark's 16x16 grid, sampling from the first step leaves
    # a spread alpha whose samples are background and a decoder that ignores what it reads
    # (docs/hard_attention.md). 0: the mix from the first step.
    hard_expectation_warmup: float = 0.5
    hard_inference: HardInference = HardInference.argmax
    hard_estimator: HardEstimator = HardEstimator.reinforce
    gumbel_tau: float = 1.0  # gumbel: the temperature at the start of training ...
    gumbel_tau_min: float = 0.5  # ... falling geometrically to this at the end

    def check(self) -> None:
        for name in ("embed_dim", "hidden_dim", "attention_dim"):
            check_range(name, getattr(self, name), 1, MAX_WIDTH, kind=int)
        check_range("attention_heads", self.attention_heads, 1, MAX_COUNT, kind=int)
        check_range("dropout", self.dropout, 0.0, 0.99)
        check_range("hard_expectation_prob", self.hard_expectation_prob, 0.0, 1.0)
        check_range("hard_expectation_warmup", self.hard_expectation_warmup, 0.0, 1.0)
        check_range("gumbel_tau", self.gumbel_tau, 1e-3, MAX_TAU)
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
        if self.decoder.attention_heads != 1 and self.scorer != Scorer.multihead:
            raise ConfigError(
                f"decoder.attention_heads={self.decoder.attention_heads} needs scorer=multihead (got {self.scorer})"
            )

    def without_pretrained(self) -> NetConfig:
        """These settings with no pretrained encoder weights to read: the network of a model whose weights all come
        from a file of its own (a bundle, a checkpoint), which builds without the ImageNet weights' file."""
        return replace(self, encoder=replace(self.encoder, weights=None))


# The settings that make a trained network what it is (its layers, their sizes, what its weights were trained to
# read), as dotted keys of NetConfig: a run that starts from a checkpoint (init_from, ckpt_path) takes these from
# it. Every other one (dropout, which stages train, the hard-attention estimator and its schedule, what hard
# attention reads at inference) is how a run trains or reads the network: the run's config's.
ARCHITECTURE = (
    "attention",
    "scorer",
    "encoder.name",
    "encoder.weights",
    "encoder.stage",
    "encoder.grid",
    "feature_norm",
    "self_attention.blocks",
    "self_attention.heads",
    "self_attention.positional",
    "self_attention.max_distance",
    "decoder.embed_dim",
    "decoder.hidden_dim",
    "decoder.attention_dim",
    "decoder.attention_heads",
    "decoder.gate",
    "decoder.deep_output",
)
