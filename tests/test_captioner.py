"""Captioner: the parts build_captioner wires, the encoder once per image, the cached-feature path, generation."""

from __future__ import annotations

import pytest
import torch

from captioner.bundle import load_bundle, save_bundle
from captioner.config import DecodingConfig
from captioner.data.vocab import END_ID, START_ID, Vocabulary
from captioner.errors import ConfigError
from captioner.model.captioner import build_captioner
from captioner.model.self_attention import SelfAttentionStack
from conftest import CAPTIONER_NET, SMALL_IMAGE_SIZE, net_v1, random_images


def _captions(n: int, length: int = 6, vocab_size: int = 11) -> torch.Tensor:
    captions = torch.randint(4, vocab_size, (n, length), generator=torch.Generator().manual_seed(1))
    captions[:, 0] = START_ID
    captions[:, -1] = END_ID
    return captions  # (N, T+1)


def test_build_captioner_wires_the_parts(small_model, small_vocab):
    assert isinstance(small_model.self_attention, SelfAttentionStack)
    assert small_model.self_attention.blocks[0].dim == small_model.encoder.out_channels == 512
    assert small_model.decoder.embedding.num_embeddings == len(small_vocab) == 11
    plain = build_captioner(net_v1({**CAPTIONER_NET, "self_attention": {"blocks": 0}}), len(small_vocab))
    assert plain.self_attention is None
    assert build_captioner(net_v1({**CAPTIONER_NET, "self_attention": None}), len(small_vocab)).self_attention is None
    assert (
        len(build_captioner(net_v1({**CAPTIONER_NET, "self_attention": {}}), len(small_vocab)).self_attention.blocks)
        == 1
    )


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {**CAPTIONER_NET, "optimizer": {}},
            r"key 'optimizer'; valid keys: encoder, feature_norm, self_attention, decoder",
        ),
        (
            {**CAPTIONER_NET, "encoder": {"nmae": "resnet18"}},
            r"encoder.nmae is not a known key; valid keys: name, weights, stage, grid",
        ),
        (
            {**CAPTIONER_NET, "decoder": {"vocab_size": 5}},
            r"decoder.vocab_size is not a known key; valid keys: embed_dim",
        ),
        (
            {**CAPTIONER_NET, "self_attention": {"layers": 2}},
            r"self_attention.layers is not a known key; valid keys: blocks, heads, positional",
        ),
        ({**CAPTIONER_NET, "decoder": [1, 2]}, r"'decoder' must be a mapping"),
    ],
)
def test_a_bundle_config_with_unknown_keys_is_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        net_v1(config)


def test_encoder_runs_once_per_image(small_model):
    images, captions = random_images(2), _captions(10)
    image_index = torch.arange(2).repeat_interleave(5)  # five captions per image
    batches = []

    def count(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        batches.append(args[0].shape[0])

    hooks = [
        small_model.encoder.stages[0].register_forward_hook(count),
        small_model.decoder.attention.key.register_forward_hook(count),
    ]
    try:
        output = small_model(images, captions, image_index)
    finally:
        for hook in hooks:
            hook.remove()
    assert batches == [2, 2]  # the CNN and the attention keys see the 2 images once, not the 10 captions
    assert output.logits.shape == (10, 5, 11) and output.alphas.shape == (10, 5, 4)
    torch.testing.assert_close(output.alphas.sum(-1), torch.ones(10, 5))


def test_forward_equals_forward_features_of_encode(small_model):
    images, captions = random_images(2), _captions(4)
    image_index = torch.tensor([0, 1, 1, 0])
    with torch.no_grad():
        features, grid = small_model.encode(images)  # what a feature cache stores
        direct = small_model(images, captions, image_index)
        cached = small_model.forward_features(features, captions, image_index, grid)
        square = small_model.forward_features(features, captions, image_index)  # grid inferred: 2x2
    assert grid == (2, 2) and features.shape == (2, 4, 512)
    for other in (cached, square):
        assert torch.equal(direct.logits, other.logits) and torch.equal(direct.alphas, other.alphas)
    # the self-attention is applied on the cached path: skipping it changes the outputs
    with torch.no_grad():
        raw = small_model.decoder(features, captions, image_index)
    assert not torch.allclose(raw.logits, direct.logits)


def test_a_partly_trained_encoder_caches_its_frozen_stages_and_trains_the_rest(small_vocab):
    config = {
        "encoder": {"name": "resnet18", "stage": "layer2", "grid": 2, "trainable_stages": 1},
        "decoder": {"embed_dim": 16, "hidden_dim": 16, "attention_dim": 16, "dropout": 0.0},
    }
    torch.manual_seed(0)
    model = build_captioner(net_v1(config), len(small_vocab)).train()
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
        settings = DecodingConfig(method="greedy", max_len=4)
        generation, attention_grid = model.generate_from_features(features, grid, settings)
    assert attention_grid == (2, 2) and generation.alphas.shape[-1] == 4


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_generate_returns_per_word_alphas_on_the_grid(small_model, method):
    images = random_images(3)
    settings = DecodingConfig(method=method, max_len=7, beam_size=2)
    generation, grid = small_model.generate(images, settings, torch.Generator().manual_seed(0))
    assert grid == small_model.encoder.grid_size(SMALL_IMAGE_SIZE) == (2, 2)
    steps = generation.tokens.size(1)
    assert generation.alphas.shape == (3, steps, grid[0] * grid[1]) and 1 <= steps <= 7
    for row in range(3):
        length = int(generation.lengths[row])
        torch.testing.assert_close(generation.alphas[row, :length].sum(-1), torch.ones(length))
        assert torch.all(generation.alphas[row, length:] == 0)
    features, _ = small_model.encode(images)
    again, again_grid = small_model.generate_from_features(features, grid, settings, torch.Generator().manual_seed(0))
    assert again_grid == grid and torch.equal(again.tokens, generation.tokens)


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_generate_applies_min_len_and_ngram_blocking(small_model, method):
    from captioner.model import decoding

    settings = DecodingConfig(method=method, beam_size=2, max_len=8, min_len=3, no_repeat_ngram_size=1)
    generation, _ = small_model.generate(random_images(3), settings, torch.Generator().manual_seed(0))
    for row in range(3):
        words = generation.tokens[row, : generation.lengths[row]].tolist()
        assert len(words) > 3 and len(set(words)) == len(words)  # 3 words before <end> at least, none twice
    features = small_model.attend_grid(small_model.encode(random_images(3))[0])
    direct = {
        "greedy": lambda: decoding.greedy(small_model.decoder, features, settings),
        "sample": lambda: decoding.sample(small_model.decoder, features, settings, torch.Generator().manual_seed(0)),
        "beam": lambda: decoding.beam_search(small_model.decoder, features, settings),
    }[method]()
    assert torch.equal(generation.tokens, direct.tokens)


def test_generate_refuses_unknown_method(small_model):
    with pytest.raises(ConfigError, match="method='topk'"):
        small_model.generate(random_images(1), DecodingConfig(method="topk"))


def test_feature_norm_standardises_each_channel_in_training_and_travels_in_the_bundle(tmp_path) -> None:

    torch.manual_seed(0)
    config = {
        "encoder": {"name": "resnet18"},
        "feature_norm": True,
        "decoder": {"embed_dim": 8, "hidden_dim": 8, "attention_dim": 8},
    }
    vocab = Vocabulary(["a", "b"])
    model = build_captioner(net_v1(config), len(vocab)).train()
    features = torch.randn(4, 9, 512) * 7.0 + 3.0  # (B, L, C) far from unit scale
    normed = model.attend_grid(features)
    assert torch.allclose(normed.mean(dim=(0, 1)), torch.zeros(512), atol=1e-5)
    assert torch.allclose(normed.std(dim=(0, 1), unbiased=False), torch.ones(512), atol=1e-3)
    save_bundle(tmp_path / "b.pt", model, vocab, net_v1(config))
    loaded, _, _ = load_bundle(tmp_path / "b.pt")
    assert torch.equal(loaded.feature_norm.running_mean, model.feature_norm.running_mean)
    assert torch.allclose(loaded.attend_grid(features), model.eval().attend_grid(features))
    with pytest.raises(ConfigError, match="feature_norm='yes' must be true or false"):
        net_v1({**config, "feature_norm": "yes"})
