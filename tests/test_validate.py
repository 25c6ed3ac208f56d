"""Checks of a composed training config before any work starts: every value (validate_config) and what
it refers to on this machine (check_environment)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from captioner.errors import ConfigError
from captioner.training.validate import check_environment, validate_config
from conftest import ROOT, compose_plain


@pytest.mark.parametrize("override,message", [
    ("model.scorer=luong", "model.scorer='luong' is not valid; choose one of: additive, dot, scaled_dot"),
    ("model.decoding.beam_size=0", "model.decoding.beam_size=0 must be >= 1"),
    ("model.decoding.min_len=20", "model.decoding.min_len=20 must be < model.decoding.max_len=20"),
    ("model.decoding.no_repeat_ngram_size=-2", "model.decoding.no_repeat_ngram_size=-2 must be >= 0"),
    ("model.nonfinite_check_interval=0", "model.nonfinite_check_interval=0 must be >= 1"),
    ("model.attention=medium", "choose one of: soft, hard"),
    ("data.batch_size=-3", "data.batch_size=-3 must be >= 1"),
    ("model.decoder.dropout=1.5", "model.decoder.dropout=1.5 must be in [0.0, 0.99]"),
    ("model.encoder.name=resnet1001", "model.encoder.name='resnet1001' is not a torchvision classification model"),
    ("+model.decoder.hiden_dim=3", "model.decoder.hiden_dim is not a known key; valid keys: embed_dim"),
    ("trainer.devices=abc", "trainer.devices='abc' is not valid; use a number of devices"),
    ("trainer.devices=0", "trainer.devices=0 is not valid"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0 must be >= 1"),
    ("trainer.precision=17", "trainer.precision='17' is not valid; choose one of: 32-true"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1 must be >= 0.0"),
    ("+trainer.strategy=ddpp", "trainer.strategy='ddpp' is not valid; choose one of: auto, ddp"),
    ("trainer.min_epochs=5000", "trainer.min_epochs=5000 must be <= trainer.max_epochs="),
    ("+trainer.max_epoch=3", "trainer.max_epoch is not an argument of Trainer; valid keys: accelerator"),
    ("+trainer.logger=false", "trainer.logger is passed by train.py itself"),
    ("callbacks.last_checkpoint.every_n_train_steps=-5",
     "callbacks.last_checkpoint.every_n_train_steps=-5 must be >= 0"),
    ("callbacks.early_stopping.monitor=val/bleu5", "callbacks.early_stopping.monitor='val/bleu5' is not valid"),
    ("callbacks.model_checkpoint.mode=maximum", "callbacks.model_checkpoint.mode='maximum' is not valid"),
    ("+callbacks.model_checkpoint.save_best=true", "callbacks.model_checkpoint.save_best is not an argument of "
                                                   "ModelCheckpoint"),
    ("logger.csv._target_=lightning.CSVLoger", "logger.csv._target_='lightning.CSVLoger' is not an importable class"),
    ("data.source.n_train=0", "data.source.n_train=0 must be >= 1"),
    ("+data.source.size=3", "data.source.size is not an argument of ShapesSource"),
    ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
    ("+epochs=3", "epochs is not a known key; valid top-level keys"),
    ("train=maybe", "train='maybe' must be true or false"),
])
def test_every_config_value_is_checked(override: str, message: str, tmp_path: Path) -> None:
    plain = compose_plain([override], tmp_path)
    with pytest.raises(ConfigError) as info:
        validate_config(plain)
    assert message in str(info.value)


@pytest.mark.parametrize("overrides,message", [
    (["data=coco"], "data.source.splits.train.captions='{data}/coco/annotations/captions_train2014.json': file "
                    "not found (see data/README.md"),
    (["data=flickr8k"], "data.source.split_file='{data}/karpathy/dataset_flickr8k.json': file not found"),
    (["data=coco_karpathy", "data.source.split_file={tmp}"], "data.source.split_file='{tmp}' is not a file"),
    (["data.vocab_file={tmp}/vocab.json"], "data.vocab_file='{tmp}/vocab.json': file not found"),
    (["data.source.root={tmp}/file.txt"], "data.source.root='{tmp}/file.txt' is a file, not a folder"),
])
def test_missing_files_are_reported_with_their_key_before_any_work(overrides: list[str], message: str,
                                                                    tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("x")
    plain = compose_plain([o.format(tmp=tmp_path) for o in overrides], tmp_path)
    with pytest.raises(ConfigError) as info:
        validate_config(plain)
        check_environment(plain)
    assert message.format(tmp=tmp_path, data=ROOT / "data") in str(info.value)


def test_a_logger_whose_package_is_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = compose_plain(["logger=wandb"], tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r'logger.wandb needs the wandb package, which is not installed: '
                                          r'pip install -e "\.\[wandb\]"'):
        check_environment(plain)


def test_scst_settings_are_checked(tmp_path: Path) -> None:
    cfg = compose_plain(["experiment=demo_scst"], tmp_path)
    assert cfg["model"]["objective"] == "scst" and cfg["model"]["scst"] == {"samples": 5, "baseline": "mean"}
    assert cfg["callbacks"]["model_checkpoint"]["monitor"] == "val/cider"
    assert cfg["callbacks"]["early_stopping"]["monitor"] == "val/cider"
    validate_config(cfg)
    for key, value, message in [("samples", 1, "it needs model.scst.samples >= 2"),
                                ("baseline", "best", "model.scst.baseline='best' is not valid"),
                                ("samples", 0, "model.scst.samples=0 must be >= 1")]:
        bad = {**cfg, "model": {**cfg["model"], "scst": {**cfg["model"]["scst"], key: value}}}
        with pytest.raises(ConfigError, match=message):
            validate_config(bad)
    validate_config({**cfg, "model": {**cfg["model"], "scst": {"samples": 1, "baseline": "greedy"}}})
    bad = {**cfg, "model": {**cfg["model"], "objective": "rl"}}
    with pytest.raises(ConfigError, match="model.objective='rl' is not valid; choose one of: cross_entropy, scst"):
        validate_config(bad)
    with pytest.raises(ConfigError, match="init_from='/no/such/run' does not exist"):
        check_environment({**cfg, "init_from": "/no/such/run"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_an_accelerator_this_machine_lacks_is_refused(tmp_path: Path) -> None:
    plain = compose_plain(["trainer=gpu"], tmp_path)
    validate_config(plain)  # a valid config, for another machine
    with pytest.raises(ConfigError) as info:
        check_environment(plain)
    assert str(info.value) == ("trainer.accelerator='gpu' but this machine has no usable CUDA GPU; use trainer=cpu "
                               "(or trainer.accelerator=cpu)")
