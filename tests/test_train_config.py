"""train.py + conf/: every experiment and every option of a config group composes, validates and instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from captioner.training.validate import check_arguments, validate_config
from conftest import CONF, compose_cfg, compose_plain

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_validates_and_instantiates(experiment: str, tmp_path: Path) -> None:
    # The ImageNet weight file cannot be downloaded here; the offline message is tested in test_encoder.
    cfg = compose_cfg([f"experiment={experiment}", "model.encoder.weights=null"], tmp_path)
    plain = OmegaConf.to_container(cfg, resolve=True)
    settings = validate_config(plain)
    check_arguments(plain)  # the names and types of the trainer's, callbacks' and loggers' arguments
    from captioner.data.vocab import Vocabulary
    from captioner.training.datamodule import CaptionDataModule
    from captioner.training.module import CaptionerModule

    datamodule = CaptionDataModule(instantiate(cfg.data.source), settings.data)
    assert datamodule.settings.batch_size == cfg.data.batch_size
    vocab = Vocabulary([f"w{i}" for i in range(20)])
    module = CaptionerModule(vocab, settings.model)
    assert module.net.attention == cfg.model.attention
    if cfg.trainer.accelerator == "cpu":
        assert instantiate(cfg.trainer).max_epochs == cfg.trainer.max_epochs


@pytest.mark.parametrize(
    "group,options",
    [
        ("data", ["shapes"]),  # the others with their experiments: test_config's bare-dataset test
        ("model", ["soft", "hard"]),
        ("trainer", ["cpu", "gpu", "ddp", "ddp_cpu", "multi_node"]),
        ("logger", ["csv", "tensorboard", "wandb", "mlflow", "none"]),
    ],
)
def test_every_group_option_composes_and_validates(group: str, options: list[str], tmp_path: Path) -> None:
    for option in options:
        plain = compose_plain([f"{group}={option}"], tmp_path)
        validate_config(plain)
        check_arguments(plain)
