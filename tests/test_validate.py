"""Checks of a composed training config before any work starts: every value (validate_config), and the
one line train.py prints for each kind of mistake (training/command_line.py). What a config refers to on this machine
is test_preflight.py's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import CompactHydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import train
from captioner.errors import ConfigError
from captioner.training.command_line import error_line, section_error
from captioner.training.validate import check_arguments, validate_config
from conftest import ROOT, compose_cfg, compose_plain, run_train, subprocess_env


def config_error(overrides: list[str], tmp_path: Path) -> str:
    """The one-line error train.py reports for ``overrides`` before any data work: Hydra's composition
    (schemas), ``validate_config``, ``check_arguments`` (the names of the trainer's, callbacks' and loggers'
    arguments), then building the dataset source and the trainer with its callbacks and loggers (Lightning checks
    its own values)."""
    try:
        cfg = compose_cfg(overrides, tmp_path)
    except (CompactHydraException, OmegaConfBaseException) as exc:
        return error_line(exc)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    with pytest.raises(ConfigError) as info:  # noqa: PT012  the checks train.py runs, in its order
        validate_config(plain)
        check_arguments(plain)
        train.build("data.source", plain["data"]["source"])
        train.build_trainer(plain)
    return str(info.value)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.scorer=luong", "model.scorer='luong' is not valid; choose one of: additive, dot, scaled_dot"),
        ("model.decoding.beam_size=0", "model.decoding.beam_size=0 must be in [1, 32]"),
        ("model.decoding.min_len=16", "model.decoding.min_len=16 must be < max_len=16"),
        ("model.decoding.no_repeat_ngram_size=-2", "model.decoding.no_repeat_ngram_size=-2 must be in [0, 100]"),
        ("model.nonfinite_check_interval=0", "model.nonfinite_check_interval=0 must be >= 1"),
        ("model.attention=medium", "model.attention='medium' is not valid; choose one of: soft, hard"),
        ("model.decoder.embed_dim=big", "model.decoder.embed_dim='big' must be an int"),
        ("data.batch_size=-3", "data.batch_size=-3 must be >= 1"),
        ("model.decoder.dropout=1.5", "model.decoder.dropout=1.5 must be in [0.0, 0.99]"),
        ("+model.decoder.hiden_dim=3", "model.decoder.hiden_dim is not a known key; valid keys: embed_dim"),
        ("model.foo=1", "model.foo is not a known key; valid keys: attention, scorer"),
        ("trainer.devices=abc", "trainer.devices='abc': `devices` selected with `CPUAccelerator` should be an int > 0"),
        ("trainer.devices=0", "trainer.devices=0: `devices` selected with `CPUAccelerator` should be an int > 0"),
        ("trainer.accelerator=gpux", "trainer.accelerator='gpux' is not valid; choose one of: auto, gpu, "),
        ("trainer.max_epochs=0", "trainer.max_epochs=0 must be >= 1"),
        ("trainer.precision=17", "trainer.precision=17 must be 64, 32, 16, transformer-engine, "),
        ("trainer.precision=bf16_mixed", "trainer.precision='bf16_mixed' must be 64, 32, 16, transformer-engine, "),
        ("+trainer.detect_anomaly=maybe", "trainer.detect_anomaly='maybe' must be true or false"),
        ("+trainer.benchmark=1", "trainer.benchmark=1 must be true, false or null"),
        ("+trainer.accumulate_grad_batches=2.5", "trainer.accumulate_grad_batches=2.5 must be an int"),
        ("+trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 must be >= 1"),
        ("trainer.check_val_every_n_epoch=0", "trainer.check_val_every_n_epoch=0 must be >= 1"),
        ("+trainer.val_check_interval=0", "trainer.val_check_interval=0 must be >= 1"),
        ("+trainer.val_check_interval=1.5", "trainer.val_check_interval=1.5 must be in (0.0, 1.0]"),
        ("+trainer.max_steps=0", "trainer.max_steps=0 must be -1 (no limit) or >= 1"),
        ("trainer.log_every_n_steps=-1", "trainer.log_every_n_steps=-1 must be >= 0"),
        ("trainer.num_sanity_val_steps=-5", "trainer.num_sanity_val_steps=-5 must be >= -1"),
        ("+trainer.max_time=soon", "trainer: `Timer(duration='soon')` is not a valid duration"),  # Lightning's
        ("callbacks.model_checkpoint.save_top_k=all", "callbacks.model_checkpoint.save_top_k='all' must be an int"),
        (
            "callbacks.learning_rate_monitor.logging_interval=hour",
            "callbacks.learning_rate_monitor.logging_interval='hour' must be step, epoch or null",
        ),
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1 must be >= 0.0"),
        ("+trainer.strategy=ddpp", "trainer.strategy='ddpp' is not a strategy Lightning knows; did you mean ddp?"),
        ("trainer.min_epochs=5000", "trainer.min_epochs=5000 must be <= trainer.max_epochs="),
        (
            "+trainer.max_epoch=3",
            "trainer.max_epoch is not an argument of lightning.pytorch.trainer.Trainer; did you mean "
            "trainer.max_epochs?",
        ),
        (
            "+trainer.qwerty=3",
            "trainer.qwerty is not an argument of lightning.pytorch.trainer.Trainer; it takes: accelerator, strategy, "
            "devices,",
        ),
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
        (  # BestCheckpoint(*args, **kwargs) passes them on: ModelCheckpoint's are the ones it takes
            "+callbacks.model_checkpoint.every_n_epoch=2",
            "callbacks.model_checkpoint.every_n_epoch is not an argument of captioner.training.callbacks."
            "BestCheckpoint; did you mean callbacks.model_checkpoint.every_n_epochs?",
        ),
        (
            "+callbacks.early_stopping.patiance=2",
            "callbacks.early_stopping.patiance is not an argument of captioner.training.callbacks."
            "WarmupEarlyStopping; did you mean callbacks.early_stopping.patience?",
        ),
        (  # TensorBoardLogger passes the keywords it does not name on to its SummaryWriter: those are taken too
            "+logger.tensorboard.flush_sec=5",
            "logger.tensorboard.flush_sec is not an argument of captioner.training.loggers.TensorBoardLogger; did you "
            "mean logger.tensorboard.flush_secs?",
        ),
        (  # ... but for log_dir, which the logger gives its SummaryWriter itself
            "+logger.tensorboard.log_dir=elsewhere",
            "logger.tensorboard.log_dir is not an argument of captioner.training.loggers.TensorBoardLogger",
        ),
        (
            "logger.csv._target_=lightning.pytorch.loggers.CSVLoger",
            "logger.csv._target_='lightning.pytorch.loggers.CSVLoger': lightning.pytorch.loggers has no CSVLoger; "
            "did you mean CSVLogger?",
        ),
        (
            "logger.csv._target_=lightning_loggers.CSVLogger",
            "logger.csv._target_='lightning_loggers.CSVLogger' cannot be imported: No module named 'lightning_loggers'",
        ),
        ("data.source.n_train=0", "data.source.n_train=0 must be >= 1"),
        ("+data.source.size=3", "data.source.size is not a known key; valid keys: root, n_train, n_val, n_test"),
        ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
        ("+epochs=3", "epochs is not a known key; valid keys: task_name, seed"),
        ("train=maybe", "train='maybe' must be true or false"),
    ],
)
def test_every_config_value_is_checked(override: str, message: str, tmp_path: Path) -> None:
    assert config_error([override], tmp_path).startswith(message)


def test_a_value_the_model_config_refuses_is_named_once_under_model(tmp_path: Path) -> None:
    assert config_error(["model.graphs=true", "model.compile=reduce-overhead"], tmp_path) == (
        "model.graphs=true captures whole steps as CUDA graphs and compile=reduce-overhead graphs each word inside "
        "them, which CUDA cannot nest: set model.graphs=false for per-word graphs"
    )
    assert config_error(["model.fused_attention=true", "model.scorer=dot"], tmp_path) == (
        "model.fused_attention=true needs scorer=additive (got scorer=dot)"
    )


def test_a_keyword_a_class_passes_on_is_taken_and_its_values_are_lightning_s_to_check(tmp_path: Path) -> None:
    # TensorBoardLogger passes flush_secs on to its SummaryWriter
    check_arguments(compose_plain(["+logger.tensorboard.flush_secs=5", "+trainer.limit_train_batches=2"], tmp_path))
    assert config_error(["+trainer.limit_train_batches=-1"], tmp_path).startswith(
        "trainer: You have passed invalid value -1 for limit_train_batches"  # a name it takes: Lightning's value
    )


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


def test_a_missing_weight_file_names_the_key_model_encoder_weights(tmp_path: Path, monkeypatch) -> None:
    from captioner.data.vocab import Vocabulary
    from captioner.training.module import CaptionerModule

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no weight file there
    plain = compose_plain(["model.encoder.weights=IMAGENET1K_V1", "model.encoder.download=false"], tmp_path)
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


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["trainer.foo=1"],
            "trainer.foo is not a known key; valid keys: default_root_dir, min_epochs, accelerator, devices,",
        ),
        (["trainer.max_epochs=abc"], "trainer.max_epochs='abc' must be an int"),
        (["experimnt=coco_soft"], "experimnt is not a known key; valid keys: callbacks, ckpt_path, data, debug,"),
        (["model.decoder.hiden_dim=3"], "model.decoder.hiden_dim is not a known key; valid keys: embed_dim,"),
        (
            ["data=cocoo"],
            "data=cocoo is not an option; choose one of: captions, coco, coco_karpathy, flickr30k, flickr8k,",
        ),
        (["model.decoder.hidden_dim"], "the override 'model.decoder.hidden_dim' has no value: write "),
    ],
)
def test_a_config_mistake_names_the_key_the_choices_and_the_nearest(
    overrides: list[str], message: str, tmp_path: Path
) -> None:
    line = config_error(overrides, tmp_path)
    assert line.startswith(message)
    ending = {
        "experimnt=coco_soft": "; did you mean experiment?",
        "model.decoder.hiden_dim=3": "; did you mean model.decoder.hidden_dim?",
        "data=cocoo": "; did you mean coco?",
        "trainer.foo=1": " (a key the config does not set is added with +trainer.foo=VALUE)",
        "model.decoder.hidden_dim": "model.decoder.hidden_dim=VALUE (or ~model.decoder.hidden_dim to remove the key)",
    }.get(overrides[0], "")
    assert line.endswith(ending)


def test_internal_options_are_refused_with_the_real_ones(tmp_path: Path) -> None:
    line = error_line_of(run_train(["data=base", f"paths.log_dir={tmp_path}"], check=False))
    assert line == (
        "error: data=base is not an option of its own (the others start from it); choose one of: captions, coco, "
        "coco_karpathy, flickr30k, flickr8k, scenes, shapes, webdataset"
    )
    assert not any(tmp_path.iterdir())


def error_line_of(proc: subprocess.CompletedProcess) -> str:
    """The one stderr line of a refused train.py run (exit status 2)."""
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr.strip()


def test_help_shows_the_settings_from_the_dataclasses_and_only_selectable_groups() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    groups = proc.stdout.split("config groups")[1].split("settings")[0]
    names = {line.split(":")[0].strip(): line.split(": ")[1] for line in groups.splitlines() if ": " in line}
    assert list(names) == ["callbacks", "data", "debug", "experiment", "logger", "model", "paths", "trainer"]
    assert names["data"] == "captions, coco, coco_karpathy, flickr30k, flickr8k, scenes, shapes*, webdataset"  # no base
    assert names["trainer"] == "cpu*, ddp, ddp_cpu, gpu, multi_node"  # no default; * what python train.py composes
    lines = proc.stdout.splitlines()
    assert "  model.decoder.dropout=0.3  (in [0.0, 0.99]; before the output layer)" in lines
    assert "  model.decoding.method=greedy  (one of: greedy, beam, diverse, sample; greedy for validation and test" in (
        "\n".join(lines)
    )
    assert "  data.pad_to=null  (>= caption_tokens; Training captions padded" in proc.stdout
    # the limits as numbers, not the constants' names (MAX_CELLS), and sentences joined as sentences
    from captioner.config.network import MAX_CELLS

    assert f"  model.encoder.grid=null  (in [1, {MAX_CELLS}]; pool the feature map down" in proc.stdout
    assert "; captioning: beam)" in proc.stdout and not re.search(r"\b(MAX|MIN)_[A-Z_]+\b", proc.stdout)
    assert ".;" not in proc.stdout and "apart poorly. The trunk stage read as the grid" in proc.stdout


def test_help_shows_the_groups_python_train_py_composes_and_how_to_see_the_config_resolved(tmp_path: Path) -> None:
    """The settings that a config group fills (trainer, callbacks, logger, paths) showed as null; they show the
    options the default run composes, which are Hydra's own choices; --cfg job prints interpolations as written,
    so --help names --resolve."""
    from hydra.core.hydra_config import HydraConfig

    from captioner.training.command_line import group_defaults, help_page

    cfg = compose_cfg([], tmp_path)
    composed = HydraConfig.get().runtime.choices
    chosen = group_defaults()
    assert sorted(chosen) == ["callbacks", "data", "debug", "experiment", "logger", "model", "paths", "trainer"]
    assert {group: options for group, options in chosen.items() if group != "logger"} == {
        group: [composed[group]] if composed[group] else [] for group in chosen if group != "logger"
    }  # the experiment's overrides included (experiment=demo: trainer=cpu)
    assert chosen["logger"] == ["csv", "tensorboard"] == sorted(cfg.logger)  # a list: Hydra lists no choice for it
    page = help_page()
    lines = page.splitlines()
    for line in (
        "  trainer=cpu  (one of: cpu, ddp, ddp_cpu, gpu, multi_node; lightning.Trainer's arguments (conf/trainer); "
        "its keys: trainer.KEY=VALUE)",
        "  callbacks=default  (one of: default; name -> a Lightning callback (conf/callbacks); its keys: "
        "callbacks.KEY=VALUE)",
        "  logger=[csv,tensorboard]  (a list of: csv, mlflow, none, tensorboard, wandb; name -> a Lightning logger "
        "(conf/logger); its keys: logger.KEY=VALUE)",
        "  debug: fast, overfit  (none by default)",
        "  logger: csv*, mlflow, none, tensorboard*, wandb  (several at once: logger=[a,b])",
    ):
        assert line in lines, line
    assert not re.search(r"^  (trainer|callbacks|logger|paths)=null", page, flags=re.MULTILINE)
    assert "[--cfg job [--resolve]]" in page and "--cfg job --resolve   print the composed config" in page
    assert "--cfg job --resolve shows the composed values" in page


def test_the_resolve_that_help_names_prints_the_config_without_interpolations(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "train.py"), "--cfg", "job", "--resolve"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert "${" not in proc.stdout and f"  data_dir: {tmp_path / 'data'}\n" in proc.stdout  # ${paths.root_dir}/data


def _leaf_keys(node: dict, prefix: str) -> list[str]:
    """The dotted keys of a config node's values, a split's name written <split> (data.source.splits.<split>.*)."""
    keys = []
    for key, value in node.items():
        name = "<split>" if prefix.endswith(".splits.") else key
        if isinstance(value, dict):
            keys += _leaf_keys(value, f"{prefix}{name}.")
        elif key != "_target_":
            keys.append(f"{prefix}{name}")
    return keys


def test_help_lists_every_data_source_key_of_conf_and_the_any_typed_settings(tmp_path: Path) -> None:
    from captioner.training.command_line import group_options, help_page

    page = help_page()
    assert "the defaults of captioner/config/ (a package of dataclasses" in page
    assert "  model.compile=null  (one of: off, default, reduce-overhead, max-autotune; " in page
    listed = {line.split()[0].split("=")[0] for line in page.splitlines() if line.startswith("  data.source.")}
    for option in group_options("data"):
        source = OmegaConf.to_container(compose_cfg([f"data={option}"], tmp_path).data.source, resolve=False)
        missing = set(_leaf_keys(source, "data.source.")) - listed
        assert not missing, f"data={option}: {sorted(missing)} not in --help"


def test_the_readme_s_configs_table_lists_every_option_of_conf() -> None:
    from captioner.training.command_line import group_options, groups

    table = (ROOT / "README.md").read_text().split("### Configs")[1].split("| group |")[1].split("\n\n")[0]
    listed: dict[str, list[str]] = {}
    for row in table.splitlines()[2:]:
        names, options = (cell.strip() for cell in row.strip("|").split("|")[:2])
        names = [name.strip("` ") for name in names.split(",")]
        for name, choices in zip(names, options.split(";") if len(names) > 1 else [options]):
            listed[name] = sorted(choice.split("(")[0].strip() for choice in choices.split(","))
    assert sorted(listed) == groups()
    for group in groups():
        assert listed[group] == group_options(group), group


def test_one_demo_time_everywhere() -> None:
    from captioner.training.command_line import help_page

    said = "about 5 minutes on 2 CPU cores"  # the README's measured figure, rounded
    places = {name: (ROOT / name).read_text() for name in ("README.md", "train.py", "conf/experiment/demo.yaml")}
    places["README.md"] = places["README.md"].split("## Quickstart")[1].split("```")[0]  # where it says the time
    places["--help"] = help_page()
    for name, text in places.items():
        text = " ".join(text.split())
        assert said in text, name
        assert not re.search(r"(a few|within \d+|about \d+) minutes", text.replace(said, "")), name


@pytest.mark.parametrize(
    "overrides,needs",
    [
        (["model=hard"], "model.decoder.hard_expectation_warmup=0.5 (a fraction of cross-entropy training)"),
        (["model=soft"], "model.scheduler.name=cosine (over the run's steps)"),
    ],
)
def test_a_run_without_a_length_is_refused_before_it_starts(overrides: list[str], needs: str, tmp_path: Path) -> None:
    """trainer.max_epochs=null: Lightning's 1000 epochs (a warm-up of 500) or, with max_time, no limit (an
    OverflowError when the module laid its schedule over it)."""
    cross_entropy = [*overrides, "model.objective=cross_entropy"]
    message = config_error([*cross_entropy, "trainer.max_epochs=null"], tmp_path)
    assert message.startswith("trainer.max_epochs=null with no trainer.max_steps gives the run no known length")
    assert needs in message
    validate_config(compose_plain([*cross_entropy, "trainer.max_epochs=null", "+trainer.max_steps=500"], tmp_path))


def test_max_time_without_max_epochs_is_one_line(tmp_path: Path) -> None:
    args = ["model=hard", "trainer.max_epochs=null", "+trainer.max_time=00:00:10:00", f"paths.log_dir={tmp_path}"]
    line = error_line_of(run_train(args, check=False))
    assert line.startswith("error: trainer.max_epochs=null with no trainer.max_steps gives the run no known length")
    assert not any(tmp_path.iterdir())  # refused before the run's folder exists
