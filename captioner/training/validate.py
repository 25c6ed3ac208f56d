"""Check a composed training config before any work starts.

Each rule names the key it checks; the first violation raises ``ConfigError`` with the key, the bad value
and the valid values. Unknown keys inside the checked sections are refused too (a typo is never ignored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from captioner.errors import ConfigError, check_choice, check_range
from captioner.model.attention import ATTENTION_TYPES

PRECISIONS = ("32-true", "32", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "transformer-engine")
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "auto")

Rule = Callable[[str, Any], None]


def _choice(*choices: Any) -> Rule:
    return lambda key, value: check_choice(key, value, choices)


def _int(low: int | None = None, high: int | None = None, optional: bool = False) -> Rule:
    def rule(key: str, value: Any) -> None:
        if value is None and optional:
            return
        check_range(key, value, low, high, kind=int)
    return rule


def _float(low: float | None = None, high: float | None = None) -> Rule:
    return lambda key, value: check_range(key, value, low, high)


def _bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")


def _str_or_none(key: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} must be a string or null")


def _encoder_name(key: str, value: Any) -> None:
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if value not in names:
        raise ConfigError(f"{key}={value!r} is not a torchvision classification model; choose one of: "
                          f"{', '.join(n for n in names if not n.startswith(('vit', 'swin', 'maxvit')))}")


MODEL_SCHEMA: dict[str, Any] = {
    "_target_": _str_or_none,
    "attention": _choice("soft", "hard"),
    "scorer": _choice(*ATTENTION_TYPES),
    "encoder": {
        "name": _encoder_name,
        "weights": _str_or_none,
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
    },
    "loss": {"ds_lambda": _float(0.0), "reinforce_weight": _float(0.0), "entropy_weight": _float(0.0),
             "baseline_decay": _float(0.0, 1.0)},
    "optimizer": {"lr": _float(1e-12), "encoder_lr": _float(0.0), "weight_decay": _float(0.0)},
    "scheduler": {"name": _choice("cosine", "step", "none"), "warmup_steps": _int(0),
                  "step_size": _int(1), "gamma": _float(0.0, 1.0)},
    "decoding": {"method": _choice("greedy", "beam", "sample"), "beam_size": _int(1), "max_len": _int(1),
                 "length_penalty": _float(0.0), "temperature": _float(1e-6)},
    "compile": _bool,
    "nonfinite": _choice("stop", "skip"),
}

DATA_SCHEMA: dict[str, Any] = {
    "_target_": _str_or_none,
    "source": None,  # checked by the source itself (paths must exist) in prepare()
    "image_size": _int(32), "batch_size": _int(1), "eval_batch_size": _int(1, optional=True),
    "num_workers": _int(0), "min_word_count": _int(1), "max_vocab": _int(4, optional=True),
    "max_len": _int(1), "per_caption": _bool, "augment": _bool, "feature_cache": _str_or_none,
    "feature_dtype": _choice("float16", "bfloat16", "float32"), "vocab_file": _str_or_none,
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


def validate_config(cfg: dict[str, Any]) -> None:
    """Raise ConfigError for the first invalid value of a resolved training config (a plain dict)."""
    _check("model", MODEL_SCHEMA, cfg["model"])
    _check("data", DATA_SCHEMA, cfg["data"])
    model, data, trainer = cfg["model"], cfg["data"], cfg["trainer"]
    if data.get("feature_cache") and model["encoder"].get("trainable_stages", 0) != 0:
        raise ConfigError("data.feature_cache needs a frozen encoder: set model.encoder.trainable_stages=0 "
                          "or data.feature_cache=null")
    check_choice("trainer.precision", str(trainer.get("precision", "32-true")), PRECISIONS)
    check_choice("trainer.accelerator", trainer.get("accelerator", "auto"), ACCELERATORS)
    _int(1)("trainer.max_epochs", trainer.get("max_epochs", 1))
    _int()("seed", cfg.get("seed", 0))
    if cfg.get("ckpt_path") is not None and not Path(cfg["ckpt_path"]).exists():
        raise ConfigError(f"ckpt_path={cfg['ckpt_path']!r} does not exist")
