"""Diverse beam search (Vijayakumar et al. 2016) and n-best lists: with diversity 0 every group is the beam search of
its width; a penalty makes the groups' captions differ in more words; the n best captions sorted, the first the
one-best; static shapes and the graph cache give what the eager loop gives; the settings refused where they do not
apply."""

import math

import pytest
import torch
from torch.testing import assert_close

from captioner.config import DecodingConfig, captioning_settings
from captioner.errors import ConfigError
from captioner.model.beam import beam_search
from captioner.model.decoding import decode
from captioner.model.graphs import GraphCache
from captioner.model.steps import Generation
from conftest import END, START, features_for, make_decoder
from decoding_helpers import ChainDecoder, chain_features

# From <start>: "4" (0.5) or "5" (0.3), "6" (0.2); after 4 or 5: "7" (0.6) or "8" (0.4); then <end>. Beam search's
# two best share the first word ("4 7", "4 8"); a diverse second group is pushed off "4" and then off "7".
NEAR_COPIES = ChainDecoder(
    {START: {4: 0.5, 5: 0.3, 6: 0.2}, 4: {7: 0.6, 8: 0.4}, 5: {7: 0.6, 8: 0.4}, 6: {7: 1.0}, 7: {END: 1}, 8: {END: 1}},
    9,
)
CONSTRAINED = dict(max_len=10, length_penalty=0.7, min_len=2, no_repeat_ngram_size=2)


def _captions(tokens: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """The words of each caption (..., T), <end> left out."""
    flat, ends = tokens.reshape(-1, tokens.size(-1)), lengths.reshape(-1)
    return [[word for word in row[:end].tolist() if word != END] for row, end in zip(flat, ends)]


def _listed(generation: Generation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n-best tokens (B, N, T), scores and lengths (B, N); the one-best as a list of one when n_best was 1."""
    if generation.n_best_tokens is None:
        return generation.tokens.unsqueeze(1), generation.scores.unsqueeze(1), generation.lengths.unsqueeze(1)
    return generation.n_best_tokens, generation.n_best_scores, generation.n_best_lengths


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("groups, width", [(2, 1), (3, 2)])
def test_with_diversity_0_every_group_is_the_beam_search_of_its_width(groups, width, static):
    decoder, features = make_decoder(seed=3), features_for(4, seed=3)
    diverse = beam_search(
        decoder,
        features,
        DecodingConfig(
            method="diverse",
            beam_size=groups * width,
            groups=groups,
            diversity=0.0,
            n_best=groups * width,
            **CONSTRAINED,
        ),  # fmt: skip
        static_shapes=static,
    )
    alone = _listed(beam_search(decoder, features, DecodingConfig(beam_size=width, n_best=width, **CONSTRAINED)))
    # each group found the W captions of the beam of width W: every one G times, tied, groups in order
    steps = alone[0].size(-1)
    assert torch.equal(diverse.n_best_tokens[..., :steps], alone[0].repeat_interleave(groups, dim=1))
    assert not diverse.n_best_tokens[..., steps:].any()
    assert torch.equal(diverse.n_best_scores, alone[1].repeat_interleave(groups, dim=1))
    assert torch.equal(diverse.n_best_lengths, alone[2].repeat_interleave(groups, dim=1))
    one = beam_search(decoder, features, DecodingConfig(beam_size=width, **CONSTRAINED))
    assert torch.equal(diverse.tokens[:, : one.tokens.size(1)], one.tokens)
    assert torch.equal(diverse.scores, one.scores) and torch.equal(diverse.lengths, one.lengths)


def test_a_diversity_penalty_makes_the_groups_captions_differ():
    settings = dict(beam_size=2, n_best=2, max_len=5, groups=2)
    beam = beam_search(NEAR_COPIES, chain_features(1), DecodingConfig(**settings))
    assert _captions(beam.n_best_tokens, beam.n_best_lengths) == [[4, 7], [4, 8]]  # near copies
    same = beam_search(NEAR_COPIES, chain_features(1), DecodingConfig(method="diverse", diversity=0.0, **settings))
    assert _captions(same.n_best_tokens, same.n_best_lengths) == [[4, 7], [4, 7]]  # two groups of one, alike
    apart = beam_search(NEAR_COPIES, chain_features(1), DecodingConfig(method="diverse", diversity=1.0, **settings))
    assert _captions(apart.n_best_tokens, apart.n_best_lengths) == [[4, 7], [5, 8]]  # not one word shared
    # the scores are the captions' log-probs, without the penalty
    assert_close(apart.n_best_scores[0], torch.tensor([math.log(0.5 * 0.6), math.log(0.3 * 0.4)]), atol=1e-4, rtol=0)


def test_a_diversity_penalty_widens_a_real_decoder_s_words():
    decoder, features = make_decoder(seed=5), features_for(6, seed=5)
    distinct = {}
    for diversity in (0.0, 3.0):
        settings = DecodingConfig(
            method="diverse", beam_size=4, groups=4, diversity=diversity, n_best=4, max_len=8, min_len=4
        )
        generation = beam_search(decoder, features, settings)
        captions = _captions(generation.n_best_tokens, generation.n_best_lengths)
        distinct[diversity] = sum(len({w for c in captions[i : i + 4] for w in c}) for i in range(0, 24, 4))
    assert distinct[3.0] > distinct[0.0]


@pytest.mark.parametrize("method, groups", [("beam", 1), ("diverse", 2), ("diverse", 4)])
def test_n_best_lists_are_sorted_distinct_and_start_with_the_one_best(method, groups):
    decoder, features = make_decoder(seed=6), features_for(5, seed=6)
    options = dict(method=method, beam_size=4, groups=groups, **CONSTRAINED)
    best = beam_search(decoder, features, DecodingConfig(**options))
    assert best.n_best_tokens is None
    listed = beam_search(decoder, features, DecodingConfig(n_best=3, **options))
    assert listed.n_best_tokens.shape[:2] == listed.n_best_scores.shape == listed.n_best_lengths.shape == (5, 3)
    assert torch.isfinite(listed.n_best_scores).all()
    assert (listed.n_best_scores[:, :-1] >= listed.n_best_scores[:, 1:]).all()
    assert torch.equal(listed.tokens, best.tokens) and torch.equal(listed.scores, best.scores)
    assert torch.equal(listed.n_best_tokens[:, 0, : best.tokens.size(1)], best.tokens)
    assert torch.equal(listed.n_best_scores[:, 0], best.scores) and torch.equal(
        listed.n_best_lengths[:, 0], best.lengths
    )
    captions = _captions(listed.n_best_tokens, listed.n_best_lengths)
    for image in range(5):
        mine = captions[3 * image : 3 * image + 3]
        assert all(len(caption) >= 2 for caption in mine)  # min_len held: never an empty caption
        if method == "beam":
            assert len({tuple(caption) for caption in mine}) == 3  # three hypotheses, not one thrice


def test_the_graph_cache_replays_the_eager_n_best_lists():
    decoder, features = make_decoder(seed=7), features_for(3, seed=7)
    settings = DecodingConfig(method="diverse", beam_size=4, groups=2, n_best=4, **CONSTRAINED)
    eager = decode(decoder, features, settings)
    decoder.decoding_graphs = graphs = GraphCache(capture=False)  # the static inputs and outputs of a capture
    replayed = [decode(decoder, features, settings) for _ in range(2)]
    assert graphs.captures == 1
    for one in replayed:
        for field in ("tokens", "scores", "lengths", "n_best_tokens", "n_best_scores", "n_best_lengths"):
            assert torch.equal(getattr(one, field), getattr(eager, field)), field
        assert torch.equal(one.alphas, eager.alphas)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(n_best=4), "n_best=4 must be <= beam_size=3"),
        (dict(n_best=0), "n_best=0 must be >= 1"),
        (dict(method="diverse", beam_size=4, groups=3), "beam_size=4 must be a multiple of groups=3"),
        (dict(groups=0), "groups=0 must be in"),
        (dict(diversity=-0.1), "diversity=-0.1 must be in"),
        (dict(diversity=float("inf")), "diversity=inf must be in"),
    ],
)
def test_bad_diverse_and_n_best_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        DecodingConfig(**settings)


def test_groups_of_another_width_are_fine_for_plain_beam_search():
    assert DecodingConfig(method="beam", beam_size=4, groups=3).describe() == "beam search (beam 4)"
    described = DecodingConfig(method="diverse", beam_size=6, groups=3).describe()
    assert described == "diverse beam search (beam 6 in 3 groups, diversity 0.5)"


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(method="greedy", n_best=2), "n_best goes with method='beam' or method='diverse'"),
        (dict(groups=2), "groups goes with method='diverse'; this call decodes with method='beam'"),
        (dict(method="beam", diversity=1.0), "diversity goes with method='diverse'"),
    ],
)
def test_the_settings_a_method_does_not_read_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        captioning_settings(settings)
    assert captioning_settings({"method": "diverse", "groups": 3, "diversity": 1.0, "n_best": 3}).groups == 3
