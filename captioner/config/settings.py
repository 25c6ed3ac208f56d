"""What every settings dataclass is built with: ``Settings`` (choices by name, range checks on construction),
``from_dict`` (a nested mapping to the dataclass, errors naming the key) and ``to_dict`` (back to plain data)."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from captioner.errors import ConfigError

T = TypeVar("T")


class Settings:
    """What every settings dataclass does when built: a choice given as its name becomes its enum member,
    then ``check`` tests the ranges (ConfigError naming the field)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for item in dataclasses.fields(self):
            kind = hints[item.name]
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                setattr(self, item.name, _convert(kind, getattr(self, item.name), item.name))
        self.check()

    def check(self) -> None:
        """Raise ConfigError for a value out of its range (the field named as ``name=value``)."""


def _convert(kind: Any, value: Any, key: str) -> Any:
    """``value`` as the annotated type ``kind`` (a dataclass from a mapping, an enum from its name)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        kind = next(k for k in options if k is not type(None))
    if dataclasses.is_dataclass(kind):
        return from_dict(kind, {} if value is None else value, key)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        if isinstance(value, kind):
            return value
        if value in kind.__members__:
            return kind[value]
        try:  # by value (reduce-overhead), or an old spelling the enum reads (true/false)
            return kind(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(kind)}") from None
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} must be a string")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def from_dict(cls: type[T], values: Mapping[str, Any] | T, where: str = "") -> T:
    """Build the settings dataclass ``cls`` from a (nested) mapping, or return an instance as it is.

    Missing keys take their defaults. ConfigError for a key ``cls`` has no field for, a value of the
    wrong type or choice, or one out of range; the message names the key under ``where``
    (``from_dict(ModelConfig, cfg, "model")`` -> ``model.decoder.dropout=1.5 must be in [0.0, 0.99]``).
    """
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where or cls.__name__} must be a mapping, got {values!r}")
    prefix = f"{where}." if where else ""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in values if key not in fields]
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]} is not a known key; valid keys: {', '.join(fields)}")
    kwargs = {key: _convert(hints[key], value, f"{prefix}{key}") for key, value in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}") from None


def to_dict(settings: Any) -> dict[str, Any]:
    """A settings dataclass as plain data (enums as their names): what YAML, checkpoints and bundles hold."""
    return dataclasses.asdict(settings, dict_factory=_plain_items)


def _plain_items(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: (value.value if isinstance(value, enum.Enum) else value) for key, value in items}
