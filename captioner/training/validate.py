"""Check a composed training config before any work starts.

Every key's type, choice and range is the schema's (``captioner.config``: Hydra refuses an unknown key or
a value of the wrong type when it composes the config, ``validate_config`` builds the typed settings and so
runs their range checks). What is left here: rules across sections (a metric to monitor must be one the
module logs, a schedule needs a run of known length: ``ModelConfig.unscheduled``) and the trainer values
Lightning accepts without a word (``max_epochs=0`` trains nothing, ``check_val_every_n_epoch=0`` divides by zero
once the run has started: ``TRAINER_LEAST``).
The names of the trainer's, callbacks' and loggers' arguments, and the types of their values, are checked against
their classes' signatures (``check_arguments``: ``+trainer.limit_train_batch=2`` is refused, naming
``trainer.limit_train_batches``; ``trainer.precision=17`` lists the precisions the trainer takes); the files and
devices the config needs are ``training/preflight.py``'s (the accelerator's and strategy's names and the CPU's
devices are checked here). Lightning checks the rest of their values when ``train.py`` builds them
(``+trainer.max_time=soon``): those stop the run once its folder exists, marked FAILED.

``ValidateConfig`` (a Hydra callback, listed first in ``conf/hydra/default.yaml``) runs ``check_run`` (the values,
then the preflight) as soon as Hydra has composed the config: a wrong value or a missing file stops the run before
its folder exists, a wrong value before the config is printed and before torch is imported. ``train.py`` says
what stopped it (``training/command_line.py`` turns Hydra's and OmegaConf's errors into one line), and runs
``check_run`` itself first thing in each job of a sweep.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import types
import typing
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from captioner.config import Objective, TrainConfig, from_dict
from captioner.errors import CaptionerError, ConfigError, check_choice, check_range, first_line
from captioner.training.command_line import nearest
from captioner.training.metrics import MONITORS  # what CaptionerModule logs, so what a callback can monitor
from captioner.training.run_folder import first_process

RUN_FOLDER = "${hydra:runtime.output_dir}"  # paths.output_dir as conf/paths writes it: the folder NewRunFolder makes
STREAMED = "captioner.data.shards.WebDatasetSource"  # the source whose training split streams (data=webdataset)


# The least value of trainer arguments that Lightning takes without complaint, below which a run trains nothing
# (max_epochs=0), fails with a traceback once it runs (check_val_every_n_epoch=0, accumulate_grad_batches=0: a
# division by zero) or does something no one asks for (log_every_n_steps=-1 logs every step).
TRAINER_LEAST = {
    "max_epochs": 1,
    "min_epochs": 0,
    "min_steps": 0,
    "check_val_every_n_epoch": 1,
    "accumulate_grad_batches": 1,
    "log_every_n_steps": 0,  # 0: never
    "num_sanity_val_steps": -1,  # -1: the whole validation split
}


def _check_trainer(trainer: dict[str, Any]) -> None:
    """Trainer values Lightning takes without complaint but that make a run do nothing, the wrong thing, or fail
    with a traceback once it runs."""
    for key in ("callbacks", "logger", "plugins"):
        if key in trainer:
            raise ConfigError(
                f"trainer.{key} is passed by train.py itself (from the {key} section) and cannot "
                "be set in the trainer config"
            )
    for key, low in TRAINER_LEAST.items():
        if trainer.get(key) is not None:
            check_range(f"trainer.{key}", trainer[key], low, kind=int)
    if trainer.get("max_steps") not in (None, -1):
        check_range("trainer.max_steps", trainer["max_steps"], kind=int)
        if trainer["max_steps"] < 1:
            raise ConfigError(f"trainer.max_steps={trainer['max_steps']} must be -1 (no limit) or >= 1")
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float) and not 0.0 < interval <= 1.0:
        raise ConfigError(
            f"trainer.val_check_interval={interval!r} must be in (0.0, 1.0] (a fraction of an epoch) or an int >= 1 "
            "(training batches)"
        )
    if isinstance(interval, int) and not isinstance(interval, bool):
        check_range("trainer.val_check_interval", interval, 1, kind=int)
    if trainer.get("gradient_clip_val") is not None:
        check_range("trainer.gradient_clip_val", trainer["gradient_clip_val"], 0.0)
    max_epochs = trainer.get("max_epochs")
    if trainer.get("min_epochs") is not None and max_epochs is not None and trainer["min_epochs"] > max_epochs:
        raise ConfigError(
            f"trainer.min_epochs={trainer['min_epochs']} must be <= trainer.max_epochs={trainer.get('max_epochs')}"
        )


def _check_callbacks(callbacks: dict[str, Any] | None) -> None:
    """Each callback names the class to build, and its ``monitor`` a metric the module logs (Lightning finds out
    only after an epoch)."""
    for name, node in (callbacks or {}).items():
        if isinstance(node, dict) and not isinstance(node.get("_target_"), str):
            raise ConfigError(f"callbacks.{name} has no _target_ (the class to build)")
        if isinstance(node, dict) and "monitor" in node:
            allowed = MONITORS if node["_target_"].endswith("EarlyStopping") else (*MONITORS, None)
            check_choice(f"callbacks.{name}.monitor", node["monitor"], allowed)


def _check_stream(settings: TrainConfig) -> None:
    """A training split streamed from shards has no list of images: no item per caption, no feature cache, no
    references for self-critical training."""
    source = settings.data.source
    if not isinstance(source, dict) or source.get("_target_") != STREAMED:
        return
    if settings.data.per_caption or settings.data.feature_cache is not None:
        raise ConfigError("data=webdataset streams whole images: set data.per_caption=false data.feature_cache=null")
    if settings.model.objective == Objective.scst:
        raise ConfigError(
            "model.objective=scst needs every training caption as a reference, which data=webdataset does not "
            "hold: train with model.objective=cross_entropy"
        )


def validate_config(cfg: dict[str, Any]) -> TrainConfig:
    """The typed settings of a resolved training config (a plain dict); ConfigError for the first invalid value."""
    settings = from_dict(TrainConfig, cfg)
    trainer = cfg.get("trainer") or {}
    _check_trainer(trainer)
    if (problem := settings.model.unscheduled(trainer.get("max_epochs"), trainer.get("max_steps"))) is not None:
        raise ConfigError(problem)
    _check_callbacks(cfg.get("callbacks"))
    _check_stream(settings)
    cache = settings.data.feature_cache
    if cache and Path(cache).exists() and not Path(cache).is_dir():
        raise ConfigError(f"data.feature_cache={cache!r} is a file, not a folder")
    return settings


def _target(key: str, target: str) -> Any:
    """The class (or function) that the ``_target_`` of config node ``key`` names; ConfigError when it cannot be
    imported."""
    module_name, _, name = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"{key}._target_={target!r} is not a dotted path to a class (package.module.Class)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}._target_={target!r} cannot be imported: {first_line(exc)}") from None
    if not hasattr(module, name):
        raise ConfigError(f"{key}._target_={target!r}: {module_name} has no {name}{nearest(name, dir(module))}")
    return getattr(module, name)


def _functions(target: Any) -> list[Any]:
    """What builds ``target``: each constructor of a class's classes, most derived first (object's left out), or
    the function itself."""
    if isinstance(target, type):
        return [vars(c)["__init__"] for c in target.__mro__[:-1] if "__init__" in vars(c)]
    return [target]


def _keywords(target: Any) -> list[str] | None:
    """The keyword arguments that ``target`` (a class or a function) takes; None when it takes any (``**kwargs``).
    A constructor that takes nothing but ``*args, **kwargs`` passes them on: its base class's are taken; one that
    hands its other keywords to a known class (``_passed_on``) takes its own and that class's."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for function in _functions(target):
        parameters = list(inspect.signature(function).parameters.values())[isinstance(target, type) :]  # no self
        kinds = {parameter.kind for parameter in parameters}
        if kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
            continue
        own = [parameter.name for parameter in parameters if parameter.kind in named]
        if inspect.Parameter.VAR_KEYWORD in kinds:
            passed_on = _passed_on(target)
            return None if passed_on is None else [*own, *passed_on]
        return own
    return None


def _passed_on(target: Any) -> list[str] | None:
    """The keywords that ``target`` hands on to a class it builds, where that is known (None elsewhere): Lightning's
    TensorBoard loggers build a SummaryWriter with theirs (torch's when tensorboard is installed, as Lightning
    picks it, else tensorboardX's), giving its ``log_dir`` themselves."""
    from lightning.fabric.loggers import TensorBoardLogger

    if not (isinstance(target, type) and issubclass(target, TensorBoardLogger)):
        return None
    if importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter
    else:
        from tensorboardX import SummaryWriter
    return [name for name in _keywords(SummaryWriter) or [] if name != "log_dir"]


def _annotations(target: Any) -> dict[str, Any]:
    """The annotated type of each keyword that ``target``'s constructors (or the function) name, the most derived
    first; a constructor whose annotations cannot be resolved gives none."""
    found: dict[str, Any] = {}
    for function in _functions(target):
        try:
            hints = typing.get_type_hints(function)
        except Exception:  # noqa: BLE001 - a name its module imports only for type checkers: nothing to check
            continue
        for name, kind in hints.items():
            found.setdefault(name, kind)
    return found


def _accepts(kind: Any, value: Any) -> bool:
    """Whether ``value`` (plain config data) is of the annotated type ``kind``: bool, int (not a bool), float (an
    int too), str, None, a Literal's values, each member of a Union; a list or dict by its container only; any
    other class only by an instance of it (a config gives one as a ``_target_`` node, which is not checked)."""
    origin = typing.get_origin(kind)
    if kind is Any or isinstance(kind, typing.TypeVar):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(member, value) for member in typing.get_args(kind))
    if origin is typing.Literal:
        return any(value == option and type(value) is type(option) for option in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    kind = origin or kind
    return not isinstance(kind, type) or isinstance(value, kind)


def _described(kind: Any) -> list[str]:
    """What ``_accepts`` takes for ``kind``, in words: ``["an int", "null"]``, a Literal's values as they are."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return [word for member in typing.get_args(kind) for word in _described(member)]
    if origin is typing.Literal:
        return [str(option) for option in typing.get_args(kind)]
    words = {type(None): ["null"], bool: ["true", "false"], int: ["an int"], float: ["a number"], str: ["a string"]}
    if kind in words:
        return words[kind]
    name = getattr(origin or kind, "__name__", str(kind))
    return [f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"]


def _check_types(key: str, node: dict[str, Any], target: Any) -> None:
    """ConfigError for the first argument in ``node`` whose value is not of the type ``target`` annotates it with
    (``trainer.detect_anomaly='maybe' must be true or false``); a ``_target_`` node is an object Hydra builds."""
    annotations = _annotations(target)
    for name, value in node.items():
        if name not in annotations or (isinstance(value, dict) and "_target_" in value):
            continue
        if not _accepts(annotations[name], value):
            words = list(dict.fromkeys(_described(annotations[name])))
            expected = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
            raise ConfigError(f"{key}.{name}={value!r} must be {expected}")


def _check_hardware(trainer: dict[str, Any]) -> None:
    """The trainer's accelerator and strategy by the names Lightning's registries hold, and its devices on the CPU
    by Lightning's parser: values it would refuse only as ``train.py`` builds the trainer. Devices on a GPU are the
    preflight's, which knows the machine's GPUs."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.accelerators import AcceleratorRegistry, CPUAccelerator
    from lightning.pytorch.strategies import StrategyRegistry

    accelerator, strategy = trainer.get("accelerator", "auto"), trainer.get("strategy", "auto")
    if isinstance(accelerator, str):
        check_choice("trainer.accelerator", accelerator, ["auto", "gpu", *AcceleratorRegistry.available_accelerators()])
    strategies = StrategyRegistry.available_strategies()
    if isinstance(strategy, str) and strategy.lower() not in ("auto", *strategies):
        raise ConfigError(
            f"trainer.strategy={strategy!r} is not a strategy Lightning knows{nearest(strategy, strategies)}; for "
            "example auto, ddp, ddp_spawn, fsdp or deepspeed"
        )
    if accelerator == "cpu" and trainer.get("devices", "auto") != "auto":
        try:
            CPUAccelerator.parse_devices(trainer["devices"])
        except (MisconfigurationException, TypeError, ValueError) as exc:  # TypeError: not a number
            raise ConfigError(f"trainer.devices={trainer['devices']!r}: {first_line(exc)}") from None


def check_arguments(cfg: dict[str, Any]) -> None:
    """Each argument that a resolved training config gives the trainer, a callback or a logger is one its class
    takes (their signatures: Lightning's ``Trainer`` and the rest), of the type its constructor annotates;
    ConfigError naming the nearest one, or the types it takes. Built by ``train.py`` only once the run has
    started, the class would refuse it after the run's folder is made, or fail with a traceback as it runs."""
    nodes = [("trainer", cfg.get("trainer"))]
    for section in ("callbacks", "logger"):
        nodes += [(f"{section}.{name}", node) for name, node in (cfg.get(section) or {}).items()]
    for key, node in nodes:
        if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
            continue
        target = _target(key, node["_target_"])
        taken = _keywords(target)
        given = [name for name in node if not (name.startswith("_") and name.endswith("_"))]  # Hydra's own keys
        unknown = [name for name in given if taken is not None and name not in taken]
        if unknown:
            match = nearest(unknown[0], taken, f"{key}.")
            valid = match or f"; it takes: {', '.join(taken)}"
            raise ConfigError(f"{key}.{unknown[0]} is not an argument of {node['_target_']}{valid}")
        _check_types(key, {name: node[name] for name in given}, target)
    _check_hardware(cfg.get("trainer") or {})


def check_run(cfg: dict[str, Any]) -> None:
    """``validate_config`` of a resolved training config, ``check_arguments``, then (in the process that starts the
    run) ``preflight.check``: ConfigError with the first invalid value, or preflight's error with every problem; a
    check that fails in a way it does not expect is a ConfigError too, naming the error (as preflight's own checks
    are), never a traceback."""
    try:
        validate_config(cfg)
        check_arguments(cfg)  # imports Lightning (and torch): once the values are valid
        if first_process():
            from captioner.training import preflight  # reads datasets and imports torch: once the values are valid

            preflight.check(cfg)
    except (CaptionerError, OmegaConfBaseException):
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a check stops the run with one line
        raise ConfigError(f"the config could not be checked: {first_line(exc, with_type=True)}") from None


class ValidateConfig(Callback):
    """Hydra callback: ``check_run`` on the composed config of a single run before anything else happens.

    The run is checked in ``on_run_start``, before its folder is created (``NewRunFolder``, the next callback)
    and before the config is printed. Hydra turns a callback's exception into a warning and goes on, so a
    wrong value (or an interpolation that cannot be resolved) is raised as ConfigRefused, which Hydra lets
    through and ``train.py`` prints as ``error: ...`` on stderr, exit status 2. Each job of a sweep (``-m``)
    gets its overrides, and its folder, only as it starts, maybe in a process of its own (``hydra/launcher=
    local`` or ``slurm``) where an exit would lose the error: ``train.py`` checks it first thing, and a
    refused job fails as a job that stops does (its folder marked, the sweep's process reporting it).
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Check the config of a single run."""
        _validate_or_exit(config)


class ConfigRefused(SystemExit):
    """The error that stops a run before it starts (a wrong value, a config that does not resolve, what preflight
    found), carried past Hydra, which turns a callback's Exception into a warning; ``train.py`` prints it.

    A SystemExit with status 2: uncaught, the process still ends with that status."""

    def __init__(self, error: Exception) -> None:
        super().__init__(2)
        self.error = error


def _validate_or_exit(config: DictConfig) -> None:
    """``check_run`` of the run's config; ConfigRefused with its error (never a traceback that Hydra turns into a
    warning before the run's folder is made)."""
    try:
        check_run(_job_config(config))
    except (CaptionerError, OmegaConfBaseException) as exc:
        raise ConfigRefused(exc) from None


def _job_config(config: DictConfig) -> dict[str, Any]:
    """The config the training function will get (without the ``hydra`` node), resolved to plain data; ConfigError
    for a ``paths.output_dir`` given (``NewRunFolder`` makes the run's folder new: ``hydra.run.dir`` chooses it).

    Before a run starts Hydra has not named its output folder yet: ``hydra.runtime.output_dir`` (which
    ``paths.output_dir`` names) is taken to be the folder the run asks for.
    """
    config = copy.deepcopy(config)
    if OmegaConf.to_container(config.paths)["output_dir"] != RUN_FOLDER:
        raise ConfigError(
            f"paths.output_dir={config.paths.output_dir!r}: it is the run's own folder, made new for each run (an "
            "earlier run's is never written into); choose where it goes with hydra.run.dir=DIR"
        )
    if OmegaConf.is_missing(config.hydra.runtime, "output_dir"):
        probe = copy.deepcopy(config)
        HydraConfig.instance().set_config(probe)  # resolves ${hydra:...} in the run folder's name
        with open_dict(config):
            config.hydra.runtime.output_dir = probe.hydra.run.dir
    HydraConfig.instance().set_config(config)
    config = OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
    return OmegaConf.to_container(config, resolve=True, enum_to_str=True)
