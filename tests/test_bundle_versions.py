"""Every earlier version of the bundle format loads with the settings its files were written with
(``captioner.bundle_versions``, ``captioner.bundle_v1``): a key a file of an earlier version lacks reads as
what the files written without it did, never as today's default. Each earlier version has a fixture here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from captioner.bundle import BUNDLE_VERSION, CHECKPOINT_KEY, load_trained, read_net
from captioner.bundle_v1 import ABSENT_KEY_VALUES, upgrade_v1
from captioner.bundle_versions import ADDED_KEYS
from captioner.config import NetConfig, from_dict, to_dict
from conftest import net_v1

FIXTURES = Path(__file__).parent / "fixtures"
EARLIER = range(1, BUNDLE_VERSION)
# What each fixture was written with: fixtures/bundle_v<N>.pt by save_bundle at version N, with the logits its
# model gave for seeded images and fixed captions (fixtures/bundle_v<N>.json). Version 2's was written by the
# code of fbc0c18, the last before hard attention's expected-context warm-up.
WRITTEN: dict[int, dict[str, Any]] = {
    1: {
        "attention": "hard",
        "scorer": "dot",
        "encoder": {"name": "resnet18", "stage": "layer1", "grid": 2, "trainable_stages": 1},
        "self_attention": {"blocks": 1, "heads": 2, "positional": "relative", "max_distance": 1},
        "decoder": {
            "embed_dim": 8,
            "hidden_dim": 8,
            "attention_dim": 8,
            "dropout": 0.0,
            "gate": "vector",
            "hard_inference": "expectation",
            "hard_expectation_warmup": 0.0,  # version 1 had none (a training setting)
        },
    },
    2: {
        "attention": "hard",
        "encoder": {"name": "resnet18", "stage": "layer1", "grid": 2, "trainable_stages": 1},
        "decoder": {
            "embed_dim": 8,
            "hidden_dim": 8,
            "attention_dim": 8,
            "dropout": 0.0,
            "hard_expectation_prob": 0.25,
            "hard_expectation_warmup": 0.0,  # written before the warm-up: the mix from the first step
        },
    },
}
WORDS = {1: ["a", "red", "circle"], 2: ["a", "blue", "square"]}


def _keys(config: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of a nested model config's values."""
    found = set()
    for key, value in config.items():
        found |= _keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return found


def test_every_earlier_version_has_a_fixture_and_the_settings_it_was_written_with() -> None:
    assert set(WRITTEN) == set(EARLIER)
    for version in EARLIER:
        assert torch.load(FIXTURES / f"bundle_v{version}.pt", weights_only=True)["version"] == version


@pytest.mark.parametrize("version", EARLIER)
def test_a_bundle_of_an_earlier_version_loads_with_its_settings_and_weights(version: int) -> None:
    loaded = load_trained(FIXTURES / f"bundle_v{version}.pt")
    assert loaded.config == from_dict(NetConfig, WRITTEN[version])
    assert loaded.image_size == 32 and loaded.vocab.itos[4:] == WORDS[version]
    recorded = json.loads((FIXTURES / f"bundle_v{version}.json").read_text())
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(recorded["images_seed"]))
    with torch.no_grad():
        logits = loaded.model(images, torch.tensor(recorded["captions"])).logits
    torch.testing.assert_close(logits.flatten(), torch.tensor(recorded["logits"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("version", EARLIER)
def test_a_checkpoint_of_an_earlier_version_loads_like_its_bundle(version: int, tmp_path: Path) -> None:
    """Training checkpoints carry the same metadata (those of version 1 without a version)."""
    raw = torch.load(FIXTURES / f"bundle_v{version}.pt", weights_only=True)
    keys = ("config", "vocab", "vocab_fingerprint", "preprocess", *(("version",) if version > 1 else ()))
    checkpoint = {
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {f"model.{k}": v for k, v in raw["state_dict"].items()},
        CHECKPOINT_KEY: {key: raw[key] for key in keys},
    }
    torch.save(checkpoint, tmp_path / "last.ckpt")
    from_checkpoint = load_trained(tmp_path / "last.ckpt")
    from_bundle = load_trained(FIXTURES / f"bundle_v{version}.pt")
    assert from_checkpoint.config == from_bundle.config == from_dict(NetConfig, WRITTEN[version])
    weights = from_bundle.model.state_dict()
    assert all(torch.equal(value, weights[key]) for key, value in from_checkpoint.model.state_dict().items())


def test_a_key_added_after_a_version_reads_as_the_files_written_without_it() -> None:
    """Version 2's files written before the warm-up lack it: no warm-up, not today's default; those written
    after it keep theirs; a file of the current version that leaves it out takes the default."""
    assert read_net({"attention": "hard"}, 2).decoder.hard_expectation_warmup == 0.0
    assert read_net({"decoder": {"hard_expectation_warmup": 0.25}}, 2).decoder.hard_expectation_warmup == 0.25
    assert read_net({}, BUNDLE_VERSION).decoder.hard_expectation_warmup == NetConfig().decoder.hard_expectation_warmup
    assert NetConfig().decoder.hard_expectation_warmup != 0.0  # else the first line tests nothing


def test_every_key_of_the_current_config_is_in_version_2_or_versioned() -> None:
    """A setting added to NetConfig is one more entry of ADDED_KEYS (a new version, with what its absence
    means in the files written before it); version 2's keys are those its fixture stores."""
    version_2 = _keys(torch.load(FIXTURES / "bundle_v2.pt", weights_only=True)["config"])
    added = {key for keys in ADDED_KEYS.values() for key in keys}
    assert _keys(to_dict(NetConfig())) == version_2 | added and not version_2 & added
    assert max(ADDED_KEYS) == BUNDLE_VERSION


def test_a_version_1_config_upgrades_to_every_key_of_version_2() -> None:
    """A version-1 config becomes a version-2 one, which then goes through ADDED_KEYS like any other."""
    version_2 = _keys(torch.load(FIXTURES / "bundle_v2.pt", weights_only=True)["config"])
    assert _keys(upgrade_v1({})) == version_2


def test_keys_a_version_1_config_leaves_out_take_the_absent_key_table_not_the_current_defaults() -> None:
    read = to_dict(net_v1({"self_attention": {}}))
    decoder = dict(ABSENT_KEY_VALUES["decoder"])
    assert read == {
        "attention": decoder.pop("mode"),
        "scorer": decoder.pop("attention"),
        "encoder": dict(ABSENT_KEY_VALUES["encoder"]),
        "feature_norm": ABSENT_KEY_VALUES["feature_norm"],
        "self_attention": dict(ABSENT_KEY_VALUES["self_attention"]),
        "decoder": {**decoder, "hard_expectation_warmup": 0.0},
    }
    assert (read["encoder"]["name"], read["decoder"]["hidden_dim"], read["decoder"]["dropout"]) == (
        "resnet101",
        512,
        0.5,
    )
    partial = {"encoder": {"name": "resnet18"}, "self_attention": {"heads": 2}, "decoder": {"mode": "hard"}}
    net = net_v1(partial)
    assert (net.attention, net.scorer, net.self_attention.blocks, net.feature_norm) == ("hard", "additive", 1, False)
    assert (net.encoder.name, net.encoder.stage, net.encoder.trainable_stages, net.decoder.hidden_dim) == (
        "resnet18",
        None,
        0,
        512,
    )
    for none in ({}, {"self_attention": None}):  # no self_attention section: no blocks
        assert net_v1(none).self_attention.blocks == 0
