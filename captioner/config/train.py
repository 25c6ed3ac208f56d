"""The whole training config (``conf/config.yaml``) and the schemas of the configs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from captioner.config.data import DataConfig
from captioner.config.model import ModelConfig
from captioner.config.settings import Settings
from captioner.errors import ConfigError, check_range


class InitVocab(enum.StrEnum):
    """The vocabulary of a new run started from another's model (``init_from``)."""

    keep = "keep"  # the model's: a training word it lacks reads as <unk>
    grow = "grow"  # the model's words in their order, then the training words it lacks (``Vocabulary.grow``)


@dataclass
class TrainConfig(Settings):
    """The whole training config (``conf/config.yaml``): the run's own keys and every group's section."""

    task_name: str = "train"  # names the run folders: outputs/<task_name>/runs/<date>
    seed: int = 0  # seeds Python, NumPy and torch in every process and worker
    # Resume after a crash or a stop: a run folder (its checkpoints/last.ckpt, rewritten atomically after every
    # validation and every callbacks.last_checkpoint.every_n_train_steps steps) or a .ckpt file. Epoch, global
    # step, optimiser state, learning-rate schedule and callbacks continue from it (with a larger
    # trainer.max_epochs or max_steps the rate goes on from where it stopped and decays over the new length:
    # training.schedule.LearningRatePlan); the resumed run writes into a new run folder and never changes the old
    # one. A run stopped mid-epoch finishes that epoch's remaining steps in a freshly shuffled order. The model
    # (architecture, vocabulary, image size) is the checkpoint's.
    # Only a run of the same model.objective is resumed: a checkpoint of the other objective (a cross-entropy
    # run given to experiment=demo_scst) is taken as init_from, and so is a bundle.pt by a run whose SCST starts
    # at once (model.scst.after_epochs=0); the run's config then says init_from.
    ckpt_path: str | None = None
    # Start a NEW run from the model of another: a run folder (its bundle.pt, the checkpoint it selected), a
    # .ckpt or a bundle.pt. Its architecture, vocabulary (grown with init_vocab=grow), image size and weights are
    # used with this config's training settings; epoch, optimiser and schedule start afresh.
    init_from: str | None = None
    # The vocabulary of the run init_from starts: keep (the model's; the share of training words it lacks, read
    # as <unk>, is logged when training starts) or grow (the model's words in their order and ids, then the
    # training words it lacks that data.min_word_count and data.max_vocab admit; a shared word keeps its trained
    # embedding and output row, a new word starts from the new model's initialisation).
    init_vocab: InitVocab = InitVocab.keep
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
        if self.init_vocab is InitVocab.grow and self.init_from is None and self.ckpt_path is None:
            raise ConfigError(
                "init_vocab=grow grows the vocabulary of the model a new run starts from: give init_from=<a run "
                "folder, its checkpoint or bundle.pt> (without one the vocabulary is built from the training captions)"
            )
        if self.demo and self.data.recipe is not None:
            raise ConfigError(
                "the demo's recipe (a small model with random weights, SCST after a few epochs) is for the "
                f"built-in shapes; for this dataset train with {self.data.recipe}"
            )


@dataclass
class SamplesConfig(Settings):
    """What ``callbacks.samples`` (``captioner.training.samples.TrainingPictures``) draws after each validation."""

    count: int = 4  # validation images captioned and attended after every validation, picked once for the run

    def check(self) -> None:
        check_range("callbacks.samples.count", self.count, 1, 32, kind=int)


# The schemas of the configs: captioner.training.schemas stores each as <name>_schema.
SCHEMAS: dict[str, type] = {"train": TrainConfig, "model": ModelConfig, "data": DataConfig}
