"""Where a run starts (training/start.py): from scratch, resuming a run, or a new run from another's model."""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from captioner.config import ARCHITECTURE, ModelConfig, TrainConfig, from_dict, to_dict
from captioner.data.vocab import Vocabulary
from captioner.errors import BundleError, ConfigError
from captioner.fileio import save_torch
from captioner.model.captioner import build_captioner
from captioner.training.start import Start, StartError, model_settings, plan_start, resolve_start, vocab_grows
from captioner.training.validate import validate_config
from conftest import RUN_NET, compose_plain, net_v1, write_run


@pytest.mark.parametrize(
    "write,message",
    [
        (lambda p: p.write_bytes(b""), "is empty"),
        (lambda p: p.write_bytes(b"\x80\x04K\x01."), "is truncated or corrupt"),
        (lambda p: save_torch({"weights": torch.ones(2)}, p), "neither a captioner bundle nor a training checkpoint"),
        (
            lambda p: save_torch({"pytorch-lightning_version": "2.6.0", "state_dict": {}}, p),
            'has no "captioner" entry',  # a Lightning checkpoint, but not one train.py wrote
        ),
        (lambda p: (p / "checkpoints").mkdir(parents=True), "is a folder without checkpoints/last.ckpt"),
    ],
)
def test_resolve_checkpoint_refuses_every_kind_of_bad_file(write, message: str, tmp_path: Path) -> None:
    path = tmp_path / "run"
    write(path)
    with pytest.raises((BundleError, ConfigError), match=message):
        resolve_start(str(path), None, "cross_entropy", 0)


def test_ckpt_path_resumes_a_run_of_the_same_objective_and_starts_scst_from_another(tmp_path: Path) -> None:
    ce, scst = write_run(tmp_path / "ce", None), write_run(tmp_path / "scst", "scst")
    start = resolve_start(str(ce), None, "cross_entropy", 0)  # as before: resume
    assert start.resume == str(ce / "checkpoints" / "last.ckpt") and start.init is None
    start = resolve_start(str(ce), None, "scst", 0)  # a cross-entropy run: SCST starts from its selected model
    assert start.resume is None and start.init == str(ce / "bundle.pt")
    assert start.model.config.attention == "hard" and start.model.vocab.itos[4:] == ["a", "red", "circle"]
    start = resolve_start(str(ce / "checkpoints" / "last.ckpt"), None, "scst", 0)  # a checkpoint file: that one
    assert start.init == str(ce / "checkpoints" / "last.ckpt")
    assert resolve_start(str(ce / "bundle.pt"), None, "scst", 0).init == str(ce / "bundle.pt")  # a bundle too
    with pytest.raises(ConfigError, match="is an inference bundle"):  # not for a run that starts with cross-entropy
        resolve_start(str(ce / "bundle.pt"), None, "scst", 5)
    assert resolve_start(None, None, "scst", 5).model is None  # cross-entropy first: from scratch
    start = resolve_start(str(scst), None, "scst", 0)  # an SCST run: resumed
    assert start.resume == str(scst / "checkpoints" / "last.ckpt") and start.init is None
    assert start.model.image_size == 64  # the model comes from the checkpoint when resuming as well
    start = resolve_start(None, str(ce), "cross_entropy", 0)  # init_from: a new run from the weights, any objective
    assert start.init == str(ce / "bundle.pt") and start.resume is None
    crashed = write_run(tmp_path / "crashed", None, bundle=False)
    assert resolve_start(str(crashed), None, "scst", 0).init == str(crashed / "checkpoints" / "last.ckpt")
    assert resolve_start(None, None, "cross_entropy", 0).model is None


@pytest.mark.parametrize(
    "ckpt,init,message",
    [
        (None, None, "model.objective=scst fine-tunes a trained captioner; give ckpt_path="),
        ("ce", "ce", "cannot be resumed by a model.objective=scst run and would start it from its weights"),
    ],
)
def test_scst_needs_one_model_to_start_from(ckpt: str | None, init: str | None, message: str, tmp_path: Path) -> None:
    write_run(tmp_path / "ce", None)
    with pytest.raises(ConfigError, match=message):
        resolve_start(ckpt and str(tmp_path / ckpt), init and str(tmp_path / init), "scst", 0)


def _damage_weights(path: Path) -> None:
    """Overwrite the local header of each tensor's member of the zip archive at ``path`` (torch.save's): its
    structure still reads, its weights do not."""
    with zipfile.ZipFile(path) as archive:
        offsets = [member.header_offset for member in archive.infolist() if "/data/" in member.filename]
    raw = bytearray(path.read_bytes())
    for offset in offsets:
        raw[offset : offset + 4] = b"XXXX"  # not PK\x03\x04
    path.write_bytes(bytes(raw))


def test_plan_start_decides_from_each_file_s_structure_without_reading_its_weights(tmp_path: Path) -> None:
    run = write_run(tmp_path / "ce", None)
    for name in ("checkpoints/last.ckpt", "bundle.pt"):
        _damage_weights(run / name)
    assert plan_start(str(run), None, "cross_entropy", 0) == Start(resume=str(run / "checkpoints" / "last.ckpt"))
    assert plan_start(str(run), None, "scst", 0) == Start(init=str(run / "bundle.pt"), init_from_ckpt_path=True)
    assert plan_start(None, str(run), "cross_entropy", 0) == Start(init=str(run / "bundle.pt"))
    with pytest.raises(BundleError, match="is truncated or corrupt"):  # loading the model reads them
        resolve_start(str(run), None, "cross_entropy", 0)


@pytest.mark.parametrize(
    "ckpt,init,what,remedy",
    [
        (
            "ce/bundle.pt",
            None,
            "ckpt_path='{t}/ce/bundle.pt' is an inference bundle (weights for captioning, no optimiser or training "
            "state), which no run resumes",
            "to resume a run give its folder or its checkpoints/last.ckpt; to start a new run from this bundle's "
            "weights give init_from={t}/ce/bundle.pt instead",
        ),
        (
            "stopped",
            None,
            "ckpt_path='{t}/stopped' is a folder without checkpoints/last.ckpt, the checkpoint a run resumes from (a "
            "run saves it as it trains)",
            "give the folder of a run that saved one, or one of its .ckpt files",
        ),
        (
            "exported",
            None,
            "ckpt_path='{t}/exported' is a folder without checkpoints/last.ckpt, the checkpoint a run resumes from (a "
            "run saves it as it trains)",
            "give the folder of a run that saved one, or one of its .ckpt files; to start a new run from its "
            "bundle.pt give init_from={t}/exported instead",
        ),
        (
            "notes.txt",
            None,
            "ckpt_path='{t}/notes.txt': checkpoint {t}/notes.txt is not a model file (torch.save did not write it); "
            "give a training run's folder, its bundle.pt or a checkpoint",
            "give a run folder or a .ckpt that train.py wrote",
        ),
        (
            None,
            "stopped",
            "init_from='{t}/stopped' is a folder with neither bundle.pt nor checkpoints/last.ckpt",
            "give the folder of a run that saved a checkpoint, a .ckpt or a bundle",
        ),
    ],
)
def test_what_a_run_cannot_start_from_is_what_and_how_to_fix_it(
    ckpt: str | None, init: str | None, what: str, remedy: str, tmp_path: Path
) -> None:
    write_run(tmp_path / "ce", None)
    (tmp_path / "stopped").mkdir()  # stopped before its first checkpoint
    (write_run(tmp_path / "exported", None) / "checkpoints" / "last.ckpt").unlink()  # its bundle only
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(StartError) as info:
        plan_start(ckpt and str(tmp_path / ckpt), init and str(tmp_path / init), "cross_entropy", 0)
    assert (info.value.what, info.value.remedy) == (what.format(t=tmp_path), remedy.format(t=tmp_path))
    assert str(info.value) == f"{info.value.what}; {info.value.remedy}"


def test_the_checkpoints_model_replaces_the_configs(tmp_path: Path) -> None:
    start = resolve_start(str(write_run(tmp_path / "ce", None)), None, "scst", 0)
    config = {
        "model": {"attention": "soft", "scorer": "additive", "decoder": {"embed_dim": 128}},
        "data": {"image_size": 96},
    }
    settings = model_settings(start, config, tmp_path / "out")
    net = to_dict(net_v1(RUN_NET))  # every field: what RUN_NET leaves out is the bundle format's ABSENT_KEY_VALUES
    assert settings == {
        **{f"model.{key}": _value(net, key) for key in ARCHITECTURE},
        "data.image_size": 64,
        "data.vocab_file": str(tmp_path / "out" / "vocab.json"),
        "ckpt_path": None,  # a cross-entropy run's ckpt_path starts an SCST run as init_from: the config says so
        "init_from": str(tmp_path / "ce" / "bundle.pt"),
    }
    assert (settings["model.attention"], settings["model.scorer"], settings["model.self_attention.blocks"]) == (
        "hard",
        "dot",
        1,
    )
    assert (settings["model.encoder.grid"], settings["model.decoder.hidden_dim"]) == (2, 8)
    assert Vocabulary.load(tmp_path / "out" / "vocab.json") == start.model.vocab


def _value(values: dict, key: str) -> object:
    for part in key.split("."):
        values = values[part]
    return values


TRAINING_ONLY = {  # each differs from the checkpoint's (RUN_NET's) value
    "model.decoder.dropout": 0.05,
    "model.decoder.hard_expectation_prob": 0.9,
    "model.decoder.hard_expectation_warmup": 0.25,
    "model.decoder.gumbel_tau": 2.0,
    "model.decoder.hard_estimator": "gumbel",
    "model.encoder.trainable_stages": 1,
}


def test_an_override_beats_the_checkpoint_s_training_only_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    start = resolve_start(None, str(write_run(tmp_path / "ce", None)), "cross_entropy", 0)
    checkpoint = to_dict(start.model.config)
    assert all(_value(checkpoint, key.removeprefix("model.")) != value for key, value in TRAINING_ONLY.items())
    cfg = OmegaConf.create({"model": to_dict(ModelConfig()), "data": {"image_size": 96, "vocab_file": None}})
    for key, value in TRAINING_ONLY.items():
        OmegaConf.update(cfg, key, value)  # given on the command line
    with caplog.at_level(logging.INFO, logger="captioner.training.start"):
        for key, value in model_settings(start, OmegaConf.to_container(cfg), tmp_path / "out").items():
            OmegaConf.update(cfg, key, value, merge=True)  # as train.py applies them
    model = from_dict(ModelConfig, OmegaConf.to_container(cfg)["model"], "model")
    assert {key: _value(to_dict(model), key.removeprefix("model.")) for key in TRAINING_ONLY} == TRAINING_ONLY
    assert model.net().decoder.hidden_dim == 8 and model.encoder.grid == 2 and model.attention == "hard"  # its shape
    build_captioner(model.net(), len(start.model.vocab)).load_state_dict(start.model.model.state_dict())
    lines = [record.getMessage() for record in caplog.records]
    assert (
        "from the checkpoint (the network it trained), not the config: model.attention=hard (the config's: soft)"
        in (lines[-2])
    )
    assert "model.decoder.hidden_dim=8 (the config's: 256)" in lines[-2] and "data.image_size=64" in lines[-2]
    assert lines[-1] == (
        "from the config (how this run trains), not the checkpoint: model.encoder.trainable_stages=1 (the "
        "checkpoint's: 0), model.decoder.dropout=0.05 (the checkpoint's: 0.5), model.decoder.hard_expectation_prob=0.9"
        " (the checkpoint's: 0.5), model.decoder.hard_expectation_warmup=0.25 (the checkpoint's: 0.0), "
        "model.decoder.hard_estimator=gumbel (the checkpoint's: reinforce), model.decoder.gumbel_tau=2.0 (the "
        "checkpoint's: 1.0)"
    )


def test_every_network_setting_is_the_checkpoint_s_or_the_run_s() -> None:
    from captioner.config.network import NetConfig

    leaves = set(_leaf_keys(to_dict(NetConfig())))
    assert set(ARCHITECTURE) <= leaves
    assert {key.removeprefix("model.") for key in TRAINING_ONLY} <= leaves - set(ARCHITECTURE)


def _leaf_keys(values: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        keys += _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def test_init_vocab_grow_grows_the_vocabulary_of_a_new_run_only(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^init_vocab=grow grows the vocabulary of the model a new run starts from: give"
    ):
        validate_config(compose_plain(["init_vocab=grow"], tmp_path))  # nothing to start from
    with pytest.raises(ConfigError, match=r"^init_vocab='extend' is not valid; choose one of: keep, grow$"):
        from_dict(TrainConfig, {"init_vocab": "extend"})
    ce = write_run(tmp_path / "ce", None)
    new_run = resolve_start(None, str(ce), "cross_entropy", 0)
    assert vocab_grows(new_run, TrainConfig(init_from=str(ce), init_vocab="grow"))
    assert not vocab_grows(new_run, TrainConfig(init_from=str(ce)))  # keep, the default
    scst = resolve_start(str(ce), None, "scst", 0)  # a ckpt_path taken as init_from: a new run, which grows too
    assert vocab_grows(scst, TrainConfig(ckpt_path=str(ce), init_vocab="grow"))
    resumed = resolve_start(str(ce), None, "cross_entropy", 0)
    with pytest.raises(ConfigError, match=r"ckpt_path=\S+ resumes a run, whose vocabulary is its checkpoint's: leave"):
        vocab_grows(resumed, TrainConfig(ckpt_path=str(ce), init_vocab="grow"))
