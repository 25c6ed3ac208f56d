"""Greedy, sampling and beam search: scripted chains with known answers, then a real decoder."""

import dataclasses
import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from captioner.config import DecodingConfig
from captioner.errors import ConfigError
from captioner.model import decoding
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import beam_search, greedy, sample
from captioner.model.steps import EXIT_CHECK_INTERVAL, static_steps
from conftest import END, START, D, L, V, features_for, make_decoder, make_loss, net_config

METHODS = {"greedy": greedy, "sample": sample, "beam": beam_search}


class ChainDecoder:
    """A scripted decoder: the next word depends only on the previous one (row ``table[previous]``
    of next-word probabilities); alpha is the one-hot of the previous word, so traced alphas show
    which beam each word came from."""

    def __init__(self, table: dict[int, dict[int, float]], vocab: int) -> None:
        probs = torch.full((vocab, vocab), 1e-6)
        for previous, row in table.items():
            for word, p in row.items():
                probs[previous, word] = p
        self.log_probs = (probs / probs.sum(-1, keepdim=True)).log()  # (V, V)
        self.attention = self
        self.vocab = vocab

    def keys(self, features):
        return features

    def init_state(self, features):
        return features.new_zeros(features.size(0), 1), features.new_zeros(features.size(0), 1)

    def step(self, tokens, state, features, keys):
        return self.log_probs[tokens], state, torch.eye(self.vocab)[tokens], None, None


#        pad start end  a  b  c  d
# ids:    0    1    2   3  4  5  6
TRAP = ChainDecoder({START: {3: 0.5, 4: 0.4, END: 0.1}, 3: {END: 0.4, 5: 0.3, 6: 0.3}, 4: {END: 0.9, 5: 0.1}}, 7)
LONG = ChainDecoder({START: {3: 0.55, 4: 0.45}, 3: {END: 1.0}, 4: {5: 1.0}, 5: {6: 1.0}, 6: {END: 1.0}}, 7)


def chain_features(batch: int = 2):
    return torch.zeros(batch, 7, 1)


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


def with_end_bias(decoder: ShowAttendTellDecoder, bias: float) -> ShowAttendTellDecoder:
    """Set the output bias of <end>: -inf makes <end> impossible, a positive value makes it common."""
    with torch.no_grad():
        decoder.classifier.bias[END] = bias
    return decoder


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


def pad_to(tokens: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(tokens, (0, width - tokens.size(-1)))


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


@pytest.mark.parametrize("beam_size, end_bias", [(1, 0.25), (3, 0.0)])  # some captions end, others run out
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


@pytest.mark.parametrize("length_penalty, end_bias", [(0.0, -1.0), (1.5, -1.0), (0.0, -3.0)])
@torch.no_grad()
def test_a_beam_wide_enough_to_keep_every_hypothesis_finds_the_best_caption(length_penalty, end_bias):
    """3 words + <end>, 3 steps: 27 beams never prune, so beam search must agree with brute force
    over every caption that ends within 3 steps or runs to the limit (the three cases pick "<end>",
    "w <end>" and "w w w")."""
    torch.manual_seed(11)
    decoder = with_end_bias(
        ShowAttendTellDecoder(6, D, net_config(embed_dim=8, hidden_dim=8, attention_dim=8, dropout=0.0)).eval(),
        end_bias,
    )
    features = features_for(2, seed=11)
    generation = beam_search(decoder, features, DecodingConfig(max_len=3, beam_size=27, length_penalty=length_penalty))
    captions = [list(words) + [END] for n in range(3) for words in itertools.product([3, 4, 5], repeat=n)]
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


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_pad_and_start_are_never_generated(method):
    decoder = make_decoder(seed=10)
    with torch.no_grad():
        decoder.classifier.bias[[0, START]] = 20.0  # the model prefers them by far
    generation = METHODS[method](decoder, features_for(3), DecodingConfig(max_len=6))
    mask = torch.arange(generation.tokens.size(1)) < generation.lengths.unsqueeze(1)
    assert (generation.tokens[mask] > START).all()


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_unk_is_never_generated_when_its_id_is_given(method):
    decoder = make_decoder(seed=10)
    with torch.no_grad():
        decoder.classifier.bias[3] = 20.0  # the model prefers <unk> by far
    assert (METHODS[method](decoder, features_for(3), DecodingConfig(max_len=6)).tokens == 3).any()
    generation = METHODS[method](decoder, features_for(3), DecodingConfig(max_len=6), unk_id=3)
    assert not (generation.tokens == 3).any() and torch.isfinite(generation.scores).all()


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_an_empty_batch_gives_an_empty_generation(method):
    generation = METHODS[method](make_decoder(), features_for(0), DecodingConfig(max_len=6))
    assert generation.tokens.shape == (0, 0) and generation.alphas.shape == (0, 0, L)
    assert generation.scores.shape == generation.lengths.shape == (0,)


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_keys_are_computed_once_per_decode(method):
    decoder = with_end_bias(make_decoder(seed=7), float("-inf"))
    key_calls, steps = [], []
    decoder.attention.key.register_forward_hook(lambda m, args, out: key_calls.append(args[0].shape[0]))
    decoder.lstm.register_forward_hook(lambda m, args, out: steps.append(1))
    generation = METHODS[method](decoder, features_for(2), DecodingConfig(max_len=10))
    assert key_calls == [2] and len(steps) == 10 and generation.tokens.shape == (2, 10)


@pytest.mark.parametrize("constraints", [{}, dict(min_len=2, no_repeat_ngram_size=2)])
def test_no_host_synchronisation_inside_the_step_loop(monkeypatch, constraints):
    """Only the early-exit checks (one every EXIT_CHECK_INTERVAL steps) and the final trim read
    values back from the device, with or without the constraints."""
    decoder = with_end_bias(make_decoder(seed=8), float("-inf"))
    syncs = []

    def counted(name):
        original = getattr(torch.Tensor, name)
        return lambda self, *args: syncs.append(name) or original(self, *args)

    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    max_len = 12
    for run in METHODS.values():
        syncs.clear()
        run(decoder, features_for(3), DecodingConfig(max_len=max_len, **constraints))
        assert syncs == ["__bool__"] * (max_len // EXIT_CHECK_INTERVAL) + ["__int__"], run.__name__


def test_sampling_at_low_temperature_is_greedy_and_reproducible_with_a_generator():
    decoder, features = make_decoder(seed=9), features_for(6, seed=9)
    expected = greedy(decoder, features, DecodingConfig(max_len=8))
    cold = sample(decoder, features, DecodingConfig(max_len=8, temperature=1e-4))
    assert torch.equal(cold.tokens, expected.tokens)
    assert torch.equal(cold.scores, expected.scores)

    def draw(seed):
        return sample(
            decoder, features, DecodingConfig(max_len=8, temperature=2.0), generator=torch.Generator().manual_seed(seed)
        )

    first, again, other = draw(0), draw(0), draw(1)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.scores, again.scores)
    assert not torch.equal(first.tokens, other.tokens)
    assert not torch.equal(first.tokens, expected.tokens)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_sampling_needs_a_positive_temperature(temperature):
    with pytest.raises(ConfigError, match="temperature"):
        sample(make_decoder(), features_for(1), DecodingConfig(max_len=4, temperature=temperature))


@pytest.fixture
def one_thread():
    """Tiny training steps run faster on one thread than on two shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TRAINING_CAPTIONS = torch.tensor(
    [
        [1, 4, 5, 6, 2, 0, 0],
        [1, 7, 8, 2, 0, 0, 0],
        [1, 9, 10, 11, 5, 2, 0],
        [1, 4, 3, 7, 9, 11, 2],
    ]
)


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_a_tiny_batch_is_memorised_and_greedy_reproduces_it(mode, one_thread):
    torch.manual_seed(0)
    decoder = ShowAttendTellDecoder(
        V, D, net_config(attention=mode, embed_dim=32, hidden_dim=32, attention_dim=32, dropout=0.0)
    )
    features = torch.randn(4, L, D)
    image_index = torch.tensor([2, 0, 3, 1])  # caption n describes image image_index[n]
    loss = make_loss()
    optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-2)
    decoder.train()
    for _ in range(150):
        optimizer.zero_grad()
        loss(decoder(features, TRAINING_CAPTIONS, image_index), TRAINING_CAPTIONS)["loss"].backward()
        optimizer.step()
    decoder.eval()
    assert loss(decoder(features, TRAINING_CAPTIONS, image_index), TRAINING_CAPTIONS)["ce"] < 0.05
    generation = greedy(decoder, features, DecodingConfig(max_len=8))
    expected = TRAINING_CAPTIONS[torch.argsort(image_index), 1:]
    assert torch.equal(generation.tokens, expected[:, : generation.tokens.size(1)])
    assert generation.lengths.tolist() == (expected != 0).sum(1).tolist()


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
    ``min_len`` words before <end>). The decoder prefers "a a a a", which every blocking case forbids."""
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
        if not repeats_an_ngram([w for w in c if w != END], ngram) and (c[-1] != END or len(c) > min_len)
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


# ------------------------------------------------------------------------------------------------ static shapes
class EndsAtItsStep(torch.nn.Module):
    """A real decoder whose <end> logit is pushed down before, and up from, step 2 + (b mod 5) of image b:
    the images of a batch finish at different steps. The step counter and the target ride in the state,
    so beams and samples carry them like h and c."""

    def __init__(self, decoder: ShowAttendTellDecoder) -> None:
        super().__init__()
        self.inner, self.attention = decoder, decoder.attention

    def init_state(self, features):
        targets = 2.0 + torch.arange(features.size(0)) % 5  # (B,)
        return (*self.inner.init_state(features), torch.stack([torch.zeros_like(targets), targets], dim=1))

    def step(self, tokens, state, features, keys):
        h, c, clock = state  # clock (..., 2): steps taken, target
        logits, (h, c), alpha, log_prob, entropy = self.inner.step(tokens, (h, c), features, keys)
        clock = clock + torch.tensor([1.0, 0.0])
        push = torch.where(clock[..., 0] > clock[..., 1], 4.0, -4.0)  # (...,)
        logits = logits + torch.nn.functional.one_hot(torch.tensor(END), logits.size(-1)) * push.unsqueeze(-1)
        return logits, (h, c, clock), alpha, log_prob, entropy


def _run(method: str, decoder, features, static: bool, **options) -> decoding.Generation:
    if method == "sample":
        return sample(
            decoder, features, DecodingConfig(max_len=16, **options), torch.Generator().manual_seed(3), None, static
        )
    if method.startswith("beam"):
        options["beam_size"] = int(method[4:])
        method = "beam"
    return METHODS[method](decoder, features, DecodingConfig(max_len=16, **options), static_shapes=static)


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize("method", ["greedy", "sample", "beam1", "beam3", "beam5"])
@pytest.mark.parametrize("batch", [1, 6])
def test_static_shapes_give_the_captions_scores_and_alphas_of_the_early_exit(mode, method, batch):
    decoder = EndsAtItsStep(make_decoder(mode, seed=4))  # captions of several lengths, all well under 16
    features = features_for(batch, seed=5)
    options = dict(length_penalty=0.7) if method.startswith("beam") else {}
    dynamic = _run(method, decoder, features, False, **options)
    static = _run(method, decoder, features, True, **options)
    if batch > 1:
        assert dynamic.lengths.unique().numel() > 1  # the images finish at different steps
    assert int(dynamic.lengths.max()) < 12  # so the dynamic loop stopped early
    assert torch.equal(static.tokens, dynamic.tokens) and torch.equal(static.lengths, dynamic.lengths)
    assert torch.equal(static.scores, dynamic.scores)
    assert torch.equal(static.alphas, dynamic.alphas)


def test_static_shapes_run_every_step_without_reading_the_device(monkeypatch):
    decoder = with_end_bias(make_decoder(seed=8), 3.0)  # every caption ends at once
    steps, reads = [], []
    decoder.lstm.register_forward_hook(lambda m, args, out: steps.append(1))
    original = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: reads.append(1) or original(self))
    for run in METHODS.values():
        steps.clear(), reads.clear()
        run(decoder, features_for(3), DecodingConfig(max_len=12), static_shapes=True)
        assert len(steps) == 12 and reads == [], run.__name__
        steps.clear()
        run(decoder, features_for(3), DecodingConfig(max_len=12), static_shapes=False)
        assert len(steps) == EXIT_CHECK_INTERVAL, run.__name__


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_static_rollout_gives_the_early_exit_samples_padded_to_max_len(mode):
    decoder = EndsAtItsStep(make_decoder(mode, seed=6).train())  # hard attention samples locations too
    draws = []
    for static in (False, True):
        torch.manual_seed(0)
        draws.append(
            decoding.rollout(
                decoder,
                features_for(4),
                3,
                DecodingConfig(max_len=16),
                torch.Generator().manual_seed(1),
                static_shapes=static,
            )
        )
    dynamic, static = draws
    width = dynamic.tokens.size(1)
    assert width < 16 and static.tokens.shape == (12, 16) and dynamic.lengths.unique().numel() > 1
    assert torch.equal(static.tokens[:, :width], dynamic.tokens) and not static.tokens[:, width:].any()
    assert torch.equal(static.lengths, dynamic.lengths)
    assert torch.equal(static.log_probs[:, :width], dynamic.log_probs) and not static.log_probs[:, width:].any()


def test_static_shapes_default_to_cuda_only():
    assert decoding.ModelConfig().static_shapes is None
    assert static_steps(None, torch.zeros(1)) is False
    assert static_steps(None, torch.zeros(1, device="meta")) is False
    assert static_steps(True, torch.zeros(1)) is True


def test_decode_follows_the_settings_and_the_defaults_have_one_owner():
    import inspect

    from captioner.config import CAPTIONING_METHOD, ModelConfig

    decoder, features = make_decoder(seed=2), features_for(3)
    settings = DecodingConfig(method="beam", beam_size=2, max_len=7, length_penalty=0.5)
    expected = beam_search(decoder, features, DecodingConfig(max_len=7, beam_size=2, length_penalty=0.5))
    assert torch.equal(decoding.decode(decoder, features, settings).tokens, expected.tokens)
    defaults = DecodingConfig()
    for function in (greedy, sample, beam_search, decoding.rollout, decoding.decode):
        parameters = inspect.signature(function).parameters
        assert (
            parameters["settings"].annotation == "DecodingConfig" and parameters["settings"].default is inspect._empty
        )
        assert parameters["static_shapes"].default == ModelConfig.static_shapes
        # the settings come whole, the special tokens from the vocabulary
        assert not {field.name for field in dataclasses.fields(DecodingConfig)} & set(parameters), function.__name__
        assert not {"start_id", "end_id", "pad_id"} & set(parameters), function.__name__
    assert DecodingConfig.captioning().method == CAPTIONING_METHOD != defaults.method
    assert DecodingConfig.captioning(beam_size=5).beam_size == 5
    with pytest.raises(TypeError, match="unexpected keyword argument 'beam'"):
        DecodingConfig.captioning(beam=5)
    with pytest.raises(ConfigError, match="beam_size=0 must be >= 1"):
        DecodingConfig.captioning(beam_size=0)
