"""The ``model`` config group: the network and how it is trained and evaluated."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from captioner.config.decoding import DecodingConfig
from captioner.config.network import Attention, EncoderConfig, HardEstimator, NetConfig, Scorer
from captioner.config.settings import Settings, _convert
from captioner.errors import ConfigError, check_range


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


# The Compile modes that replay the compiled step as CUDA graphs, one word at a time: they cannot run inside
# model.graphs' capture of a whole call.
PER_WORD_GRAPHS = frozenset({Compile.reduce_overhead, Compile.max_autotune})


class ReinforceReward(enum.StrEnum):
    """The per-step reward of REINFORCE."""

    word = "word"  # log p of word t
    suffix = "suffix"  # log p of words t..end


class Schedule(enum.StrEnum):
    """The learning-rate schedule after warm-up."""

    cosine = "cosine"
    step = "step"
    none = "none"


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
class TrainingEncoderConfig(EncoderConfig):
    """The encoder of a run: the network's settings (``EncoderConfig``, what a bundle stores) and how its ImageNet
    weights reach this machine."""

    # A weights file missing from $TORCH_HOME/hub/checkpoints is downloaded as torchvision does (its progress bar and
    # hash check) before training starts, by one process of a machine at a time (captioner.model.pretrained); false:
    # never (an offline machine: the preflight names the file to put there).
    download: bool = True

    def network(self) -> EncoderConfig:
        """The network's settings: these but ``download``."""
        return EncoderConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EncoderConfig)})


@dataclass
class ModelConfig(NetConfig):
    """The ``model`` config group: the network and how it is trained and evaluated."""

    encoder: TrainingEncoderConfig = field(default_factory=TrainingEncoderConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    # torch.compile the decoder's step (one LSTM step, reused for every word of training and decoding): a
    # Compile choice (off, default, reduce-overhead, max-autotune; true/false read as default/off; typed
    # Any for Hydra, which reads `off` as false and knows no enum value with a hyphen); on, training pads
    # its captions to data.max_len + 2 tokens. None: off (on CUDA the step is already inside `graphs`' graph;
    # reduce-overhead graphs each word, and needs graphs=false).
    compile: Any = None
    # CUDA graphs of whole calls (captioner.model.graphs): each cross-entropy training step's forward, loss and
    # backward is one replay (training.graphed), each SCST step two (the rollout and greedy baseline, then the
    # loss's backward, CIDEr-D scored between them; static_shapes=false keeps them eager), and so is each decoding
    # call (every word of greedy, sampling, beam search). Training pads its captions to data.max_len + 2 tokens;
    # 16-mixed and gradient accumulation train eagerly. None: on CUDA, off elsewhere (true elsewhere is refused:
    # graphs need a CUDA device).
    graphs: bool | None = None
    # scorer=additive only: the attention read (eq. 4-5 and the context) as its own torch.compile'd (inductor)
    # function, separate from `compile`'s whole step: the (captions, cells, attention_dim) tanh energies and their
    # backward in fused kernels, inside `graphs`' captured training steps and decoding calls as well. Off by
    # default: each grad mode and shape kind compiles first (seconds on a CPU); docs/performance.md ("The fused
    # attention read") has its figures. How the run computes, not what the network is: a bundle does not keep it.
    fused_attention: bool = False
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
    # Hard attention with a warm-up (decoder.hard_expectation_warmup): whether a validation inside it may give
    # the best checkpoint and count for early stopping. False: the best checkpoint and early stopping's
    # patience start once the warm-up is over (a model that still reads the expected context for most images
    # is not the hard attention model the run trains; last.ckpt is written all the same).
    select_in_warmup: bool = False

    def __post_init__(self) -> None:
        if self.compile is not None:
            self.compile = _convert(Compile, self.compile, "compile")
        super().__post_init__()

    def check(self) -> None:
        super().check()
        check_range("nonfinite_check_interval", self.nonfinite_check_interval, 1, kind=int)
        if self.graphs and self.compile in PER_WORD_GRAPHS:
            raise ConfigError(
                f"graphs=true captures whole steps as CUDA graphs and compile={self.compile} graphs each word inside "
                "them, which CUDA cannot nest: set model.graphs=false for per-word graphs"
            )
        if self.fused_attention and self.scorer != Scorer.additive:
            raise ConfigError(f"fused_attention=true needs scorer=additive (got scorer={self.scorer})")

    def uses_graphs(self, cuda: bool) -> bool:
        """Whether ``graphs`` is on for a run on a CUDA device (``cuda``) or not: unset, on CUDA unless ``compile``
        graphs each word itself; a ConfigError where it is asked for without CUDA."""
        if self.graphs is None:
            return cuda and self.compile not in PER_WORD_GRAPHS
        if self.graphs and not cuda:
            raise ConfigError(
                "model.graphs=true: CUDA graphs need a CUDA device (trainer=gpu), or set model.graphs=null"
            )
        return self.graphs

    def net(self) -> NetConfig:
        """The network part (what a bundle stores)."""
        network = {f.name: getattr(self, f.name) for f in dataclasses.fields(NetConfig)}
        return NetConfig(**{**network, "encoder": self.encoder.network()})

    def unscheduled(self, max_epochs: int | None, max_steps: int | None) -> str | None:
        """Why the run's schedules cannot be laid out over a run of the trainer's ``max_epochs`` (None: null, -1:
        no limit) and ``max_steps`` (None or -1: no limit), in one line naming the settings; None when they can.

        Hard attention's expected-context warm-up and its Gumbel temperature are fractions of cross-entropy
        training, the learning-rate schedule of the run: a run without a known end (Lightning reads
        max_epochs=null as 1000 epochs, or as no limit with max_time) has none to take a fraction of.
        """
        if max_epochs not in (None, -1) or max_steps not in (None, -1):
            return None
        open_phase = self.objective == Objective.cross_entropy  # objective=scst: scst.after_epochs bounds it
        decoder = self.decoder
        hard = self.attention == Attention.hard
        needs = []
        if open_phase and hard and (warmup := decoder.hard_expectation_warmup) > 0:
            needs.append(f"model.decoder.hard_expectation_warmup={warmup} (a fraction of cross-entropy training)")
        if open_phase and hard and decoder.hard_estimator == HardEstimator.gumbel:
            needs.append("model.decoder.gumbel_tau's fall to gumbel_tau_min (over cross-entropy training)")
        if self.scheduler.name != Schedule.none:
            needs.append(f"model.scheduler.name={self.scheduler.name} (over the run's steps)")
        elif self.objective == Objective.scst and self.scst.after_epochs > 0:
            needs.append(f"model.scst.lr_scale={self.scst.lr_scale} (from epoch model.scst.after_epochs on)")
        if not needs:
            return None
        limit = "null" if max_epochs is None else max_epochs
        return (
            f"trainer.max_epochs={limit} with no trainer.max_steps gives the run no known length, which "
            f"{' and '.join(needs)} needs: set trainer.max_epochs or trainer.max_steps"
        )
