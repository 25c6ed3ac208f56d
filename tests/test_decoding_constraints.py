"""Decoding constraints, for greedy, sampling and beam search: ``no_repeat_ngram_size`` blocks repeated n-grams,
``min_len`` forbids <end> before it; a beam wide enough to keep every hypothesis finds the best allowed caption;
a constrained batch decodes as its images one at a time; bad constraints raise ConfigError."""

import dataclasses
import itertools

import pytest
import torch
from torch.testing import assert_close

from captioner.config import DecodingConfig
from captioner.errors import ConfigError
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import beam_search, decode
from conftest import END, START, D, features_for, make_decoder, net_config
from decoding_helpers import METHODS, ChainDecoder, chain_features, pad_to, with_end_bias


def repeats_an_ngram(words: list[int], n: int) -> bool:
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return n > 0 and len(grams) != len(set(grams))


#        pad start end  a  b  c  d
# ids:    0    1    2   3  4  5  6
# the likeliest caption repeats "a b" until max_len; with "a b" blocked after "a b a", beam search finds
# "a b <end>" (0.9 * 0.95 * 0.1) and greedy, having taken "a", ends: "a b a <end>"
REPEATER = ChainDecoder(
    {START: {3: 0.9, 5: 0.1}, 3: {4: 0.95, END: 0.05}, 4: {3: 0.9, END: 0.1}, 5: {6: 0.5, END: 0.5}, 6: {END: 1.0}}, 7
)


@pytest.mark.parametrize("method, blocked", [("greedy", [3, 4, 3, 2]), ("beam", [3, 4, 2]), ("sample", [3, 4, 3, 2])])
def test_blocking_repeated_bigrams(method, blocked):
    options = dict(temperature=1e-4) if method == "sample" else {}  # sampling that cold is greedy
    free = METHODS[method](REPEATER, chain_features(), DecodingConfig(max_len=8, **options))
    assert free.tokens.tolist() == [[3, 4] * 4] * 2 and repeats_an_ngram(free.tokens[0].tolist(), 2)
    generation = METHODS[method](
        REPEATER, chain_features(), DecodingConfig(max_len=8, no_repeat_ngram_size=2, **options)
    )
    assert generation.tokens.tolist() == [blocked] * 2
    assert generation.lengths.tolist() == [len(blocked)] * 2


@pytest.mark.parametrize(
    "ngram, min_len, length_penalty", [(2, 0, 0.0), (1, 0, 0.0), (3, 1, 0.5), (0, 2, 0.0), (2, 3, 1.0)]
)
@torch.no_grad()
def test_a_beam_wide_enough_to_keep_every_hypothesis_finds_the_best_allowed_caption(ngram, min_len, length_penalty):
    """2 words + <end>, 4 steps: at most 24 candidates per step, so 24 beams never prune and beam search
    must agree with brute force over every caption the constraints allow (no repeated n-gram, at least
    ``min_len`` words before <end>, and at least one: never the empty caption). The decoder prefers "a a a a",
    which every blocking case forbids."""
    torch.manual_seed(0)
    decoder = ShowAttendTellDecoder(5, D, net_config(embed_dim=8, hidden_dim=8, attention_dim=8, dropout=0.0)).eval()
    decoder.classifier.bias[3] += 1.0
    decoder.classifier.bias[END] -= 1.0
    features = features_for(3, seed=12)
    settings = DecodingConfig(
        max_len=4, beam_size=24, length_penalty=length_penalty, min_len=min_len, no_repeat_ngram_size=ngram
    )
    generation = beam_search(decoder, features, settings)
    captions = [list(words) + [END] for n in range(4) for words in itertools.product([3, 4], repeat=n)]
    captions += [list(words) for words in itertools.product([3, 4], repeat=4)]
    allowed = [
        c
        for c in captions
        if not repeats_an_ngram([w for w in c if w != END], ngram) and (c[-1] != END or len(c) > max(min_len, 1))
    ]
    for b in range(3):
        scores = {}
        for caption in captions:
            tokens = torch.tensor([[START, *caption]])
            log_probs = decoder(features[b : b + 1], tokens).logits.log_softmax(-1)[0]
            score = log_probs.gather(1, tokens[0, 1:].unsqueeze(1)).sum()
            scores[tuple(caption)] = float(score) / ((5 + len(caption)) / 6) ** length_penalty
        best = max(allowed, key=lambda c: scores[tuple(c)])
        assert generation.tokens[b, : generation.lengths[b]].tolist() == best
        assert generation.scores[b].item() == pytest.approx(scores[tuple(best)], abs=1e-5)
        assert max(captions, key=lambda c: scores[tuple(c)]) == [3, 3, 3, 3]  # what the constraints change


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_min_len_forbids_end_before_it(method):
    decoder = with_end_bias(make_decoder(seed=13), 3.0)  # <end> is likely at every step
    free = METHODS[method](decoder, features_for(6), DecodingConfig(max_len=8))
    assert (free.lengths < 4).any()
    generation = METHODS[method](decoder, features_for(6), DecodingConfig(max_len=8, min_len=3))
    assert (generation.lengths >= 4).all()  # 3 words at least, then <end>
    ended = generation.tokens.gather(1, (generation.lengths - 1).unsqueeze(1)).squeeze(1) == END
    assert ended.all()


@pytest.mark.parametrize("method", ["greedy", "sample", "beam", "diverse"])
def test_no_method_returns_an_empty_caption_where_the_model_would_end_at_once(method):
    decoder = with_end_bias(make_decoder(seed=13), 20.0)  # <end> first, with probability ~1
    features = features_for(6)
    settings = DecodingConfig(method=method, max_len=8, beam_size=4, groups=2, n_best=2, seed=0)
    generation = decode(decoder, features, settings)
    assert generation.lengths.tolist() == [2] * 6  # one word, then <end> at once
    assert (generation.tokens[:, 0] != END).all() and (generation.tokens[:, 1] == END).all()
    if generation.n_best_lengths is not None:  # every one of the n best too
        assert (generation.n_best_lengths == 2).all() and (generation.n_best_tokens[..., 0] != END).all()
    with_min_len_1 = decode(decoder, features, dataclasses.replace(settings, min_len=1))
    assert torch.equal(with_min_len_1.tokens, generation.tokens)  # min_len 0 and 1 alike


def test_constrained_beam_search_batched_equals_one_image_at_a_time():
    decoder, features = make_decoder(seed=14), features_for(5, seed=14)
    options = dict(beam_size=3, min_len=2, no_repeat_ngram_size=2)
    batched = beam_search(decoder, features, DecodingConfig(max_len=10, **options))
    for b in range(5):
        alone = beam_search(decoder, features[b : b + 1], DecodingConfig(max_len=10, **options))
        assert torch.equal(pad_to(alone.tokens[0], batched.tokens.size(1)), batched.tokens[b])
        assert_close(alone.scores[0], batched.scores[b])


@pytest.mark.parametrize(
    "option, value", [("min_len", 6), ("min_len", -1), ("no_repeat_ngram_size", -1), ("no_repeat_ngram_size", 1.5)]
)
@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_bad_constraints_raise_config_error(method, option, value):
    with pytest.raises(ConfigError, match=option):
        METHODS[method](make_decoder(), features_for(1), DecodingConfig(max_len=6, **{option: value}))
