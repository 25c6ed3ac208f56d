"""The whole training config (``conf/config.yaml``) and the schemas of the configs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from captioner.config.data import DataConfig
from captioner.config.model import ModelConfig
from captioner.config.settings import Settings
from captioner.errors import ConfigError, check_range


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


# The schemas of the configs: captioner.training.schemas stores each as <name>_schema.
SCHEMAS: dict[str, type] = {"train": TrainConfig, "model": ModelConfig, "data": DataConfig}
