"""Check a composed training config before any work starts.

``validate_config`` checks every value's type, range and choice; the first violation raises ``ConfigError``
with the key, the bad value and the valid values. Unknown keys are refused too (a typo is never ignored):
in the model and data sections by the schemas below, in the trainer, callbacks, loggers and the dataset
source by the arguments their ``_target_`` accepts. ``check_environment`` checks what the config refers to
on this machine: the dataset files, the vocabulary file, the checkpoint to resume and the accelerator.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

from captioner.errors import ConfigError, check_choice, check_range
from captioner.model.attention import ATTENTION_TYPES
from captioner.model.losses import SCST_BASELINES, check_scst_samples

PRECISIONS = ("32-true", "32", "64-true", "64", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16",
              "transformer-engine", "transformer-engine-float16")
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "tpu", "auto")
# What CaptionerModule logs, so what a checkpoint or early-stopping callback can monitor.
MONITORS = ("val/bleu1", "val/bleu2", "val/bleu3", "val/bleu4", "val/cider", "val/loss", "val/attention_correctness",
            "train/loss")
TOP_LEVEL = ("task_name", "seed", "ckpt_path", "init_from", "train", "test", "data", "model", "trainer", "logger",
             "callbacks", "paths")
DATASET_HELP = "see data/README.md for where dataset files go"

Rule = Callable[[str, Any], None]


def _choice(*choices: Any) -> Rule:
    return lambda key, value: check_choice(key, value, choices)


def _int(low: int | None = None, high: int | None = None, optional: bool = False) -> Rule:
    def rule(key: str, value: Any) -> None:
        if value is None and optional:
            return
        check_range(key, value, low, high, kind=int)
    return rule


def _float(low: float | None = None, high: float | None = None, optional: bool = False) -> Rule:
    def rule(key: str, value: Any) -> None:
        if value is None and optional:
            return
        check_range(key, value, low, high)
    return rule


def _bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")


def _str(key: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} must be a string")


def _str_or_none(key: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} must be a string or null")


def _encoder_name(key: str, value: Any) -> None:
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if value not in names:
        raise ConfigError(f"{key}={value!r} is not a torchvision classification model; choose one of: "
                          f"{', '.join(n for n in names if not n.startswith(('vit', 'swin', 'maxvit')))}")


def _devices(key: str, value: Any) -> None:
    """A device count (>= 1, or -1 for all), ``auto``, or device indices (a list or ``"0,1"``)."""
    ok = (value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1))
          or (isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                        for v in value))
          or (isinstance(value, str) and value.replace(",", "").replace(" ", "").lstrip("-").isdigit()))
    if not ok:
        raise ConfigError(f"{key}={value!r} is not valid; use a number of devices (>= 1, or -1 for all), 'auto', "
                          "or a list of device indices such as [0,1]")


def _count_or_fraction(key: str, value: Any) -> None:
    """Lightning's batch limits: a number of batches (int >= 0) or a fraction of them (float in [0, 1])."""
    if value is None:
        return
    if isinstance(value, float):
        check_range(key, value, 0.0, 1.0)
    else:
        check_range(key, value, 0, kind=int)


def _val_check_interval(key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, float):
        check_range(key, value, 1e-9, 1.0)
    else:
        check_range(key, value, 1, kind=int)


def _bool_or_count(key: str, value: Any) -> None:
    """``trainer.fast_dev_run``: true/false, or a number of batches (int >= 0)."""
    if not isinstance(value, bool):
        check_range(key, value, 0, kind=int)


def _strategy(key: str, value: Any) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if isinstance(value, str):
        check_choice(key, value, ("auto", *StrategyRegistry.available_strategies()))


def _not_a_file(key: str, value: Any) -> None:
    """A folder that is created on first use: it must not be an existing file."""
    _str(key, value)
    if Path(value).exists() and not Path(value).is_dir():
        raise ConfigError(f"{key}={value!r} is a file, not a folder")


MODEL_SCHEMA: dict[str, Any] = {
    "_target_": _str_or_none,
    "attention": _choice("soft", "hard"),
    "scorer": _choice(*ATTENTION_TYPES),
    "encoder": {
        "name": _encoder_name,
        "weights": _str_or_none,
        "stage": _str_or_none,
        "grid": _int(1, optional=True),
        "trainable_stages": _int(-1),
        "channels_last": _bool,
    },
    "feature_norm": _bool,
    "self_attention": {"blocks": _int(0), "heads": _int(1), "positional": _bool},
    "decoder": {
        "embed_dim": _int(1), "hidden_dim": _int(1), "attention_dim": _int(1), "attention_heads": _int(1),
        "gate": _choice("scalar", "vector", "none"), "deep_output": _bool, "dropout": _float(0.0, 0.99),
        "hard_expectation_prob": _float(0.0, 1.0), "hard_inference": _choice("argmax", "expectation"),
        "hard_estimator": _choice("reinforce", "gumbel"), "gumbel_tau": _float(1e-3), "gumbel_tau_min": _float(1e-3),
    },
    "loss": {"ds_lambda": _float(0.0), "reinforce_weight": _float(0.0), "reinforce_reward": _choice("word", "suffix"),
             "entropy_weight": _float(0.0), "baseline_decay": _float(0.0, 1.0)},
    "optimizer": {"lr": _float(1e-12), "encoder_lr": _float(0.0), "weight_decay": _float(0.0)},
    "scheduler": {"name": _choice("cosine", "step", "none"), "warmup_steps": _int(0),
                  "step_size": _int(1), "gamma": _float(0.0, 1.0)},
    "decoding": {"method": _choice("greedy", "beam", "sample"), "beam_size": _int(1), "max_len": _int(1),
                 "length_penalty": _float(0.0), "temperature": _float(1e-6), "min_len": _int(0),
                 "no_repeat_ngram_size": _int(0)},
    "compile": _bool,
    "nonfinite": _choice("stop", "skip"),
    "nonfinite_check_interval": _int(1),
    "objective": _choice("cross_entropy", "scst"),
    "scst": {"samples": _int(1), "baseline": _choice(*SCST_BASELINES)},
}

DATA_SCHEMA: dict[str, Any] = {
    "_target_": _str_or_none,
    "source": None,  # checked against its own _target_ by _check_target (SOURCE_RULES)
    "image_size": _int(32), "batch_size": _int(1), "eval_batch_size": _int(1, optional=True),
    "num_workers": _int(0), "min_word_count": _int(1), "max_vocab": _int(4, optional=True),
    "max_len": _int(1), "per_caption": _bool, "augment": _bool, "feature_cache": _str_or_none,
    "feature_dtype": _choice("float16", "bfloat16", "float32"), "vocab_file": _str_or_none,
}

# Values of the keys that matter, per ``_target_`` class name; other arguments of the class are allowed.
TRAINER_RULES: dict[str, Rule] = {
    "accelerator": _choice(*ACCELERATORS), "strategy": _strategy, "devices": _devices, "num_nodes": _int(1),
    "precision": lambda key, value: check_choice(key, str(value), PRECISIONS),
    "max_epochs": _int(1), "min_epochs": _int(0, optional=True), "max_steps": _int(-1),
    "gradient_clip_val": _float(0.0, optional=True), "gradient_clip_algorithm": _choice("norm", "value", None),
    "check_val_every_n_epoch": _int(1, optional=True), "val_check_interval": _val_check_interval,
    "num_sanity_val_steps": _int(-1), "log_every_n_steps": _int(1), "accumulate_grad_batches": _int(1),
    "deterministic": _choice(True, False, "warn", None), "benchmark": _choice(True, False, None),
    "fast_dev_run": _bool_or_count, "overfit_batches": _count_or_fraction,
    "limit_train_batches": _count_or_fraction, "limit_val_batches": _count_or_fraction,
    "limit_test_batches": _count_or_fraction, "enable_checkpointing": _bool, "enable_progress_bar": _bool,
    "enable_model_summary": _bool, "sync_batchnorm": _bool, "default_root_dir": _str,
}
CALLBACK_RULES: dict[str, dict[str, Rule]] = {
    "ModelCheckpoint": {
        "dirpath": _str_or_none, "filename": _str_or_none, "monitor": _choice(*MONITORS, None),
        "mode": _choice("min", "max"),
        "save_top_k": _int(-1), "save_last": _choice(True, False, "link", None),
        "every_n_train_steps": _int(0, optional=True), "every_n_epochs": _int(0, optional=True),
        "enable_version_counter": _bool, "auto_insert_metric_name": _bool,
    },
    "EarlyStopping": {"monitor": _choice(*MONITORS), "mode": _choice("min", "max"), "patience": _int(0),
                      "min_delta": _float(0.0)},
    "LearningRateMonitor": {"logging_interval": _choice("step", "epoch", None)},
}
LOGGER_RULES: dict[str, dict[str, Rule]] = {
    "CSVLogger": {"save_dir": _str},
    "TensorBoardLogger": {"save_dir": _str},
    "WandbLogger": {"save_dir": _str, "offline": _bool, "project": _str_or_none, "name": _str_or_none,
                    "id": _str_or_none, "group": _str_or_none, "log_model": _choice(True, False, "all")},
    "MLFlowLogger": {"experiment_name": _str, "run_name": _str_or_none, "tracking_uri": _str_or_none,
                     "artifact_location": _str_or_none, "log_model": _choice(True, False, "all")},
}
# The optional package each logger needs, and the extra of pyproject.toml that installs it.
LOGGER_PACKAGES: dict[str, str] = {"WandbLogger": "wandb", "MLFlowLogger": "mlflow"}
SOURCE_RULES: dict[str, dict[str, Rule]] = {
    "CocoSource": {},  # splits: see _check_coco_splits
    "KarpathySource": {"split_file": _str, "image_root": _str, "restval_as_train": _bool},
    "ShapesSource": {"root": _not_a_file, "n_train": _int(1), "n_val": _int(1), "n_test": _int(1),
                     "image_size": _int(24), "seed": _int(0)},
}


def _check(section: str, schema: dict[str, Any], values: Any) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{section} must be a mapping, got {values!r}")
    for key, value in values.items():
        if key not in schema:
            valid = ", ".join(k for k in schema if k != "_target_")
            raise ConfigError(f"{section}.{key} is not a known key; valid keys: {valid}")
        rule = schema[key]
        if isinstance(rule, dict):
            _check(f"{section}.{key}", rule, value if value is not None else {})
        elif rule is not None:
            rule(f"{section}.{key}", value)


def _target_class(section: str, values: Any) -> type:
    """The class named by ``values["_target_"]``; ConfigError when it is missing or cannot be imported."""
    from hydra.utils import get_class

    if not isinstance(values, dict) or not isinstance(values.get("_target_"), str):
        raise ConfigError(f"{section} must be a mapping with a _target_ (the class to build)")
    try:
        return get_class(values["_target_"])
    except Exception:  # hydra raises ImportError, ValueError or its own errors for a bad path
        raise ConfigError(f"{section}._target_={values['_target_']!r} is not an importable class") from None


def _check_target(section: str, values: Any, rules_by_class: dict[str, dict[str, Rule]],
                  given: tuple[str, ...] = ()) -> type:
    """Refuse keys the ``_target_`` class does not take; apply the rules of its class (or a base class).

    ``given`` are the arguments train.py passes itself (they may not be set in the config).
    """
    cls = _target_class(section, values)
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    valid = [name for name in parameters if name not in ("self", *given)
             and parameters[name].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    rules = next((rules_by_class[base.__name__] for base in cls.__mro__ if base.__name__ in rules_by_class), {})
    for key, value in values.items():
        if key == "_target_":
            continue
        if key in given:
            raise ConfigError(f"{section}.{key} is passed by train.py itself and cannot be set in the config")
        if key not in valid and not takes_any:
            raise ConfigError(f"{section}.{key} is not an argument of {cls.__name__}; valid keys: {', '.join(valid)}")
        if key in rules:
            rules[key](f"{section}.{key}", value)
    return cls


def _check_named(section: str, values: Any, rules_by_class: dict[str, dict[str, Rule]]) -> None:
    """A group of named objects (``callbacks``, ``logger``): each one null or a ``_target_`` mapping."""
    if values is None:
        return
    if not isinstance(values, dict):
        raise ConfigError(f"{section} must be a mapping of names to objects, got {values!r}")
    for name, node in values.items():
        if node is not None:
            _check_target(f"{section}.{name}", node, rules_by_class)


def _check_coco_splits(section: str, splits: Any) -> None:
    if not isinstance(splits, dict) or not {"train", "val"} <= set(splits):
        raise ConfigError(f"{section} must map 'train' and 'val' (and optionally 'test') to their files")
    for split, entry in splits.items():
        check_choice(f"{section} split", split, ("train", "val", "test"))
        _check(f"{section}.{split}", {"captions": _str, "images": _str, "instances": _str_or_none}, entry)
        for key in ("captions", "images"):
            if key not in entry:
                raise ConfigError(f"{section}.{split}.{key} is missing")


def validate_config(cfg: dict[str, Any]) -> None:
    """Raise ConfigError for the first invalid value of a resolved training config (a plain dict)."""
    for key in cfg:
        if key not in TOP_LEVEL:
            raise ConfigError(f"{key} is not a known key; valid top-level keys: {', '.join(TOP_LEVEL)}")
    _check("model", MODEL_SCHEMA, cfg["model"])
    _check("data", DATA_SCHEMA, cfg["data"])
    source = _check_target("data.source", cfg["data"].get("source"), SOURCE_RULES)
    if source.__name__ == "CocoSource":
        _check_coco_splits("data.source.splits", cfg["data"]["source"].get("splits"))
    trainer = cfg["trainer"]
    _check_target("trainer", trainer, {"Trainer": TRAINER_RULES}, given=("callbacks", "logger", "plugins"))
    if trainer.get("min_epochs") is not None and trainer["min_epochs"] > trainer.get("max_epochs", 1):
        raise ConfigError(f"trainer.min_epochs={trainer['min_epochs']} must be <= trainer.max_epochs="
                          f"{trainer.get('max_epochs')}")
    decoding = cfg["model"].get("decoding") or {}
    if {"min_len", "max_len"} <= set(decoding) and decoding["min_len"] >= decoding["max_len"]:
        raise ConfigError(f"model.decoding.min_len={decoding['min_len']} must be < model.decoding.max_len="
                          f"{decoding['max_len']}")
    _check_named("callbacks", cfg.get("callbacks"), CALLBACK_RULES)
    _check_named("logger", cfg.get("logger"), LOGGER_RULES)
    model, data = cfg["model"], cfg["data"]
    if data.get("feature_cache"):
        _not_a_file("data.feature_cache", data["feature_cache"])
    _int(0, 2**32 - 1)("seed", cfg.get("seed", 0))
    _str_or_none("ckpt_path", cfg.get("ckpt_path"))
    _str_or_none("init_from", cfg.get("init_from"))
    scst = model.get("scst") or {}
    if {"baseline", "samples"} <= scst.keys():
        check_scst_samples(scst["baseline"], scst["samples"])
    _bool("train", cfg.get("train", True))
    _bool("test", cfg.get("test", True))


def _require(key: str, path: Any, kind: str, hint: str = DATASET_HELP) -> None:
    """Raise ConfigError naming ``key`` unless ``path`` is an existing ``kind`` ("file" or "folder")."""
    target = Path(path)
    if not target.exists():
        raise ConfigError(f"{key}={str(path)!r}: {kind} not found ({hint})")
    if (kind == "file") != target.is_file():
        raise ConfigError(f"{key}={str(path)!r} is not a {kind}")


def check_environment(cfg: dict[str, Any]) -> None:
    """Raise ConfigError for a file the config needs that is missing, a logger's package that is not
    installed, or an accelerator this machine lacks.

    Dataset files (COCO and Karpathy sources), ``data.vocab_file``, ``ckpt_path`` and ``init_from`` must exist;
    the built-in dataset's root and the feature cache are created on first use.
    """
    source = cfg["data"]["source"]
    name = source["_target_"].rsplit(".", 1)[-1]
    if name == "CocoSource":
        for split, entry in source["splits"].items():
            _require(f"data.source.splits.{split}.captions", entry["captions"], "file")
            _require(f"data.source.splits.{split}.images", entry["images"], "folder")
            if entry.get("instances"):
                _require(f"data.source.splits.{split}.instances", entry["instances"], "file")
    elif name == "KarpathySource":
        _require("data.source.split_file", source["split_file"], "file")
        _require("data.source.image_root", source["image_root"], "folder")
    if cfg["data"].get("vocab_file"):
        _require("data.vocab_file", cfg["data"]["vocab_file"], "file",
                 "a vocabulary JSON file written by Vocabulary.save")
    for name, node in (cfg.get("logger") or {}).items():
        package = LOGGER_PACKAGES.get(node["_target_"].rsplit(".", 1)[-1]) if node else None
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"logger.{name} needs the {package} package, which is not installed: "
                              f"pip install -e \".[{package}]\"")
    for key in ("ckpt_path", "init_from"):
        if cfg.get(key) is not None and not Path(cfg[key]).exists():
            raise ConfigError(f"{key}={cfg[key]!r} does not exist")
    accelerator = cfg["trainer"].get("accelerator", "auto")
    if accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={accelerator!r} but this machine has no usable CUDA GPU; "
                              "use trainer=cpu (or trainer.accelerator=cpu)")
        devices = cfg["trainer"].get("devices")
        if isinstance(devices, int) and devices > torch.cuda.device_count():
            raise ConfigError(f"trainer.devices={devices} but this machine has {torch.cuda.device_count()} GPU(s)")
