"""Greedy and beam search: scripted chains with known answers, then a real decoder: a beam of one is greedy, a batch
decodes as its images one at a time, the returned scores and alphas are the teacher-forced ones, a beam wide enough
to keep every hypothesis finds brute force's best caption, and the beams read one copy of each image's features."""

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from captioner.config import DecodingConfig
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import beam_search, greedy
from conftest import END, START, D, L, features_for, make_decoder, net_config
from decoding_helpers import ChainDecoder, chain_features, pad_to, with_end_bias

#        pad start end  a  b  c  d
# ids:    0    1    2   3  4  5  6
TRAP = ChainDecoder({START: {3: 0.5, 4: 0.4, END: 0.1}, 3: {END: 0.4, 5: 0.3, 6: 0.3}, 4: {END: 0.9, 5: 0.1}}, 7)
LONG = ChainDecoder({START: {3: 0.55, 4: 0.45}, 3: {END: 1.0}, 4: {5: 1.0}, 5: {6: 1.0}, 6: {END: 1.0}}, 7)


def test_greedy_follows_the_most_likely_word():
    generation = greedy(TRAP, chain_features(), DecodingConfig(max_len=5))
    assert generation.tokens.tolist() == [[3, 2], [3, 2]]
    assert generation.lengths.tolist() == [2, 2]
    assert_close(generation.scores, torch.full((2,), math.log(0.5 * 0.4)), atol=1e-4, rtol=0)
    assert_close(generation.alphas[0], torch.eye(7)[[START, 3]])


def test_beam_search_escapes_the_greedy_trap():
    generation = beam_search(TRAP, chain_features(), DecodingConfig(max_len=5, beam_size=2))
    assert generation.tokens.tolist() == [[4, 2], [4, 2]]
    assert_close(generation.scores, torch.full((2,), math.log(0.4 * 0.9)), atol=1e-4, rtol=0)
    assert_close(generation.alphas[0], torch.eye(7)[[START, 4]])  # word 2 was emitted after word "b"


def test_length_penalty_changes_the_ranking():
    short = beam_search(LONG, chain_features(1), DecodingConfig(max_len=8, beam_size=2))
    assert short.tokens.tolist() == [[3, 2]] and short.lengths.tolist() == [2]
    assert_close(short.scores, torch.tensor([math.log(0.55)]), atol=1e-4, rtol=0)
    long = beam_search(LONG, chain_features(1), DecodingConfig(max_len=8, beam_size=2, length_penalty=2.0))
    assert long.tokens.tolist() == [[4, 5, 6, 2]] and long.lengths.tolist() == [4]
    assert_close(long.scores, torch.tensor([math.log(0.45) / (9 / 6) ** 2]), atol=1e-4, rtol=0)
    assert_close(long.alphas[0], torch.eye(7)[[START, 4, 5, 6]])


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_of_one_is_greedy(mode, seed):
    decoder, features = make_decoder(mode, seed), features_for(6, seed)
    expected = greedy(decoder, features, DecodingConfig(max_len=9))
    beam = beam_search(decoder, features, DecodingConfig(max_len=9, beam_size=1))
    assert torch.equal(beam.tokens, expected.tokens)
    assert torch.equal(beam.scores, expected.scores)
    assert torch.equal(beam.lengths, expected.lengths)
    assert_close(beam.alphas, expected.alphas)


@pytest.mark.parametrize("length_penalty", [0.0, 0.7])
def test_batched_beam_equals_one_image_at_a_time(length_penalty):
    decoder, features = make_decoder(seed=3), features_for(5, seed=3)
    batched = beam_search(decoder, features, DecodingConfig(max_len=10, beam_size=3, length_penalty=length_penalty))
    for b in range(5):
        alone = beam_search(
            decoder, features[b : b + 1], DecodingConfig(max_len=10, beam_size=3, length_penalty=length_penalty)
        )
        width = batched.tokens.size(1)
        assert torch.equal(pad_to(alone.tokens[0], width), batched.tokens[b])
        assert torch.equal(alone.lengths[0], batched.lengths[b])
        assert_close(alone.scores[0], batched.scores[b])
        assert_close(pad_to(alone.alphas[0].T, width).T, batched.alphas[b])


@pytest.mark.parametrize("beam_size, end_bias", [(1, 0.75), (3, 0.5)])  # some captions end, others run out
def test_generation_agrees_with_teacher_forcing(beam_size, end_bias):
    """Re-scoring the returned captions with the teacher-forced decoder gives the same scores and
    alphas: the backpointers were followed correctly."""
    decoder, features = with_end_bias(make_decoder(seed=4), end_bias), features_for(5, seed=4)
    generation = beam_search(decoder, features, DecodingConfig(max_len=8, beam_size=beam_size))
    captions = torch.cat([torch.full((5, 1), START), generation.tokens], dim=1)
    output = decoder(features, captions)
    mask = torch.arange(generation.tokens.size(1)) < generation.lengths.unsqueeze(1)  # (B, T)
    log_probs = output.logits.log_softmax(-1).gather(-1, generation.tokens.unsqueeze(-1)).squeeze(-1)
    assert_close((log_probs * mask).sum(1), generation.scores)
    assert_close(output.alphas * mask.unsqueeze(-1), generation.alphas)
    assert_close(generation.alphas.sum(-1), mask.float())
    ended = generation.tokens.gather(1, (generation.lengths - 1).unsqueeze(1)).squeeze(1) == END  # (B,)
    assert ended.any() and not ended.all()  # both kinds of caption are checked
    assert int((generation.tokens == END).sum()) == int(ended.sum())  # <end> only as the last token
    assert not generation.tokens[~mask].any()  # pad after the end


@pytest.mark.parametrize("length_penalty, end_bias", [(0.0, -1.5), (1.5, -1.5), (0.0, -3.0)])
@torch.no_grad()
def test_a_beam_wide_enough_to_keep_every_hypothesis_finds_the_best_caption(length_penalty, end_bias):
    """3 words + <end>, 3 steps: 27 beams never prune, so beam search must agree with brute force
    over every caption of at least one word that ends within 3 steps or runs to the limit (the first case picks
    "w <end>"; the length penalty, or a lower <end> bias, "w w w")."""
    torch.manual_seed(11)
    decoder = with_end_bias(
        ShowAttendTellDecoder(6, D, net_config(embed_dim=8, hidden_dim=8, attention_dim=8, dropout=0.0)).eval(),
        end_bias,
    )
    features = features_for(2, seed=11)
    generation = beam_search(decoder, features, DecodingConfig(max_len=3, beam_size=27, length_penalty=length_penalty))
    captions = [list(words) + [END] for n in range(1, 3) for words in itertools.product([3, 4, 5], repeat=n)]
    captions += [list(words) for words in itertools.product([3, 4, 5], repeat=3)]
    for b in range(2):
        scores = []
        for caption in captions:
            tokens = torch.tensor([[START, *caption]])
            log_probs = decoder(features[b : b + 1], tokens).logits.log_softmax(-1)[0]
            score = log_probs.gather(1, tokens[0, 1:].unsqueeze(1)).sum()
            scores.append(float(score) / ((5 + len(caption)) / 6) ** length_penalty)
        best = max(range(len(captions)), key=scores.__getitem__)
        assert generation.tokens[b, : generation.lengths[b]].tolist() == captions[best]
        assert generation.scores[b].item() == pytest.approx(scores[best], abs=1e-5)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_beam_search_returns_a_caption_when_end_is_impossible(beam_size):
    decoder = with_end_bias(make_decoder(seed=5), float("-inf"))
    generation = beam_search(decoder, features_for(3), DecodingConfig(max_len=6, beam_size=beam_size))
    assert generation.tokens.shape == (3, 6) and generation.lengths.tolist() == [6, 6, 6]
    assert not (generation.tokens == END).any()
    assert torch.isfinite(generation.scores).all()
    if beam_size == 1:
        assert torch.equal(generation.tokens, greedy(decoder, features_for(3), DecodingConfig(max_len=6)).tokens)


class RepeatedPerBeam:
    """Beam search's former layout as a reference: every image's features and keys copied once per beam,
    the K beams stepped as B * K independent rows."""

    def __init__(self, decoder: ShowAttendTellDecoder) -> None:
        self.decoder, self.attention = decoder, decoder.attention

    def init_state(self, features):
        return self.decoder.init_state(features)

    def step(self, tokens, state, features, keys):
        batch, beams = tokens.shape
        logits, state, alpha, _, _ = self.decoder.step(
            tokens.reshape(-1),
            tuple(s.reshape(batch * beams, -1) for s in state),
            features.repeat_interleave(beams, 0),
            keys.repeat_interleave(beams, 0),
        )
        return (
            logits.view(batch, beams, -1),
            tuple(s.view(batch, beams, -1) for s in state),
            alpha.view(batch, beams, -1),
            None,
            None,
        )


@pytest.mark.parametrize("attention", ["additive", "dot", "scaled_dot", "bilinear", "multihead", "mean"])
@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_beam_search_scores_the_beams_against_one_copy_of_each_image(attention, mode):
    if (mode, attention) == ("hard", "multihead"):
        pytest.skip("hard attention refuses the multihead scorer (test_multihead_hard_attention_is_refused)")
    decoder = make_decoder(mode, seed=12, scorer=attention, attention_heads=2 if attention == "multihead" else 1)
    features = features_for(4, seed=12)
    shapes = []
    decoder.attention.register_forward_pre_hook(lambda module, args: shapes.append([tuple(a.shape) for a in args]))
    generation = beam_search(decoder, features, DecodingConfig(max_len=7, beam_size=3, length_penalty=0.5))
    keys = {"multihead": 32, "mean": D}.get(attention, 16)  # multihead: keys and values; mean: the features
    # keys (B, L, A), features (B, L, D): one copy per image; the states of the K beams (B, K, H)
    assert shapes and all(seen == [(4, L, keys), (4, L, D), (4, 3, 16)] for seen in shapes)
    shapes.clear()
    copied = beam_search(RepeatedPerBeam(decoder), features, DecodingConfig(max_len=7, beam_size=3, length_penalty=0.5))
    assert shapes and all(seen[1] == (12, L, D) for seen in shapes)  # the reference does copy them
    assert torch.equal(generation.tokens, copied.tokens) and torch.equal(generation.lengths, copied.lengths)
    assert_close(generation.scores, copied.scores)
    assert_close(generation.alphas, copied.alphas)
