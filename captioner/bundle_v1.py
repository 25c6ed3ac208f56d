"""Version 1 of the bundle format's model config, and its upgrade to version 2's.

A version-1 config (bundles and training checkpoints written before ``BUNDLE_VERSION`` 2) holds the network
in its own layout: the attention mode and the scorer inside the decoder's section, as ``decoder.mode`` and
``decoder.attention``; a key may be left out, and then means the value of ``ABSENT_KEY_VALUES``.
``upgrade_v1`` turns it into what version 2 stores, ``NetConfig``'s serialisation as it was then; the keys added
since are ``captioner.bundle_versions``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from captioner.errors import ConfigError

# What a key left out of a version-1 config means, fixed for good: the values the modules' constructors
# defaulted to when bundles were first written (a frozen resnet101 read at its last stage, no feature norm,
# the paper's 512-wide decoder with dropout 0.5 and soft additive attention), not the current defaults. An
# absent or null ``self_attention`` means no blocks; a ``self_attention`` mapping reads its left-out keys here.
ABSENT_KEY_VALUES: Mapping[str, Any] = MappingProxyType(
    {
        "encoder": MappingProxyType(
            {
                "name": "resnet101",
                "weights": None,
                "stage": None,
                "grid": None,
                "trainable_stages": 0,
                "channels_last": False,
            }
        ),
        "feature_norm": False,
        "self_attention": MappingProxyType({"blocks": 1, "heads": 1, "positional": "none", "max_distance": 4}),
        "decoder": MappingProxyType(
            {
                "embed_dim": 512,
                "hidden_dim": 512,
                "attention_dim": 512,
                "attention_heads": 1,
                "gate": "scalar",
                "deep_output": True,
                "dropout": 0.5,
                "hard_expectation_prob": 0.5,
                "hard_inference": "argmax",
                "hard_estimator": "reinforce",
                "gumbel_tau": 1.0,
                "gumbel_tau_min": 0.5,
                "mode": "soft",
                "attention": "additive",
            }
        ),
    }
)


def upgrade_v1(config: Mapping[str, Any]) -> dict[str, Any]:
    """The version-2 model config (every key ``NetConfig`` had at version 2) of the version-1 config ``config``.

    Left-out keys take ``ABSENT_KEY_VALUES``; ``self_attention.positional`` written as true/false (before
    relative positions) becomes ``absolute``/``none``. The values themselves are checked when ``NetConfig``
    is built from the result. ConfigError names an unknown key or a section that is not a mapping.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"model config must be a mapping, got {type(config).__name__}")
    unknown = [key for key in config if key not in ABSENT_KEY_VALUES]
    if unknown:
        raise ConfigError(f"unknown model config key {unknown[0]!r}; valid keys: {', '.join(ABSENT_KEY_VALUES)}")
    for key in ("encoder", "self_attention", "decoder"):
        if config.get(key) is not None and not isinstance(config[key], Mapping):
            raise ConfigError(f"model config {key!r} must be a mapping, got {type(config[key]).__name__}")
    absent = ABSENT_KEY_VALUES
    decoder = {**absent["decoder"], **(config.get("decoder") or {})}
    self_attention = config.get("self_attention")
    if self_attention is not None and isinstance(self_attention.get("positional"), bool):
        self_attention = {**self_attention, "positional": "absolute" if self_attention["positional"] else "none"}
    return {
        "attention": decoder.pop("mode"),
        "scorer": decoder.pop("attention"),
        "encoder": {**absent["encoder"], **(config.get("encoder") or {})},
        "feature_norm": config.get("feature_norm", absent["feature_norm"]),
        "self_attention": {**absent["self_attention"], **({"blocks": 0} if self_attention is None else self_attention)},
        "decoder": decoder,
    }
