"""The inference bundle (save_bundle, load_bundle) and load_model, which also reads training checkpoints."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from captioner import bundle as bundle_module
from captioner.bundle import BUNDLE_VERSION, CHECKPOINT_KEY, load_bundle, load_trained, read_net, save_bundle
from captioner.config import DecodingConfig, NetConfig, from_dict, to_dict
from captioner.data.vocab import Vocabulary
from captioner.errors import BundleError, ConfigError
from captioner.inference import load_model
from captioner.model.captioner import Captioner
from conftest import CAPTIONER_NET, RUN_NET, net_v1, random_images, tampered, write_run


@pytest.fixture(scope="module")
def bundle(small_model, small_vocab, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bundle") / "model.pt"
    config = {**CAPTIONER_NET, "encoder": {**CAPTIONER_NET["encoder"], "weights": "DEFAULT"}}
    save_bundle(path, small_model, small_vocab, net_v1(config))
    return path


def test_bundle_round_trip_generates_identically(small_model, small_vocab, bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no pretrained weight file anywhere
    loaded, loaded_vocab, config = load_bundle(bundle)
    assert loaded_vocab == small_vocab and not loaded.training
    assert config.encoder.weights == "DEFAULT" and config.decoder == net_v1(CAPTIONER_NET).decoder
    expected_state = small_model.state_dict()
    assert all(torch.equal(value, expected_state[key]) for key, value in loaded.state_dict().items())
    images = random_images(2)
    for method in ("greedy", "beam"):
        expected, grid = small_model.generate(images, DecodingConfig(method=method, max_len=6))
        actual, loaded_grid = loaded.generate(images, DecodingConfig(method=method, max_len=6))
        assert grid == loaded_grid
        for field in ("tokens", "scores", "alphas", "lengths"):
            assert torch.equal(getattr(actual, field), getattr(expected, field)), (method, field)


class _Compiled(torch.nn.Module):
    """Names its child like torch.compile's OptimizedModule does."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = module


def test_bundle_of_a_compiled_decoder_loads(small_model, small_vocab, tmp_path):
    parts = small_model.encoder, _Compiled(small_model.decoder), small_model.self_attention
    wrapped = Captioner(*parts, feature_norm=small_model.feature_norm is not None)
    assert "decoder._orig_mod.embedding.weight" in wrapped.state_dict()
    save_bundle(tmp_path / "compiled.pt", wrapped, small_vocab, net_v1(CAPTIONER_NET))
    loaded, _, _ = load_bundle(tmp_path / "compiled.pt")
    assert torch.equal(loaded.decoder.embedding.weight, small_model.decoder.embedding.weight)


def test_bundle_holds_plain_data_only(bundle, small_vocab):
    raw = torch.load(bundle, weights_only=True)
    assert raw["format"] == "captioner-bundle" and raw["version"] == BUNDLE_VERSION == 3
    assert raw["vocab"] == small_vocab.to_dict() and raw["vocab_fingerprint"] == small_vocab.fingerprint()
    assert all(isinstance(v, torch.Tensor) for v in raw["state_dict"].values())


def _bigger_vocab(raw: dict) -> None:
    bigger = Vocabulary([*raw["vocab"]["words"][4:], "triangle"])
    raw["vocab"], raw["vocab_fingerprint"] = bigger.to_dict(), bigger.fingerprint()


def _drop(raw: dict, key: str) -> None:
    del raw[key]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda raw: raw.update(format="captioner-checkpoint"), "not a captioner bundle"),
        (lambda raw: _drop(raw, "state_dict"), r"not a complete bundle \(missing state_dict\)"),
        (lambda raw: raw.update(version=BUNDLE_VERSION + 1), f"bundle version {BUNDLE_VERSION + 1} is newer than this"),
        (lambda raw: raw.update(vocab={"words": ["a"]}), "malformed vocabulary"),
        (lambda raw: raw.update(vocab_fingerprint="0123456789abcdef"), "fingerprint '0123456789abcdef' does not match"),
        (_bigger_vocab, "the vocabulary has 12 words but the decoder.embedding weights have 11 rows"),
        (lambda raw: raw["config"]["encoder"].update(name="resnet7"), "config does not build a model.*'resnet7'"),
        (
            lambda raw: raw["config"].update(trainer={}),
            "config does not build a model.*model.trainer is not a known key",
        ),
        (lambda raw: raw["config"]["decoder"].update(embed_dim="16"), "config does not build a model"),
        (lambda raw: raw["config"]["decoder"].update(hidden_dim=32), r"shape mismatch \(saved vs model\): decoder"),
        (lambda raw: raw["config"].update(self_attention=None), r"unexpected: self_attention.blocks.0"),
        (lambda raw: raw["state_dict"].pop("decoder.init_h.bias"), r"missing: decoder.init_h.bias"),
        (lambda raw: raw.update(state_dict=[1, 2]), "state_dict is not a mapping of names to tensors"),
        # every size a bundle sets is bounded, and an oversized one is refused before anything is built
        (
            lambda raw: raw["config"]["decoder"].update(hidden_dim=10**6),
            r"config does not build a model \(model.decoder.hidden_dim=1000000 must be in \[1, 8192\]\)",
        ),
        (
            lambda raw: raw["config"]["self_attention"].update(max_distance=10**6),
            r"model.self_attention.max_distance=1000000 must be in \[1, 256\]",
        ),
        (lambda raw: raw["config"]["encoder"].update(grid=10**6), r"model.encoder.grid=1000000 must be in \[1, 256\]"),
    ],
)
def test_load_bundle_refuses_mismatches(bundle, tmp_path, change, message):
    path = tampered(bundle, tmp_path / "tampered.pt", change)
    with pytest.raises(BundleError, match=rf"^bundle {path}: .*{message}"):
        load_bundle(path)


def test_a_bundle_is_refused_before_its_model_is_built_for_real(bundle, tmp_path, monkeypatch):
    """The stored tensors' shapes are compared with the model of the config, built on the meta device (no
    memory), before the model is built for real: a wide config over small weights allocates nothing."""
    built, build = [], bundle_module.build_captioner

    def recording(net: NetConfig, vocab_size: int) -> Captioner:
        built.append(torch.empty(0).device.type)  # the device that the model's tensors go to
        return build(net, vocab_size)

    monkeypatch.setattr(bundle_module, "build_captioner", recording)
    path = tampered(bundle, tmp_path / "wide.pt", lambda raw: raw["config"]["decoder"].update(hidden_dim=4096))
    with pytest.raises(BundleError, match=r"shape mismatch \(saved vs model\): decoder"):
        load_bundle(path)
    assert built == ["meta"]
    load_bundle(bundle)
    assert built == ["meta", "meta", "cpu"]


def test_load_bundle_refuses_files_that_are_not_bundles(tmp_path):
    torch.save({"format": "captioner-bundle", "payload": os.path.join}, tmp_path / "code.pt")  # pickled callable
    with pytest.raises(BundleError, match="refused: it contains pickled Python objects"):
        load_bundle(tmp_path / "code.pt")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(BundleError, match="not a captioner bundle"):
        load_bundle(tmp_path / "tensor.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(BundleError, match="text.pt"):
        load_bundle(tmp_path / "text.pt")
    with pytest.raises(BundleError, match="not found"):
        load_bundle(tmp_path / "missing.pt")


class _Payload:
    """An arbitrary class: unpickling it must never happen."""


def test_load_bundle_refuses_a_pickled_class(tmp_path):
    torch.save({"format": "captioner-bundle", "version": 1, "config": _Payload()}, tmp_path / "class.pt")
    with pytest.raises(BundleError, match=r"class.pt was refused"):
        load_bundle(tmp_path / "class.pt")


def test_save_bundle_checks_what_it_writes(small_model, small_vocab, tmp_path):
    with pytest.raises(BundleError, match="the vocabulary has 5 words but the decoder.embedding weights have 11"):
        save_bundle(tmp_path / "a.pt", small_model, Vocabulary(["a"]), net_v1(CAPTIONER_NET))
    with pytest.raises(ConfigError, match="model.decoder.embed_dim=<object object at 0x[0-9a-f]+> must be an int"):
        save_bundle(
            tmp_path / "b.pt", small_model, small_vocab, net_v1({**CAPTIONER_NET, "decoder": {"embed_dim": object()}})
        )
    with pytest.raises(ConfigError, match="unknown model config key 'data'"):
        save_bundle(tmp_path / "c.pt", small_model, small_vocab, net_v1({**CAPTIONER_NET, "data": {}}))
    assert not any(tmp_path.iterdir())  # nothing written, not even a temporary file
    # the network's settings are stored as NetConfig serialises them: plain dicts, enums as their names
    net = net_v1({**CAPTIONER_NET, "decoder": MappingProxyType(CAPTIONER_NET["decoder"])})
    save_bundle(tmp_path / "d.pt", small_model, small_vocab, net)
    assert torch.load(tmp_path / "d.pt", weights_only=True)["config"] == to_dict(net_v1(CAPTIONER_NET))


def test_load_model_reads_a_training_checkpoint_like_its_bundle(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", objective=None)
    from_checkpoint = load_trained(run / "checkpoints" / "last.ckpt")
    from_bundle, from_folder = load_trained(run / "bundle.pt"), load_trained(run)  # a run folder means its bundle.pt
    for loaded in (from_checkpoint, from_bundle, from_folder):
        assert loaded.image_size == 64 and loaded.vocab.itos[4:] == ["a", "red", "circle"]
        assert loaded.config == net_v1(RUN_NET) and not loaded.model.training
    weights = from_bundle.model.state_dict()
    assert all(torch.equal(value, weights[key]) for key, value in from_checkpoint.model.state_dict().items())
    images = random_images(2, size=64)
    settings = DecodingConfig(method="greedy", max_len=5)
    greedy = [loaded.model.generate(images, settings)[0] for loaded in (from_checkpoint, from_bundle)]
    assert torch.equal(greedy[0].tokens, greedy[1].tokens) and torch.equal(greedy[0].alphas, greedy[1].alphas)


def test_a_bundle_keeps_how_its_run_decoded_and_an_older_one_decodes_with_captioning_s_defaults(
    small_model, small_vocab, tmp_path: Path
) -> None:
    own = DecodingConfig(method="beam", beam_size=5, max_len=7, length_penalty=0.5, no_repeat_ngram_size=2)
    net, preprocess = net_v1(CAPTIONER_NET), {"image_size": 64}
    save_bundle(tmp_path / "new.pt", small_model, small_vocab, net, preprocess, own)
    assert load_trained(tmp_path / "new.pt").decoding == own
    save_bundle(tmp_path / "old.pt", small_model, small_vocab, net, preprocess)  # as bundles were written before
    assert load_trained(tmp_path / "old.pt").decoding == DecodingConfig.captioning()
    bad = tampered(tmp_path / "new.pt", tmp_path / "bad.pt", lambda raw: raw["decoding"].update(max_len=0))
    with pytest.raises(BundleError, match=r"malformed decoding settings \(decoding.max_len=0 must be in \[1, 100\]\)"):
        load_trained(bad)


def _checkpoint_without(key: str | None) -> Callable[[dict], None]:
    """A change to a checkpoint: its bundle metadata loses ``key`` (None: the whole entry)."""

    def change(raw: dict) -> None:
        if key is None:
            del raw[CHECKPOINT_KEY]
        else:
            del raw[CHECKPOINT_KEY][key]

    return change


@pytest.mark.parametrize(
    "file,change,message",
    [
        (
            "checkpoints/last.ckpt",
            _checkpoint_without(None),
            'has no "captioner" entry \\(model config, vocabulary, image size\\); '
            "only checkpoints written by this version",
        ),
        (
            "checkpoints/last.ckpt",
            _checkpoint_without("vocab"),
            'its "captioner" entry is incomplete \\(missing vocab\\)',
        ),
        ("checkpoints/last.ckpt", _checkpoint_without("preprocess"), "has no preprocessing settings \\(the image size"),
        ("bundle.pt", lambda raw: raw.pop("preprocess"), "has no preprocessing settings"),
        (
            "bundle.pt",
            lambda raw: raw.update(preprocess={"image_size": 0}),
            "malformed preprocessing settings \\(preprocess.image_size=0 must be in \\[32, 4096\\]\\)",
        ),
        (
            "bundle.pt",
            lambda raw: raw.update(preprocess={"image_size": 10**6}),
            "malformed preprocessing settings \\(preprocess.image_size=1000000 must be in \\[32, 4096\\]\\)",
        ),
        ("bundle.pt", lambda raw: raw.update(format="other"), "neither a captioner bundle nor a training checkpoint"),
    ],
)
def test_load_model_refuses_a_file_it_cannot_caption_with(
    file: str, change: Callable[[dict], None], message: str, tmp_path: Path
) -> None:
    run = write_run(tmp_path / "run", objective=None)
    path = tampered(run / file, tmp_path / Path(file).name, change)
    with pytest.raises(BundleError, match=message) as info:
        load_trained(path)
    assert str(path) in str(info.value)


def test_load_model_of_a_run_folder_without_a_bundle_names_what_to_give(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", objective=None, bundle=False)  # a run that has not finished
    with pytest.raises(BundleError) as info:
        load_trained(run)
    assert str(info.value) == (
        f"{run} is a folder without bundle.pt (a run writes it when training ends); give a run folder that "
        f"finished, or one of its checkpoints ({run / 'checkpoints' / 'last.ckpt'})"
    )


@pytest.mark.parametrize(
    ("location", "cause"),
    [
        ("cuda", "this machine has no cuda device"),
        (torch.device("cuda", 1), "this machine has no cuda device"),
        ("gpu", "map_location='gpu' is not a torch device"),
    ],
)
def test_loading_onto_a_device_the_machine_lacks_says_so_not_that_the_file_is_broken(
    location: str | torch.device, cause: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path / "run", objective=None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # the same answer on a machine with a GPU
    with pytest.raises(BundleError) as info:
        load_model(run, map_location=location)
    message = str(info.value)
    assert message.startswith(f"cannot load model file {run / 'bundle.pt'} onto '{location}': {cause}")
    assert 'map_location="cpu"' in message and "corrupt" not in message and "\n" not in message
    assert load_model(run, map_location="cpu").model.training is False  # the file itself is fine


def test_the_stored_config_round_trips_every_setting() -> None:
    net = from_dict(NetConfig, {"attention": "hard", "scorer": "dot", "self_attention": {"blocks": 2}})
    assert read_net(to_dict(net), BUNDLE_VERSION) == net


def test_a_checkpoint_says_its_version_and_stores_the_config_as_netconfig_serialises_it(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", objective=None)
    metadata = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]
    assert metadata["version"] == BUNDLE_VERSION and metadata["config"] == to_dict(net_v1(RUN_NET))
    metadata["version"] = BUNDLE_VERSION + 1
    torch.save(
        {"pytorch-lightning_version": "2.6.0", "state_dict": {}, CHECKPOINT_KEY: metadata}, tmp_path / "new.ckpt"
    )
    with pytest.raises(BundleError, match=f"bundle version {BUNDLE_VERSION + 1} is newer than this captioner reads"):
        load_trained(tmp_path / "new.ckpt")


def _numeric_fields(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """The dotted names of every int and float field of the settings dataclass ``cls`` and of those it nests,
    each with its type (an optional field's: the type it holds when set)."""
    found, hints = [], typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        kind = next((k for k in typing.get_args(hints[item.name]) if k is not type(None)), hints[item.name])
        if dataclasses.is_dataclass(kind):
            found += _numeric_fields(kind, f"{prefix}{item.name}.")
        elif kind in (int, float):
            found.append((f"{prefix}{item.name}", kind))
    return found


def _set(raw: dict, section: str, dotted: str, value: object) -> None:
    """Set the dotted key ``dotted`` of the bundle's ``section`` (a training run's decoding when it has none)."""
    raw.setdefault(section, to_dict(DecodingConfig.captioning()))
    *parents, key = dotted.split(".")
    node = raw[section]
    for parent in parents:
        node = node[parent]
    node[key] = value


_BOUNDED = [
    (section, where, dotted, value)
    for section, where, cls in (("config", "model", NetConfig), ("decoding", "decoding", DecodingConfig))
    for dotted, kind in _numeric_fields(cls)
    for value in ((-(2**70), 2**70) if kind is int else (-1e300, 1e300, math.inf, math.nan))
] + [("preprocess", "preprocess", "image_size", value) for value in (-(2**70), 2**70)]


@pytest.fixture(scope="module")
def run_bundle(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("run") / "run", objective=None) / "bundle.pt"


@pytest.mark.parametrize("section, where, dotted, value", _BOUNDED, ids=lambda x: str(x))
def test_every_number_a_bundle_carries_is_bounded_on_load(run_bundle, tmp_path, section, where, dotted, value):
    """Every int and float a bundle sets (the network's, its decoding's, its image size), found by walking the
    settings' fields: far out of range on either side, or not a number, it is refused as the file is read."""
    path = tampered(run_bundle, tmp_path / "evil.pt", lambda raw: _set(raw, section, dotted, value))
    with pytest.raises(BundleError, match=re.escape(f"{where}.{dotted}={value!r}") + ".* must be") as info:
        load_trained(path)
    assert "\n" not in str(info.value)


def _deflated(source: Path, path: Path) -> Path:
    """A copy of the torch file ``source`` at ``path`` with every zip member deflate-compressed (torch.save
    stores them), as a crafted file would be: a tensor of zeros takes next to nothing in it."""
    with zipfile.ZipFile(source) as plain, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as packed:
        for info in plain.infolist():
            packed.writestr(info.filename, plain.read(info))
    return path


def test_a_compressed_bundle_is_refused_before_torch_reads_it(run_bundle, tmp_path, monkeypatch):
    """Its zip directory is read first: a compressed member could make loading allocate a thousand times the
    file's size (a 200 KB file, 200 MB of zeros) before anything else is checked."""
    zeros = tampered(run_bundle, tmp_path / "zeros.pt", lambda raw: raw["state_dict"].update(extra=torch.zeros(2**20)))
    path = _deflated(zeros, tmp_path / "deflated.pt")
    assert path.stat().st_size < zeros.stat().st_size / 2
    read, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: read.append(args) or load(*args, **kwargs))
    with pytest.raises(BundleError, match=rf"^model file {path} was refused: its member .* is compressed"):
        load_trained(path)
    with pytest.raises(BundleError, match=rf"^bundle {path} was refused: its member .* is compressed"):
        load_bundle(path)
    assert read == []
    load_trained(run_bundle)
    assert len(read) == 1


def test_a_model_larger_than_the_bound_is_refused_before_it_is_built(run_bundle, tmp_path, monkeypatch):
    """The 8192-wide embedding of a vocabulary of 150,000 words (and its output layer: 9.8 GB) is more than any
    bundle may hold: refused from the config, before the weights' shapes are compared or anything is built."""
    words = [f"w{i}" for i in range(150_000)]

    def wide(raw: dict) -> None:
        vocab = Vocabulary(words)
        raw["vocab"], raw["vocab_fingerprint"] = vocab.to_dict(), vocab.fingerprint()
        raw["config"]["decoder"].update(embed_dim=8192)

    path = tampered(run_bundle, tmp_path / "wide.pt", wide)
    with pytest.raises(BundleError, match=rf"^bundle {path}: its model would hold 9\.[0-9] GiB of weights, more "):
        load_trained(path)
    monkeypatch.setattr(bundle_module, "MAX_MODEL_BYTES", 10_000)  # the file itself: checked before it is read
    with pytest.raises(BundleError, match=rf"^model file {path} was refused: it holds [0-9.]+ MB, more than"):
        load_trained(path)
