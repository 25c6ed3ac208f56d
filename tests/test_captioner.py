"""Captioner: encoder once per image, cached-feature path, generation, and the inference bundle."""

from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from captioner.data.vocab import Vocabulary
from captioner.errors import BundleError, ConfigError
from captioner.model.bundle import load_bundle, save_bundle
from captioner.model.captioner import Captioner, build_captioner
from captioner.model.self_attention import SelfAttentionStack
from conftest import random_images, tampered

CONFIG = {
    "encoder": {"name": "resnet18", "weights": None, "grid": 2},
    "self_attention": {"blocks": 1, "heads": 2, "positional": True},
    "decoder": {"embed_dim": 16, "hidden_dim": 16, "attention_dim": 16, "dropout": 0.0},
}
IMAGE_SIZE = 96  # resnet18: a 3x3 map, pooled to the 2x2 grid


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary(["a", "red", "blue", "circle", "square", "left", "of"])


@pytest.fixture(scope="module")
def model(vocab) -> Captioner:
    """A tiny captioner in eval mode whose self-attention gate is open (tests must not change it)."""
    torch.manual_seed(0)
    captioner = build_captioner(CONFIG, len(vocab)).eval()
    with torch.no_grad():
        captioner.self_attention.blocks[0].gamma.fill_(0.5)
    return captioner


@pytest.fixture(scope="module")
def bundle(model, vocab, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bundle") / "model.pt"
    save_bundle(path, model, vocab, {**CONFIG, "encoder": {**CONFIG["encoder"], "weights": "DEFAULT"}})
    return path


def _captions(n: int, length: int = 6, vocab_size: int = 11) -> torch.Tensor:
    captions = torch.randint(4, vocab_size, (n, length), generator=torch.Generator().manual_seed(1))
    captions[:, 0] = Vocabulary.start_id
    captions[:, -1] = Vocabulary.end_id
    return captions  # (N, T+1)


def test_build_captioner_wires_the_parts(model, vocab):
    assert isinstance(model.self_attention, SelfAttentionStack)
    assert model.self_attention.blocks[0].dim == model.encoder.out_channels == 512
    assert model.decoder.embedding.num_embeddings == len(vocab) == 11
    plain = build_captioner({**CONFIG, "self_attention": {"blocks": 0}}, len(vocab))
    assert plain.self_attention is None
    assert build_captioner({**CONFIG, "self_attention": None}, len(vocab)).self_attention is None
    assert len(build_captioner({**CONFIG, "self_attention": {}}, len(vocab)).self_attention.blocks) == 1


@pytest.mark.parametrize("config, message", [
    ({**CONFIG, "optimizer": {}}, r"key 'optimizer'; valid keys: encoder, feature_norm, self_attention, decoder"),
    ({**CONFIG, "encoder": {"nmae": "resnet18"}}, r"encoder.nmae is not a known key; valid keys: name, weights, stage, grid"),
    ({**CONFIG, "decoder": {"vocab_size": 5}}, r"decoder.vocab_size is not a known key; valid keys: embed_dim"),
    ({**CONFIG, "self_attention": {"layers": 2}}, r"self_attention.layers is not a known key; valid keys: blocks, heads, positional"),
    ({**CONFIG, "decoder": [1, 2]}, r"'decoder' must be a mapping"),
])
def test_build_captioner_refuses_unknown_keys(config, message):
    with pytest.raises(ConfigError, match=message):
        build_captioner(config, 11)


def test_encoder_runs_once_per_image(model):
    images, captions = random_images(2), _captions(10)
    image_index = torch.arange(2).repeat_interleave(5)  # five captions per image
    batches = []
    hooks = [model.encoder.stages[0].register_forward_hook(lambda m, args, out: batches.append(args[0].shape[0])),
             model.decoder.attention.key.register_forward_hook(lambda m, args, out: batches.append(args[0].shape[0]))]
    try:
        output = model(images, captions, image_index)
    finally:
        for hook in hooks:
            hook.remove()
    assert batches == [2, 2]  # the CNN and the attention keys see the 2 images once, not the 10 captions
    assert output.logits.shape == (10, 5, 11) and output.alphas.shape == (10, 5, 4)
    torch.testing.assert_close(output.alphas.sum(-1), torch.ones(10, 5))


def test_forward_equals_forward_features_of_encode(model):
    images, captions = random_images(2), _captions(4)
    image_index = torch.tensor([0, 1, 1, 0])
    with torch.no_grad():
        features, grid = model.encode(images)  # what a feature cache stores
        direct = model(images, captions, image_index)
        cached = model.forward_features(features, captions, image_index, grid)
        square = model.forward_features(features, captions, image_index)  # grid inferred: 2x2
    assert grid == (2, 2) and features.shape == (2, 4, 512)
    for other in (cached, square):
        assert torch.equal(direct.logits, other.logits) and torch.equal(direct.alphas, other.alphas)
    # the self-attention is applied on the cached path: skipping it changes the outputs
    with torch.no_grad():
        raw = model.decoder(features, captions, image_index)
    assert not torch.allclose(raw.logits, direct.logits)


def test_a_partly_trained_encoder_caches_its_frozen_stages_and_trains_the_rest(vocab):
    config = {"encoder": {"name": "resnet18", "stage": "layer2", "grid": 2, "trainable_stages": 1},
              "decoder": {"embed_dim": 16, "hidden_dim": 16, "attention_dim": 16, "dropout": 0.0}}
    torch.manual_seed(0)
    model = build_captioner(config, len(vocab)).train()
    images, captions, index = random_images(2), _captions(4), torch.tensor([0, 1, 1, 0])
    features, grid = model.encode(images)  # layer1's output: 64 channels on a 24x24 map at 96 px
    assert features.shape == (2, 24 * 24, 64) and grid == (24, 24) and not features.requires_grad
    direct, cached = model(images, captions, index), model.forward_features(features, captions, index, grid)
    torch.testing.assert_close(cached.logits, direct.logits)
    assert cached.alphas.shape == (4, 5, 4)  # attention over layer2's map pooled to 2x2
    cached.logits.sum().backward()
    assert model.encoder.stages.layer2[0].conv1.weight.grad.abs().sum() > 0  # the trained stage learns
    assert model.encoder.stages.layer1[0].conv1.weight.grad is None  # the cached one does not
    model.eval()
    with torch.no_grad():
        generation, attention_grid = model.generate_from_features(features, grid, method="greedy", max_len=4)
    assert attention_grid == (2, 2) and generation.alphas.shape[-1] == 4


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_generate_returns_per_word_alphas_on_the_grid(model, method):
    images = random_images(3)
    generation, grid = model.generate(images, method=method, max_len=7, beam_size=2,
                                      generator=torch.Generator().manual_seed(0))
    assert grid == model.encoder.grid_size(IMAGE_SIZE) == (2, 2)
    steps = generation.tokens.size(1)
    assert generation.alphas.shape == (3, steps, grid[0] * grid[1]) and 1 <= steps <= 7
    for row in range(3):
        length = int(generation.lengths[row])
        torch.testing.assert_close(generation.alphas[row, :length].sum(-1), torch.ones(length))
        assert torch.all(generation.alphas[row, length:] == 0)
    features, _ = model.encode(images)
    again, again_grid = model.generate_from_features(features, grid, method=method, max_len=7, beam_size=2,
                                                     generator=torch.Generator().manual_seed(0))
    assert again_grid == grid and torch.equal(again.tokens, generation.tokens)


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_generate_applies_min_len_and_ngram_blocking(model, method):
    from captioner.model import decoding

    options = dict(max_len=8, min_len=3, no_repeat_ngram_size=1)
    generation, _ = model.generate(random_images(3), method=method, beam_size=2,
                                   generator=torch.Generator().manual_seed(0), **options)
    for row in range(3):
        words = generation.tokens[row, : generation.lengths[row]].tolist()
        assert len(words) > 3 and len(set(words)) == len(words)  # 3 words before <end> at least, none twice
    features = model.attend_grid(model.encode(random_images(3))[0])
    direct = {"greedy": lambda: decoding.greedy(model.decoder, features, start_id=1, end_id=2, **options),
              "sample": lambda: decoding.sample(model.decoder, features, start_id=1, end_id=2,
                                                generator=torch.Generator().manual_seed(0), **options),
              "beam": lambda: decoding.beam_search(model.decoder, features, start_id=1, end_id=2, beam_size=2,
                                                   **options)}[method]()
    assert torch.equal(generation.tokens, direct.tokens)


def test_generate_refuses_unknown_method(model):
    with pytest.raises(ConfigError, match="method='topk'"):
        model.generate(random_images(1), method="topk")


def test_bundle_round_trip_generates_identically(model, vocab, bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no pretrained weight file anywhere
    loaded, loaded_vocab, config = load_bundle(bundle)
    assert loaded_vocab == vocab and not loaded.training
    assert config["encoder"]["weights"] == "DEFAULT" and config["decoder"] == CONFIG["decoder"]
    expected_state = model.state_dict()
    assert all(torch.equal(value, expected_state[key]) for key, value in loaded.state_dict().items())
    images = random_images(2)
    for method in ("greedy", "beam"):
        expected, grid = model.generate(images, method=method, max_len=6)
        actual, loaded_grid = loaded.generate(images, method=method, max_len=6)
        assert grid == loaded_grid
        for field in ("tokens", "scores", "alphas", "lengths"):
            assert torch.equal(getattr(actual, field), getattr(expected, field)), (method, field)


class _Compiled(torch.nn.Module):
    """Names its child like torch.compile's OptimizedModule does."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = module


def test_bundle_of_a_compiled_decoder_loads(model, vocab, tmp_path):
    wrapped = Captioner(model.encoder, _Compiled(model.decoder), model.self_attention)
    assert "decoder._orig_mod.embedding.weight" in wrapped.state_dict()
    save_bundle(tmp_path / "compiled.pt", wrapped, vocab, CONFIG)
    loaded, _, _ = load_bundle(tmp_path / "compiled.pt")
    assert torch.equal(loaded.decoder.embedding.weight, model.decoder.embedding.weight)


def test_bundle_holds_plain_data_only(bundle, vocab):
    raw = torch.load(bundle, weights_only=True)
    assert raw["format"] == "captioner-bundle" and raw["version"] == 1
    assert raw["vocab"] == vocab.to_dict() and raw["vocab_fingerprint"] == vocab.fingerprint()
    assert all(isinstance(v, torch.Tensor) for v in raw["state_dict"].values())


def _bigger_vocab(raw: dict) -> None:
    bigger = Vocabulary([*raw["vocab"]["words"][4:], "triangle"])
    raw["vocab"], raw["vocab_fingerprint"] = bigger.to_dict(), bigger.fingerprint()


def _drop(raw: dict, key: str) -> None:
    del raw[key]


@pytest.mark.parametrize("change, message", [
    (lambda raw: raw.update(format="captioner-checkpoint"), "not a captioner bundle"),
    (lambda raw: _drop(raw, "state_dict"), r"not a complete bundle \(missing state_dict\)"),
    (lambda raw: raw.update(version=2), "bundle version 2 is newer than this captioner reads"),
    (lambda raw: raw.update(vocab={"words": ["a"]}), "malformed vocabulary"),
    (lambda raw: raw.update(vocab_fingerprint="0123456789abcdef"), "fingerprint '0123456789abcdef' does not match"),
    (_bigger_vocab, "the vocabulary has 12 words but the decoder.embedding weights have 11 rows"),
    (lambda raw: raw["config"]["encoder"].update(name="resnet7"), "config does not build a model.*'resnet7'"),
    (lambda raw: raw["config"].update(trainer={}), "config does not build a model.*'trainer'"),
    (lambda raw: raw["config"]["decoder"].update(embed_dim="16"), "config does not build a model"),
    (lambda raw: raw["config"]["decoder"].update(hidden_dim=32), r"shape mismatch \(saved vs model\): decoder"),
    (lambda raw: raw["config"].update(self_attention=None), r"unexpected: self_attention.blocks.0"),
    (lambda raw: raw["state_dict"].pop("decoder.init_h.bias"), r"missing: decoder.init_h.bias"),
    (lambda raw: raw.update(state_dict=[1, 2]), "state_dict is not a mapping of names to tensors"),
])
def test_load_bundle_refuses_mismatches(bundle, tmp_path, change, message):
    path = tampered(bundle, tmp_path / "tampered.pt", change)
    with pytest.raises(BundleError, match=rf"^bundle {path}: .*{message}"):
        load_bundle(path)


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


def test_save_bundle_checks_what_it_writes(model, vocab, tmp_path):
    with pytest.raises(BundleError, match="the vocabulary has 5 words but the decoder.embedding weights have 11"):
        save_bundle(tmp_path / "a.pt", model, Vocabulary(["a"]), CONFIG)
    with pytest.raises(ConfigError, match="model.decoder.embed_dim=<object object at 0x[0-9a-f]+> must be a int"):
        save_bundle(tmp_path / "b.pt", model, vocab, {**CONFIG, "decoder": {"embed_dim": object()}})
    with pytest.raises(ConfigError, match="unknown model config key 'data'"):
        save_bundle(tmp_path / "c.pt", model, vocab, {**CONFIG, "data": {}})
    assert not any(tmp_path.iterdir())  # nothing written, not even a temporary file
    # any mapping (e.g. an OmegaConf DictConfig) is stored as plain dicts and lists
    config = {**CONFIG, "decoder": MappingProxyType(CONFIG["decoder"])}
    save_bundle(tmp_path / "d.pt", model, vocab, config)
    assert torch.load(tmp_path / "d.pt", weights_only=True)["config"] == CONFIG


def test_feature_norm_standardises_each_channel_in_training_and_travels_in_the_bundle(tmp_path) -> None:

    torch.manual_seed(0)
    config = {"encoder": {"name": "resnet18"}, "feature_norm": True,
              "decoder": {"embed_dim": 8, "hidden_dim": 8, "attention_dim": 8}}
    vocab = Vocabulary(["a", "b"])
    model = build_captioner(config, len(vocab)).train()
    features = torch.randn(4, 9, 512) * 7.0 + 3.0  # (B, L, C) far from unit scale
    normed = model.attend_grid(features)
    assert torch.allclose(normed.mean(dim=(0, 1)), torch.zeros(512), atol=1e-5)
    assert torch.allclose(normed.std(dim=(0, 1), unbiased=False), torch.ones(512), atol=1e-3)
    save_bundle(tmp_path / "b.pt", model, vocab, config)
    loaded, _, _ = load_bundle(tmp_path / "b.pt")
    assert torch.equal(loaded.feature_norm.running_mean, model.feature_norm.running_mean)
    assert torch.allclose(loaded.attend_grid(features), model.eval().attend_grid(features))
    with pytest.raises(ConfigError, match="feature_norm='yes' must be true or false"):
        build_captioner({**config, "feature_norm": "yes"}, len(vocab))
