"""Checks of a composed training config before any work starts: every value (validate_config) and what
it refers to on this machine (check_environment)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import CompactHydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import train
from captioner.data.sources import ShapesSource
from captioner.errors import ConfigError
from captioner.training.validate import check_environment, error_line, section_error, validate_config
from conftest import ROOT, compose_cfg, compose_plain


def config_error(overrides: list[str], tmp_path: Path) -> str:
    """The one-line error train.py reports for ``overrides`` before any data work: Hydra's composition
    (schemas), ``validate_config``, then building the dataset source and the trainer with its callbacks and
    loggers (Lightning checks its own arguments)."""
    try:
        cfg = compose_cfg(overrides, tmp_path)
    except (CompactHydraException, OmegaConfBaseException) as exc:
        return error_line(exc)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    with pytest.raises(ConfigError) as info:  # noqa: PT012  the checks train.py runs, in its order
        validate_config(plain)
        train.build("data.source", plain["data"]["source"])
        train.build_trainer(plain)
    return str(info.value)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.scorer=luong", "model.scorer='luong' is not valid; choose one of: additive, dot, scaled_dot"),
        ("model.decoding.beam_size=0", "model.decoding.beam_size=0 must be >= 1"),
        ("model.decoding.min_len=20", "model.decoding.min_len=20 must be < max_len=20"),
        ("model.decoding.no_repeat_ngram_size=-2", "model.decoding.no_repeat_ngram_size=-2 must be >= 0"),
        ("model.nonfinite_check_interval=0", "model.nonfinite_check_interval=0 must be >= 1"),
        ("model.attention=medium", "model.attention='medium' is not valid; choose one of: soft, hard"),
        ("model.decoder.embed_dim=big", "model.decoder.embed_dim='big' must be int"),
        ("data.batch_size=-3", "data.batch_size=-3 must be >= 1"),
        ("model.decoder.dropout=1.5", "model.decoder.dropout=1.5 must be in [0.0, 0.99]"),
        ("+model.decoder.hiden_dim=3", "model.decoder.hiden_dim is not a known key; valid keys: embed_dim"),
        ("model.foo=1", "model.foo is not a known key; valid keys: attention, scorer"),
        ("trainer.devices=abc", "trainer: `devices` selected with `CPUAccelerator` should be an int > 0"),
        ("trainer.devices=0", "trainer: `Trainer(devices=0)` value is not a valid input"),
        ("trainer.max_epochs=0", "trainer.max_epochs=0 must be >= 1"),
        ("trainer.precision=17", "trainer: Precision 17 is invalid. Allowed precision values:"),
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1 must be >= 0.0"),
        ("+trainer.strategy=ddpp", "trainer: You selected an invalid strategy name: `strategy='ddpp'`"),
        ("trainer.min_epochs=5000", "trainer.min_epochs=5000 must be <= trainer.max_epochs="),
        ("+trainer.max_epoch=3", "trainer: Trainer.__init__() got an unexpected keyword argument 'max_epoch'"),
        ("+trainer.logger=false", "trainer.logger is passed by train.py itself"),
        (
            "callbacks.last_checkpoint.every_n_train_steps=-5",
            "callbacks.last_checkpoint: Invalid value for every_n_train_steps=-5. Must be >= 0",
        ),
        ("callbacks.early_stopping.monitor=val/bleu5", "callbacks.early_stopping.monitor='val/bleu5' is not valid"),
        (
            "callbacks.model_checkpoint.mode=maximum",
            "callbacks.model_checkpoint: `mode` can be min, max but got maximum",
        ),
        (
            "+callbacks.model_checkpoint.save_best=true",
            "callbacks.model_checkpoint: ModelCheckpoint.__init__() got an unexpected keyword argument 'save_best'",
        ),
        (
            "logger.csv._target_=lightning.CSVLoger",
            "logger.csv: Error loading 'lightning.CSVLoger': ModuleNotFoundError",
        ),
        ("data.source.n_train=0", "data.source.n_train=0 must be >= 1"),
        ("+data.source.size=3", "data.source: ShapesSource.__init__() got an unexpected keyword argument 'size'"),
        ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
        ("+epochs=3", "epochs is not a known key; valid keys: task_name, seed"),
        ("train=maybe", "train='maybe' must be true or false"),
    ],
)
def test_every_config_value_is_checked(override: str, message: str, tmp_path: Path) -> None:
    assert config_error([override], tmp_path).startswith(message)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["experiment=coco_soft", "data=coco", "model.encoder.weights=null"],
            "data.source.splits.train.captions='{data}/coco/annotations/captions_train2014.json': file "
            "not found (see data/README.md",
        ),
        (
            ["experiment=flickr8k_soft", "model.encoder.weights=null"],
            "data.source.split_file='{data}/karpathy/dataset_flickr8k.json': file not found",
        ),
        (
            ["experiment=coco_soft", "model.encoder.weights=null", "data.source.split_file={tmp}"],
            "data.source.split_file='{tmp}' is not a file",
        ),
        (["data.vocab_file={tmp}/vocab.json"], "data.vocab_file='{tmp}/vocab.json': file not found"),
        (["data.source.root={tmp}/file.txt"], "data.source.root='{tmp}/file.txt' is a file, not a folder"),
    ],
)
def test_missing_files_are_reported_with_their_key_before_any_work(
    overrides: list[str], message: str, tmp_path: Path
) -> None:
    (tmp_path / "file.txt").write_text("x")
    cfg = compose_cfg([o.format(tmp=tmp_path) for o in overrides], tmp_path)
    plain = OmegaConf.to_container(cfg, resolve=True)
    with pytest.raises(ConfigError) as info:  # noqa: PT012  the checks train.py runs, in its order
        validate_config(plain)
        check_environment(plain, train.build("data.source", plain["data"]["source"]))
    assert message.format(tmp=tmp_path, data=ROOT / "data") in str(info.value)


def test_a_logger_whose_package_is_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = compose_plain(["logger=wandb"], tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(
        ConfigError,
        match=r"logger.wandb needs the wandb package, which is not installed: "
        r'pip install -e "\.\[wandb\]"',
    ):
        check_environment(plain, ShapesSource(str(tmp_path / "shapes")))


def test_scst_settings_are_checked(tmp_path: Path) -> None:
    cfg = compose_plain(["experiment=demo_scst"], tmp_path)
    scst = {"samples": 5, "baseline": "mean", "after_epochs": 0, "lr_scale": 0.1}
    assert cfg["model"]["objective"] == "scst" and cfg["model"]["scst"] == scst
    assert cfg["callbacks"]["model_checkpoint"]["monitor"] == "val/cider"
    assert cfg["callbacks"]["early_stopping"]["monitor"] == "val/cider"
    validate_config(cfg)
    for key, value, message in [
        ("samples", 1, "model.scst.samples=1: baseline=mean compares each sample"),
        ("baseline", "best", "model.scst.baseline='best' is not valid"),
        ("samples", 0, "model.scst.samples=0 must be >= 1"),
        ("after_epochs", -1, "model.scst.after_epochs=-1 must be >= 0"),
        ("lr_scale", 0.0, "model.scst.lr_scale=0.0 must be >= 1e-06"),
    ]:
        bad = {**cfg, "model": {**cfg["model"], "scst": {**cfg["model"]["scst"], key: value}}}
        with pytest.raises(ConfigError, match=message):
            validate_config(bad)
    validate_config({**cfg, "model": {**cfg["model"], "scst": {"samples": 1, "baseline": "greedy"}}})
    bad = {**cfg, "model": {**cfg["model"], "objective": "rl"}}
    with pytest.raises(ConfigError, match="model.objective='rl' is not valid; choose one of: cross_entropy, scst"):
        validate_config(bad)
    with pytest.raises(ConfigError, match="init_from='/no/such/run' does not exist"):
        check_environment({**cfg, "init_from": "/no/such/run"}, ShapesSource(str(tmp_path / "shapes")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_an_accelerator_this_machine_lacks_is_refused(tmp_path: Path) -> None:
    plain = compose_plain(["trainer=gpu"], tmp_path)
    validate_config(plain)  # a valid config, for another machine
    with pytest.raises(ConfigError) as info:
        check_environment(plain, ShapesSource(str(tmp_path / "shapes")))
    assert str(info.value) == (
        "trainer.accelerator='gpu' but this machine has no usable CUDA GPU; use trainer=cpu "
        "(or trainer.accelerator=cpu)"
    )


def test_a_missing_weight_file_names_the_key_model_encoder_weights(tmp_path: Path, monkeypatch) -> None:
    from captioner.data.vocab import Vocabulary
    from captioner.training.module import CaptionerModule

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no weight file there
    plain = compose_plain(["model.encoder.weights=IMAGENET1K_V1"], tmp_path)
    with pytest.raises(ConfigError) as info, train.building("model"):
        CaptionerModule(Vocabulary(["a"]), validate_config(plain).model)
    message = str(info.value)
    assert message.startswith("model.encoder.weights='IMAGENET1K_V1': the ImageNet weights of resnet18 are not on disk")
    assert f"save it as {tmp_path / 'hub' / 'checkpoints' / 'resnet18-f37072fd.pth'}" in message


def test_section_error_puts_the_section_in_front_of_a_key_only() -> None:
    inner = ConfigError("encoder.name='x' is not a torchvision classification model")
    assert str(section_error("model", inner, str(inner))) == f"model.{inner}"
    named = ConfigError("data.source.n_train=0 must be >= 1")
    assert str(section_error("data.source", named, str(named))) == str(named)
    prose = ConfigError("the split has no images")
    assert str(section_error("data", prose, str(prose))) == "data: the split has no images"
    typo = TypeError("f() got an unexpected keyword argument 'size'")
    assert str(section_error("data.source", typo, str(typo))) == f"data.source: {typo}"


def test_help_lists_only_groups_a_user_can_select() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    names = [line.split(":")[0] for line in groups.splitlines() if ": " in line]
    assert names == ["callbacks", "data", "debug", "experiment", "logger", "model", "paths", "trainer"]  # no schema
