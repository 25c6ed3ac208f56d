"""Sampling's top-k and nucleus (top-p) cuts: k = 1 and a tiny p are greedy; every draw lies inside the cut, and
every word of the cut is drawn; fixed shapes, no host read inside the loop; seeds repeat; the bounds."""

import pytest
import torch

from captioner.config import DecodingConfig, captioning_settings
from captioner.errors import ConfigError
from captioner.model.decoding import decode, greedy, sample, truncated
from captioner.model.steps import EXIT_CHECK_INTERVAL
from conftest import START, features_for, make_decoder
from decoding_helpers import ChainDecoder, chain_features, with_end_bias

# The first word's distribution: 4 .. 11 with these probabilities, most likely first.
FIRST = {4: 0.3, 5: 0.25, 6: 0.2, 7: 0.1, 8: 0.08, 9: 0.04, 10: 0.02, 11: 0.01}
FIXED = ChainDecoder({START: FIRST}, 12)


@pytest.mark.parametrize("cut", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)])
def test_top_k_1_and_a_tiny_nucleus_are_greedy(cut):
    decoder, features = make_decoder(seed=9), features_for(6, seed=9)
    expected = greedy(decoder, features, DecodingConfig(max_len=8, min_len=1, no_repeat_ngram_size=2))
    settings = DecodingConfig(method="sample", max_len=8, min_len=1, no_repeat_ngram_size=2, **cut)
    drawn = sample(decoder, features, settings, torch.Generator().manual_seed(0))
    assert torch.equal(drawn.tokens, expected.tokens) and torch.equal(drawn.scores, expected.scores)


@pytest.mark.parametrize(
    "cut, allowed",
    [
        (dict(top_k=3), {4, 5, 6}),
        (dict(top_p=0.5), {4, 5}),  # 0.3 + 0.25 reach 0.5
        (dict(top_p=0.6), {4, 5, 6}),  # 0.55 falls short of 0.6
        (dict(top_k=2, top_p=0.9), {4, 5}),
        (dict(top_k=50), set(FIRST)),  # more than the vocabulary: every word
        (dict(top_p=0.9, temperature=0.5), {4, 5, 6}),  # the cut is made on the tempered probabilities
    ],
)
def test_every_draw_lies_inside_the_cut_and_every_word_of_it_is_drawn(cut, allowed):
    settings = DecodingConfig(method="sample", max_len=1, **cut)
    drawn = sample(FIXED, chain_features(4000), settings, torch.Generator().manual_seed(1))
    assert set(drawn.tokens[:, 0].tolist()) == allowed


def test_truncated_keeps_fixed_shapes_and_the_order_of_ties():
    log_probs = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1], [0.5, 0.5, 0.0, 0.0, 0.0]]).log()
    assert torch.equal(truncated(log_probs, 0, 1.0), log_probs)
    cut = truncated(log_probs, 2, 1.0)
    assert cut.shape == log_probs.shape
    assert cut.isfinite().tolist() == [[False, True, True, False, False], [True, True, False, False, False]]
    assert truncated(log_probs, 1, 1.0).isfinite().nonzero()[:, 1].tolist() == [1, 0]  # argmax's choice on a tie


def test_no_host_read_inside_the_sampling_loop(monkeypatch):
    decoder = with_end_bias(make_decoder(seed=8), float("-inf"))
    reads = []
    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, o=original, n=name: reads.append(n) or o(self, *a))
    settings = DecodingConfig(method="sample", max_len=12, top_k=5, top_p=0.8)
    sample(decoder, features_for(3), settings, torch.Generator().manual_seed(0))
    assert reads == ["__bool__"] * (12 // EXIT_CHECK_INTERVAL) + ["__int__"]


def test_the_same_seed_draws_the_same_captions():
    decoder, features = make_decoder(seed=2), features_for(8, seed=2)
    settings = DecodingConfig(method="sample", max_len=8, top_k=4, top_p=0.9, seed=7)
    first, again = decode(decoder, features, settings), decode(decoder, features, settings)
    other = decode(decoder, features, DecodingConfig(method="sample", max_len=8, top_k=4, top_p=0.9, seed=8))
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.scores, again.scores)
    assert not torch.equal(first.tokens, other.tokens)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(top_k=-1), "top_k=-1 must be in \\[0, 1000000\\]"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \[1e-06, 1.0\]"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \[1e-06, 1.0\]"),
        (dict(top_k=2.5), "top_k=2.5 must be an int"),
    ],
)
def test_bad_cuts_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        DecodingConfig(method="sample", **settings)


def test_the_cuts_go_with_sampling_only():
    with pytest.raises(ConfigError, match="top_k goes with method='sample'; this call decodes with method='beam'"):
        captioning_settings({"top_k": 5})
    with pytest.raises(ConfigError, match="top_p goes with method='sample'; this call decodes with method='greedy'"):
        captioning_settings({"method": "greedy", "top_p": 0.9})
    assert DecodingConfig(method="sample", top_k=10, top_p=0.9).describe() == "sample (top-k 10, top-p 0.9)"
