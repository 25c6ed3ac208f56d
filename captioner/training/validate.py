"""Check a composed training config before any work starts, and say in one line what is wrong with it.

Every key's type, choice and range is the schema's (``captioner.config``: Hydra refuses an unknown key or
a value of the wrong type when it composes the config, ``validate_config`` builds the typed settings and so
runs their range checks). What is left here: rules across sections (a metric to monitor must be one the
module logs), the few trainer values Lightning accepts without a word (``max_epochs=0`` trains nothing),
and ``check_environment``: the files the config names, the loggers' packages and the accelerator.
Lightning checks the rest of the trainer's, callbacks' and loggers' arguments when ``train.py`` builds them.

``ValidateConfig`` (a Hydra callback, listed first in ``conf/hydra/default.yaml``) runs ``validate_config`` as
soon as Hydra has composed the config: a wrong value stops the run before its folder exists, before the config
is printed and before torch is imported. ``error_line`` and ``section_error`` turn Hydra's, OmegaConf's and the
instantiated classes' errors into the one line ``train.py`` prints.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib.util
import re
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from captioner.config import TrainConfig, from_dict
from captioner.errors import CaptionerError, ConfigError, check_choice, check_range, first_line
from captioner.training.metrics import MONITORS  # what CaptionerModule logs, so what a callback can monitor

if TYPE_CHECKING:  # the sources import torch: not needed to check a config
    from captioner.data.sources import Source

# The start of a message about a key: ``encoder.weights='x' ...`` or ``decoder.foo is not a known key``.
_KEY = re.compile(r"[A-Za-z_][\w.]*(=| is )")
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


class ValidateConfig(Callback):
    """Hydra callback: ``validate_config`` on the composed config before anything else happens.

    A single run is checked in ``on_run_start``, before its folder is created (``NewRunFolder``, the next
    callback) and before the config is printed; each job of a sweep (``-m``) is checked as it starts, since
    its overrides are applied only then. Hydra turns a callback's exception into a warning and goes on, so
    a wrong value (or an interpolation that cannot be resolved) is printed here as ``error: ...`` on stderr
    and the process exits with status 2.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Check the config of a single run."""
        _validate_or_exit(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Check the config of one job of a sweep."""
        if config.hydra.mode == RunMode.MULTIRUN:
            _validate_or_exit(config)


def _validate_or_exit(config: DictConfig) -> None:
    """``validate_config`` of the job's config; one line on stderr and exit status 2 when it is wrong."""
    try:
        validate_config(_job_config(config))
    except CaptionerError as exc:
        message = str(exc)
    except OmegaConfBaseException as exc:
        message = error_line(exc)
    else:
        return
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _job_config(config: DictConfig) -> dict[str, Any]:
    """The config the training function will get (without the ``hydra`` node), resolved to plain data.

    Before a run starts Hydra has not named its output folder yet: ``hydra.runtime.output_dir`` (which
    ``paths.output_dir`` names) is taken to be the folder the run asks for.
    """
    config = copy.deepcopy(config)
    if OmegaConf.is_missing(config.hydra.runtime, "output_dir"):
        probe = copy.deepcopy(config)
        HydraConfig.instance().set_config(probe)  # resolves ${hydra:...} in the run folder's name
        with open_dict(config):
            config.hydra.runtime.output_dir = probe.hydra.run.dir
    HydraConfig.instance().set_config(config)
    config = OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
    return OmegaConf.to_container(config, resolve=True, enum_to_str=True)


def error_line(exc: BaseException) -> str:
    """A Hydra or OmegaConf error (an unknown key or option, a bad override or value) as one line, from the
    exception's type and fields; a CaptionerError that Hydra wrapped as its own message."""
    if isinstance(exc.__cause__, CaptionerError):
        return str(exc.__cause__)
    schema = exc.object_type if dataclasses.is_dataclass(getattr(exc, "object_type", None)) else None
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)) and schema is not None:
        fields = [f.name for f in dataclasses.fields(schema) if f.name != "_target_"]
        return f"{exc.full_key} is not a known key; valid keys: {', '.join(fields)}"
    if isinstance(exc, ValidationError) and schema is not None and exc.key in typing.get_type_hints(schema):
        kind = typing.get_type_hints(schema)[exc.key]
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return f"{exc.full_key}={exc.value!r} is not valid; choose one of: {', '.join(kind.__members__)}"
        if kind is bool:
            return f"{exc.full_key}={exc.value!r} must be true or false"
        return f"{exc.full_key}={exc.value!r} must be {getattr(kind, '__name__', kind)}"
    if isinstance(exc, OmegaConfBaseException):
        return f"{exc.full_key}: {first_line(exc)}" if exc.full_key else first_line(exc)
    if isinstance(exc, MissingConfigException):
        options = f"; choose one of: {', '.join(exc.options)}" if exc.options else ""
        return f"no config {exc.missing_cfg_file!r}{options}"
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the override {exc.override!r}: {first_line(exc)}"
    if isinstance(exc, ConfigCompositionException):  # Hydra raises it while handling OmegaConf's error
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OmegaConfBaseException):
            return error_line(cause)
    return first_line(exc)


def section_error(section: str, error: BaseException, message: str) -> ConfigError:
    """The ConfigError for an object of config ``section`` that could not be built: ``error`` said ``message``.

    This project's own messages start with the key they are about: a key inside ``section``
    (``encoder.weights=...`` of ``model``) gets the section in front, one that already names it is kept; any
    other message (Lightning's, a class's TypeError, one of ours about no key) follows ``section: ``.
    """
    if isinstance(error, CaptionerError) and message.startswith(f"{section}."):
        return ConfigError(message)
    if isinstance(error, CaptionerError) and _KEY.match(message):
        return ConfigError(f"{section}.{message}")
    return ConfigError(f"{section}: {message}")
