"""Check a composed training config before any work starts: what its schema cannot say.

Every key's type, choice and range is the schema's (``captioner.config``: Hydra refuses an unknown key or
a value of the wrong type when it composes the config, ``validate_config`` builds the typed settings and so
runs their range checks). What is left here: rules across sections (a metric to monitor must be one the
module logs), the few trainer values Lightning accepts without a word (``max_epochs=0`` trains nothing),
and ``check_environment``: the files the config names, the loggers' packages and the accelerator.
Lightning checks the rest of the trainer's, callbacks' and loggers' arguments when ``train.py`` builds them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from captioner.config import TrainConfig, from_dict
from captioner.data.sources import Source
from captioner.errors import ConfigError, check_choice, check_range
from captioner.training.metrics import MONITORS  # what CaptionerModule logs, so what a callback can monitor

# The optional package each logger needs, and the extra of pyproject.toml that installs it.
LOGGER_PACKAGES: dict[str, str] = {"WandbLogger": "wandb", "MLFlowLogger": "mlflow"}


def _check_trainer(trainer: dict[str, Any]) -> None:
    """Trainer values Lightning takes without complaint but that make a run do nothing or the wrong thing."""
    for key in ("callbacks", "logger", "plugins"):
        if key in trainer:
            raise ConfigError(
                f"trainer.{key} is passed by train.py itself (from the {key} section) and cannot "
                "be set in the trainer config"
            )
    if trainer.get("max_epochs") is not None:
        check_range("trainer.max_epochs", trainer["max_epochs"], 1, kind=int)
    if trainer.get("gradient_clip_val") is not None:
        check_range("trainer.gradient_clip_val", trainer["gradient_clip_val"], 0.0)
    if trainer.get("min_epochs") is not None and trainer["min_epochs"] > trainer.get("max_epochs", 1):
        raise ConfigError(
            f"trainer.min_epochs={trainer['min_epochs']} must be <= trainer.max_epochs={trainer.get('max_epochs')}"
        )


def _check_monitors(callbacks: dict[str, Any] | None) -> None:
    """A callback's ``monitor`` must name a metric the module logs (Lightning finds out only after an epoch)."""
    for name, node in (callbacks or {}).items():
        if isinstance(node, dict) and "monitor" in node:
            allowed = MONITORS if node["_target_"].endswith("EarlyStopping") else (*MONITORS, None)
            check_choice(f"callbacks.{name}.monitor", node["monitor"], allowed)


def validate_config(cfg: dict[str, Any]) -> TrainConfig:
    """The typed settings of a resolved training config (a plain dict); ConfigError for the first invalid value."""
    settings = from_dict(TrainConfig, cfg)
    _check_trainer(cfg.get("trainer") or {})
    _check_monitors(cfg.get("callbacks"))
    cache = settings.data.feature_cache
    if cache and Path(cache).exists() and not Path(cache).is_dir():
        raise ConfigError(f"data.feature_cache={cache!r} is a file, not a folder")
    return settings


def check_environment(cfg: dict[str, Any], source: Source) -> None:
    """Raise ConfigError for a file the config needs that is missing, a logger's package that is not
    installed, or an accelerator this machine lacks.

    The dataset ``source`` checks its own files; ``data.vocab_file``, ``ckpt_path`` and ``init_from`` must
    exist; the feature cache is created on first use.
    """
    source.check_files()
    vocab_file = cfg["data"].get("vocab_file")
    if vocab_file and not Path(vocab_file).is_file():
        raise ConfigError(
            f"data.vocab_file={vocab_file!r}: file not found (a vocabulary JSON file written by Vocabulary.save)"
        )
    for name, node in (cfg.get("logger") or {}).items():
        package = LOGGER_PACKAGES.get(node["_target_"].rsplit(".", 1)[-1]) if node else None
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f'logger.{name} needs the {package} package, which is not installed: pip install -e ".[{package}]"'
            )
    for key in ("ckpt_path", "init_from"):
        if cfg.get(key) is not None and not Path(cfg[key]).exists():
            raise ConfigError(f"{key}={cfg[key]!r} does not exist")
    accelerator = cfg["trainer"].get("accelerator", "auto")
    if accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"trainer.accelerator={accelerator!r} but this machine has no usable CUDA GPU; "
                "use trainer=cpu (or trainer.accelerator=cpu)"
            )
        devices = cfg["trainer"].get("devices")
        if isinstance(devices, int) and devices > torch.cuda.device_count():
            raise ConfigError(f"trainer.devices={devices} but this machine has {torch.cuda.device_count()} GPU(s)")
