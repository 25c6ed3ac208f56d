"""The typed settings (captioner.config) and the Hydra configs that use them as schemas."""

from __future__ import annotations

import dataclasses
import re
import shutil
import typing
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from captioner.config import (
    MAX_LEN,
    Attention,
    DataConfig,
    DecoderConfig,
    DecodingConfig,
    ModelConfig,
    TrainConfig,
    from_dict,
    to_dict,
)
from captioner.errors import ConfigError
from captioner.training.command_line import error_line
from captioner.training.schemas import register_schemas
from captioner.training.validate import validate_config
from conftest import ROOT, compose_cfg, compose_plain

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
        ["experiment=coco_soft", "data=coco"],
        ["experiment=flickr8k_soft"],
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


def test_the_schema_defaults_are_the_demo_model_the_yaml_files_do_not_repeat_them(tmp_path: Path) -> None:
    plain = OmegaConf.to_container(compose_cfg([], tmp_path), resolve=True, enum_to_str=True)
    # conf/model/soft.yaml sets attention=soft, the default; conf/experiment/demo.yaml the SCST switch;
    # conf/model/base.yaml decodes as long as the training captions are cut (the demo's: 16 words)
    decoding = DecodingConfig(max_len=plain["data"]["max_len"])
    assert plain["model"] == to_dict(ModelConfig(objective="scst", decoding=decoding))
    model_yaml = yaml.safe_load((CONF / "model" / "base.yaml").read_text())
    assert model_yaml == {"defaults": ["/model_schema@_here_", "_self_"], "decoding": {"max_len": "${data.max_len}"}}


@pytest.mark.parametrize(
    "overrides,words",
    [
        ([], 16),
        (["experiment=scenes"], 24),  # its captions reach 23 words
        (["experiment=scenes", "model=hard"], 24),
        (["experiment=coco_soft", "model.encoder.weights=null"], MAX_LEN),
        (["data.max_len=30"], 30),
    ],
)
def test_validation_decodes_as_long_as_the_training_captions(overrides: list[str], words: int, tmp_path: Path) -> None:
    settings = validate_config(compose_plain(overrides, tmp_path))
    assert settings.model.decoding.max_len == settings.data.max_len == words
    assert settings.model.decoding.for_captioning().max_len == words  # the run's final scores and its summary
    shorter = validate_config(compose_plain([*overrides, "model.decoding.max_len=12"], tmp_path))
    assert (shorter.model.decoding.max_len, shorter.data.max_len) == (12, words)  # still a setting of its own


def test_a_misspelt_key_in_a_config_file_fails_at_composition_with_the_key(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    hard = conf / "model" / "hard.yaml"
    hard.write_text(hard.read_text() + "decoder:\n  hiden_dim: 64\n")
    register_schemas()
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
        ({"decoder": {"embed_dim": "big"}}, "model.decoder.embed_dim='big' must be an int"),
        ({"decoder": {"hiden_dim": 3}}, "model.decoder.hiden_dim is not a known key; valid keys: embed_dim"),
        ({"compile": "yes"}, "model.compile='yes' is not valid; choose one of: off, default, reduce-overhead"),
        ({"scst": {"samples": 1}}, "model.scst.samples=1: baseline=mean compares each sample"),
        ({"decoding": {"min_len": 20}}, "model.decoding.min_len=20 must be < max_len=20"),
        ({"attention": "hard", "scorer": "multihead"}, "model.scorer=multihead works with soft attention only"),
        ({"decoder": {"attention_heads": 2}}, "model.decoder.attention_heads=2 needs scorer=multihead (got additive)"),
        ({"optimizer": {"lr": 0}}, "model.optimizer.lr=0.0 must be >= 1e-12"),
        ({"nonfinite_check_interval": 0}, "model.nonfinite_check_interval=0 must be >= 1"),
        ({"decoder": {"hidden_dim": 10**6}}, "model.decoder.hidden_dim=1000000 must be in [1, 8192]"),
        ({"self_attention": {"blocks": 1000}}, "model.self_attention.blocks=1000 must be in [0, 64]"),
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


# ------------------------------------------------------------------ recipes in experiments, hardware in trainers
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
TRAINERS = ["cpu", "gpu", "ddp", "ddp_cpu", "multi_node"]
# The only keys a trainer config may change: everything else in a composed config is the experiment's.
HARDWARE_KEYS = {"accelerator", "devices", "strategy", "num_nodes", "precision", "sync_batchnorm"}


def _flat(values: dict, prefix: str = "") -> dict[str, typing.Any]:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_with_every_trainer_which_changes_only_the_hardware(
    experiment: str, tmp_path: Path
) -> None:
    composed = {}
    for trainer in TRAINERS:
        plain = compose_plain([f"experiment={experiment}", f"trainer={trainer}"], tmp_path)
        from_dict(TrainConfig, plain)  # valid settings
        assert plain["trainer"]["max_epochs"] >= 1 and plain["trainer"]["gradient_clip_val"] == 5.0
        composed[trainer] = _flat(plain)
    reference = composed["cpu"]
    for trainer, flat in composed.items():
        differing = {key for key in reference.keys() | flat.keys() if reference.get(key) != flat.get(key)}
        assert {key.removeprefix("trainer.") for key in differing} <= HARDWARE_KEYS, (trainer, differing)
        assert all(key.startswith("trainer.") for key in differing), (trainer, differing)
    assert composed["gpu"]["trainer.accelerator"] == "gpu"  # the trainers do differ where they should


def test_the_trainer_configs_hold_hardware_keys_only() -> None:
    common = set(yaml.safe_load((CONF / "trainer" / "default.yaml").read_text()))
    for trainer in TRAINERS:
        values = yaml.safe_load((CONF / "trainer" / f"{trainer}.yaml").read_text())
        assert set(values) - {"defaults"} <= HARDWARE_KEYS, trainer
    assert not common & {"max_epochs", "gradient_clip_val"}  # recipe keys: the experiments'


def test_the_demo_is_the_same_recipe_on_every_trainer(tmp_path: Path) -> None:
    cpu, gpu = (compose_plain(overrides, tmp_path) for overrides in ([], ["trainer=gpu"]))
    assert cpu["trainer"]["max_epochs"] == gpu["trainer"]["max_epochs"] == 11
    assert cpu["model"] == gpu["model"] and cpu["data"] == gpu["data"]
    assert cpu["model"]["objective"] == "scst" and cpu["model"]["scst"]["after_epochs"] == 5


@pytest.mark.parametrize(
    "data,remedy",
    [
        ("coco", "experiment=coco_soft data=coco"),
        ("coco_karpathy", "experiment=coco_soft"),
        ("flickr8k", "experiment=flickr8k_soft"),
        ("flickr30k", "experiment=flickr30k_soft"),
    ],
)
def test_a_bare_real_dataset_stops_naming_the_experiment_for_it(data: str, remedy: str, tmp_path: Path) -> None:
    plain = compose_plain([f"data={data}"], tmp_path)
    with pytest.raises(ConfigError) as info:
        from_dict(TrainConfig, plain)
    assert str(info.value).endswith(f"for this dataset train with {remedy}") and "\n" not in str(info.value)
    fitting = compose_plain([*remedy.split(), f"data={data}"], tmp_path)  # the named remedy composes and is valid
    settings = from_dict(TrainConfig, fitting)
    assert settings.model.objective == "cross_entropy" and settings.model.encoder.weights is not None
    assert fitting["trainer"]["accelerator"] == "gpu" and settings.data.image_size == 448


def test_only_an_experiment_switches_the_objective(tmp_path: Path) -> None:
    objectives = {e: compose_plain([f"experiment={e}"], tmp_path)["model"]["objective"] for e in EXPERIMENTS}
    assert ModelConfig().objective == "cross_entropy"
    assert {e for e, o in objectives.items() if o == "scst"} == {"demo", "demo_scst", "coco_scst"}


def test_the_image_size_of_the_coco_recipes_has_one_owner() -> None:
    owners = [p for p in CONF.rglob("*.yaml") if re.search(r"^\s*image_size: 448", p.read_text(), re.M)]
    assert [p.relative_to(CONF).as_posix() for p in owners] == ["experiment/coco_soft.yaml"]
