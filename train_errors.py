"""What ``train.py`` prints when a config cannot be composed or used: Hydra's, OmegaConf's and the instantiated
classes' errors as one line ``error: ...`` that names the key, the valid keys or values and the nearest match."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from captioner.errors import CaptionerError, ConfigError, first_line

# The start of a message about a key: ``encoder.weights='x' ...`` or ``decoder.foo is not a known key``.
_KEY = re.compile(r"[A-Za-z_][\w.]*(=| is )")
CONF = Path(__file__).resolve().parent / "conf"
# Options that other options of their group start from, never chosen themselves: hidden from the choices.
INTERNAL_OPTIONS = {"data": ("base",), "model": ("base",), "trainer": ("default",)}


def group_options(group: str) -> list[str]:
    """The options a user may choose in config group ``group`` (``conf/<group>/*.yaml``, internal ones left out)."""
    hidden = INTERNAL_OPTIONS.get(group, ())
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if p.stem not in hidden)


def groups() -> list[str]:
    """The config groups a user selects (``conf/<group>/``; Hydra's own settings left out)."""
    return sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")


def nearest(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the choice closest to ``word``, or "" when none is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def refused_override(overrides: Sequence[str]) -> str | None:
    """The error line for a command-line override that chooses an internal option (``data=base``), or None."""
    for override in overrides:
        group, _, option = override.lstrip("+~").partition("=")
        if option in INTERNAL_OPTIONS.get(group, ()):
            return f"{group}={option} is not an option of its own (the others start from it); choose one of: " + (
                ", ".join(group_options(group))
            )
    return None


def _unknown_key(exc: ConfigKeyError | ConfigAttributeError, schema: type | None) -> str:
    """``trainer.foo is not a known key; valid keys: ...; did you mean ...?`` from the node the key was looked up
    in (its schema's fields, or the keys it holds), with the config groups at the top level."""
    parent = getattr(exc, "parent_node", None)
    if schema is not None:
        keys = [f.name for f in dataclasses.fields(schema)]
    else:
        keys = list(parent.keys()) if parent is not None else []
    keys = [key for key in keys if key not in ("_target_", "hydra")]
    if "." not in exc.full_key:
        keys = sorted({*keys, *groups()})
    prefix = exc.full_key.rpartition(".")[0]
    match = nearest(str(exc.key), keys)
    if match and prefix:
        match = match.replace("mean ", f"mean {prefix}.")
    line = f"{exc.full_key} is not a known key; valid keys: {', '.join(keys)}{match}"
    if schema is None and prefix:
        line += f" (a key the config does not set is added with +{exc.full_key}=VALUE)"
    return line


def error_line(exc: BaseException) -> str:
    """A Hydra or OmegaConf error (an unknown key or option, a bad override or value) as one line, from the
    exception's type and fields; a CaptionerError that Hydra wrapped as its own message."""
    if isinstance(exc, CaptionerError):
        return str(exc)
    if isinstance(exc.__cause__, CaptionerError):
        return str(exc.__cause__)
    schema = exc.object_type if dataclasses.is_dataclass(getattr(exc, "object_type", None)) else None
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)) and exc.full_key:
        return _unknown_key(exc, schema)
    if isinstance(exc, ValidationError) and schema is not None and exc.key in typing.get_type_hints(schema):
        kind = typing.get_type_hints(schema)[exc.key]
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return f"{exc.full_key}={exc.value!r} is not valid; choose one of: {', '.join(kind.__members__)}"
        if kind is bool:
            return f"{exc.full_key}={exc.value!r} must be true or false"
        name = {int: "an int", float: "a float", str: "a string"}.get(kind, getattr(kind, "__name__", kind))
        return f"{exc.full_key}={exc.value!r} must be {name}"
    if isinstance(exc, OmegaConfBaseException):
        return f"{exc.full_key}: {first_line(exc)}" if exc.full_key else first_line(exc)
    if isinstance(exc, MissingConfigException):
        group, _, option = exc.missing_cfg_file.rpartition("/")
        choices = [o for o in exc.options or () if o not in INTERNAL_OPTIONS.get(group, ())]
        if not choices:
            return f"no config {exc.missing_cfg_file!r}"
        return f"{group}={option} is not an option; choose one of: {', '.join(choices)}{nearest(option, choices)}"
    if isinstance(exc, OverrideParseException):
        if "=" not in exc.override:
            key = exc.override.lstrip("+~")
            return f"the override {exc.override!r} has no value: write {key}=VALUE (or ~{key} to remove the key)"
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
