"""What greedy, sampling and beam search all guarantee: never <pad>, <start> or (given its id) <unk>; an empty batch
decodes to an empty generation; keys computed once; no host synchronisation inside the step loop. Sampling's
temperature and generator; a memorised batch decoded back; ``decode`` follows DecodingConfig, which owns the
defaults."""

import dataclasses

import pytest
import torch

from captioner.config import DecodingConfig
from captioner.errors import ConfigError
from captioner.model import decoding
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import beam_search, greedy, sample
from captioner.model.steps import EXIT_CHECK_INTERVAL
from conftest import START, D, L, V, features_for, make_decoder, make_loss, net_config
from decoding_helpers import METHODS, with_end_bias


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
    with pytest.raises(ConfigError, match=r"beam_size=0 must be in \[1, 32\]"):
        DecodingConfig.captioning(beam_size=0)
