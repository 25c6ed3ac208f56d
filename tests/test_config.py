"""The typed settings (captioner.config) and the Hydra configs that use them as schemas."""

from __future__ import annotations

import dataclasses
import shutil
import typing
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from test_train import compose_cfg

import train  # noqa: F401  registers the config schemas
from captioner.config import (
    Attention,
    DataConfig,
    DecoderConfig,
    ModelConfig,
    TrainConfig,
    from_dict,
    to_dict,
)
from captioner.errors import ConfigError
from captioner.training.validate import error_line
from conftest import ROOT

CONF = ROOT / "conf"
GROUP_SCHEMAS = {"model": ModelConfig, "data": DataConfig}


def _fields(schema: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(schema)


def _unknown_keys(values: dict, schema: type, where: str) -> list[str]:
    """Keys of a YAML mapping that ``schema`` has no field for (recursively into dataclass-typed fields)."""
    hints, unknown = _fields(schema), []
    for key, value in values.items():
        if key == "defaults":
            continue
        if key not in hints:
            unknown.append(f"{where}.{key}")
            continue
        kind = hints[key]
        kinds = [k for k in typing.get_args(kind) if k is not type(None)] or [kind]
        if isinstance(value, dict) and dataclasses.is_dataclass(kinds[0]):
            unknown += _unknown_keys(value, kinds[0], f"{where}.{key}")
    return unknown


def _yaml_sections(path: Path) -> dict[str, dict]:
    """The model/data sections a config file sets: the file itself for conf/model and conf/data, its
    ``model:`` and ``data:`` keys for a global one (experiment, debug, the primary config)."""
    values = yaml.safe_load(path.read_text()) or {}
    group = path.parent.name
    if group in GROUP_SCHEMAS:
        return {group: values}
    return {name: values[name] for name in GROUP_SCHEMAS if isinstance(values.get(name), dict)}


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_every_yaml_key_is_a_schema_field(path: Path) -> None:
    unknown = [
        key for name, values in _yaml_sections(path).items() for key in _unknown_keys(values, GROUP_SCHEMAS[name], name)
    ]
    assert not unknown, f"{path}: keys without a schema field: {unknown}"


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model=hard"],
        ["experiment=coco_soft"],
        ["experiment=coco_hard"],
        ["experiment=coco_finetune"],
        ["experiment=demo_scst"],
        ["experiment=coco_scst"],
        ["data=coco"],
        ["data=flickr8k"],
        ["debug=overfit"],
    ],
)
def test_every_schema_field_has_a_value_after_composition(overrides: list[str], tmp_path: Path) -> None:
    cfg = compose_cfg(overrides, tmp_path)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert OmegaConf.missing_keys(cfg) == set()
    settings = from_dict(TrainConfig, plain)
    for name, schema in GROUP_SCHEMAS.items():
        assert set(plain[name]) == {f.name for f in dataclasses.fields(schema)}, name
    assert to_dict(settings.model) == plain["model"]


def test_the_schema_defaults_are_the_demo_the_yaml_files_do_not_repeat_them(tmp_path: Path) -> None:
    plain = OmegaConf.to_container(compose_cfg([], tmp_path), resolve=True, enum_to_str=True)
    assert plain["model"] == to_dict(ModelConfig())  # conf/model/soft.yaml sets attention=soft, the default
    model_yaml = yaml.safe_load((CONF / "model" / "base.yaml").read_text())
    assert set(model_yaml) == {"defaults"}


def test_a_misspelt_key_in_a_config_file_fails_at_composition_with_the_key(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    hard = conf / "model" / "hard.yaml"
    hard.write_text(hard.read_text() + "decoder:\n  hiden_dim: 64\n")
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(ConfigCompositionException) as info,
    ):
        compose(config_name="config", overrides=["model=hard"])
    assert error_line(info.value).startswith(
        "model.decoder.hiden_dim is not a known key; valid keys: embed_dim, hidden_dim"
    )


@pytest.mark.parametrize(
    "values,message",
    [
        ({"decoder": {"dropout": 1.5}}, "model.decoder.dropout=1.5 must be in [0.0, 0.99]"),
        ({"decoder": {"gate": "half"}}, "model.decoder.gate='half' is not valid; choose one of: scalar, vector, none"),
        ({"decoder": {"embed_dim": "big"}}, "model.decoder.embed_dim='big' must be a int"),
        ({"decoder": {"hiden_dim": 3}}, "model.decoder.hiden_dim is not a known key; valid keys: embed_dim"),
        ({"compile": "yes"}, "model.compile='yes' must be true or false"),
        ({"scst": {"samples": 1}}, "model.scst.samples=1: baseline=mean compares each sample"),
        ({"decoding": {"min_len": 20}}, "model.decoding.min_len=20 must be < max_len=20"),
        ({"attention": "hard", "scorer": "multihead"}, "model.scorer=multihead works with soft attention only"),
        ({"optimizer": {"lr": 0}}, "model.optimizer.lr=0.0 must be >= 1e-12"),
        ({"nonfinite_check_interval": 0}, "model.nonfinite_check_interval=0 must be >= 1"),
    ],
)
def test_from_dict_names_the_key_of_a_bad_value(values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(ModelConfig, values, "model")
    assert str(info.value).startswith(message)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        from_dict(DecoderConfig, {"dropout": -1})


def test_from_dict_builds_nested_settings_with_enums_and_defaults() -> None:
    settings = from_dict(ModelConfig, {"attention": "hard", "decoder": {"dropout": 0.1}, "optimizer": {"lr": 1}})
    assert settings.attention is Attention.hard and settings.decoder.dropout == 0.1
    assert settings.decoder.hidden_dim == DecoderConfig().hidden_dim  # the default
    assert settings.optimizer.lr == 1.0 and isinstance(settings.optimizer.lr, float)
    assert from_dict(ModelConfig, settings) is settings
    assert to_dict(settings)["attention"] == "hard" and to_dict(settings)["decoder"]["gate"] == "scalar"
