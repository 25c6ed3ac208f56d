"""The bundle format's versions: what each one added to the model config, and the reading of a config of any
version as the current ``NetConfig``.

Version 1 stored the network in its own layout (``captioner.bundle_v1`` turns it into version 2's); version 2
stores ``NetConfig``'s serialisation. Each later version added keys to it, listed in ``ADDED_KEYS`` with what
their absence means in a file written before them: the behaviour of those files, never today's default. A field
added to ``NetConfig`` is one more line there; ``BUNDLE_VERSION``, the version written, follows from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from captioner.bundle_v1 import upgrade_v1
from captioner.config import NetConfig, from_dict

# For each version after 2, the keys it added to the model config (dotted: "decoder.<field>"), each with the value
# that its absence from a file of an earlier version means.
ADDED_KEYS: Mapping[int, Mapping[str, Any]] = MappingProxyType(
    {
        3: MappingProxyType({"decoder.hard_expectation_warmup": 0.0}),  # training only: the mix from the first step
    }
)
BUNDLE_VERSION = max(ADDED_KEYS)  # the format written; every earlier one is read


def _with_absent(config: Mapping[str, Any], absent: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a nested mapping) with the dotted keys of ``absent`` it lacks set to their values; a section
    that is not a mapping is left for ``from_dict`` to name."""
    filled = dict(config)
    for dotted, value in absent.items():
        *sections, key = dotted.split(".")
        node = filled
        for section in sections:
            inner = node.get(section)
            if inner is None:
                inner = {}
            elif not isinstance(inner, Mapping):
                break
            node[section] = node = dict(inner)
        else:
            node.setdefault(key, value)
    return filled


def read_net(config: object, version: int) -> NetConfig:
    """The ``NetConfig`` of the model config of a bundle (or a training checkpoint) of format ``version``.

    Version 1's layout goes through ``upgrade_v1``; the keys added after ``version`` that ``config`` lacks take
    their ``ADDED_KEYS`` values. ConfigError names an unknown key or a bad value as ``model.<key>``.
    """
    if version == 1 and isinstance(config, Mapping):
        config = upgrade_v1(config)
    if isinstance(config, Mapping):
        for added in (keys for later, keys in ADDED_KEYS.items() if later > version):
            config = _with_absent(config, added)
    return from_dict(NetConfig, config, "model")
