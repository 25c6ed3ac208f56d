"""Show-Attend-Tell decoder: one step against the paper's equations, teacher forcing, hard attention."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from captioner.config import Compile
from captioner.errors import ConfigError
from captioner.model.decoder import ShowAttendTellDecoder
from conftest import net_config

V, D, E, H, A, L = 11, 6, 8, 10, 9, 4


def make_decoder(**options) -> ShowAttendTellDecoder:
    """A seeded decoder E/H/A wide without dropout; ``options`` are ``net_config``'s."""
    torch.manual_seed(0)
    return ShowAttendTellDecoder(
        V, D, net_config(**{"embed_dim": E, "hidden_dim": H, "attention_dim": A, "dropout": 0.0, **options})
    )


@pytest.fixture
def batch():
    """3 images, 5 captions (image_index 0, 0, 1, 2, 2) of 2 to 6 words, padded with 0."""
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(3, L, D, generator=generator)
    captions = torch.tensor(
        [
            [1, 4, 5, 6, 2, 0, 0],
            [1, 7, 2, 0, 0, 0, 0],
            [1, 8, 9, 10, 4, 5, 2],
            [1, 3, 3, 2, 0, 0, 0],
            [1, 6, 5, 4, 9, 2, 0],
        ]
    )
    return features, captions, torch.tensor([0, 0, 1, 2, 2])


def test_soft_forward_shapes_and_distributions(batch):
    features, captions, index = batch
    output = make_decoder().train()(features, captions, index)
    assert output.logits.shape == (5, 6, V) and output.alphas.shape == (5, 6, L)
    assert output.location_log_probs is None and output.entropy is None and output.sampled is None
    assert_close(output.alphas.sum(-1), torch.ones(5, 6))


def test_init_state_is_tanh_of_an_affine_map_of_the_mean(batch):
    features, _, _ = batch
    decoder = make_decoder()
    h, c = decoder.init_state(features)
    mean = features.mean(dim=1)
    assert_close(h, torch.tanh(mean @ decoder.init_h.weight.T + decoder.init_h.bias))
    assert_close(c, torch.tanh(mean @ decoder.init_c.weight.T + decoder.init_c.bias))


@pytest.mark.parametrize("gate", ["scalar", "vector", "none"])
@pytest.mark.parametrize("deep_output", [True, False])
def test_one_step_follows_the_equations(batch, gate, deep_output):
    features, _, _ = batch
    decoder = make_decoder(gate=gate, deep_output=deep_output).eval()
    lstm_inputs = []
    decoder.lstm.register_forward_hook(lambda module, args, out: lstm_inputs.append(args[0]))
    tokens = torch.tensor([1, 5, 7])
    keys, (h0, c0) = decoder.attention.keys(features), decoder.init_state(features)
    logits, (h1, c1), alpha, log_prob, entropy = decoder.step(tokens, (h0, c0), features, keys)

    context, expected_alpha = decoder.attention(keys, features, h0)  # attention from h_{t-1}
    if gate == "none":
        assert decoder.f_beta is None
        z = context
    else:  # beta_t = sigmoid(f_beta(h_{t-1})): one gate, or one per feature channel
        beta = torch.sigmoid(decoder.f_beta(h0))
        assert beta.shape == (3, 1 if gate == "scalar" else D)
        z = beta * context
    embedded = decoder.embedding(tokens)
    assert_close(lstm_inputs[0], torch.cat([embedded, z], dim=-1))  # [E y_{t-1}; z_t]
    assert_close((h1, c1), decoder.lstm(torch.cat([embedded, z], dim=-1), (h0, c0)))
    if deep_output:  # eq. 7
        expected = decoder.classifier(embedded + decoder.deep_h(h1) + decoder.deep_z(z))
    else:
        expected = decoder.classifier(h1)
    assert_close(logits, expected)
    assert_close(alpha, expected_alpha)
    assert log_prob is None and entropy is None


def test_forward_equals_stepping_through_the_caption(batch):
    features, captions, _ = batch
    decoder = make_decoder(dropout=0.5).eval()
    output = decoder(features, captions[:3])
    keys, state = decoder.attention.keys(features), decoder.init_state(features)
    for t in range(captions.size(1) - 1):
        logits, state, alpha, _, _ = decoder.step(captions[:3, t], state, features, keys)
        assert_close(output.logits[:, t], logits)
        assert_close(output.alphas[:, t], alpha)


def test_keys_and_initial_state_are_computed_once_per_image(batch):
    features, captions, index = batch
    decoder = make_decoder()
    key_batches, init_batches = [], []
    decoder.attention.key.register_forward_hook(lambda m, args, out: key_batches.append(args[0].shape[0]))
    decoder.init_h.register_forward_hook(lambda m, args, out: init_batches.append(args[0].shape[0]))
    decoder(features, captions, index)
    assert key_batches == [3] and init_batches == [3]


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_image_index_equals_repeating_the_features(batch, mode):
    features, captions, index = batch
    decoder = make_decoder(attention=mode, dropout=0.0).train(mode == "soft")  # hard: argmax locations in eval
    gathered = decoder(features, captions, index)
    repeated = decoder(features[index], captions)
    for name in ("logits", "alphas", "location_log_probs", "entropy", "sampled"):
        assert_close(getattr(gathered, name), getattr(repeated, name))


def test_pad_steps_do_not_change_the_real_steps(batch):
    features, captions, index = batch
    decoder = make_decoder().eval()
    output = decoder(features, captions, index)
    longer = decoder(features, torch.cat([captions, torch.zeros(5, 3, dtype=torch.long)], dim=1), index)
    assert longer.logits.shape[1] == output.logits.shape[1] + 3
    assert_close(longer.logits[:, :6], output.logits)
    assert_close(longer.alphas[:, :6], output.alphas)


def test_hard_training_outputs(batch):
    features, captions, index = batch
    decoder = make_decoder(attention="hard", hard_expectation_prob=0.0).train()
    output = decoder(features, captions, index)
    assert output.location_log_probs.shape == (5, 6) and output.entropy.shape == (5, 6)
    assert output.sampled.dtype == torch.bool and output.sampled.all()
    log_alphas = output.alphas.log()
    matches = (output.location_log_probs.unsqueeze(-1) - log_alphas).abs() < 1e-5  # log alpha of some location
    assert matches.any(dim=-1).all()
    assert_close(output.entropy, -(output.alphas * log_alphas).sum(-1))


def test_expectation_is_chosen_per_image():
    decoder = make_decoder(attention="hard", hard_expectation_prob=0.5).train()
    features = torch.randn(200, L, D)
    index = torch.arange(200).repeat_interleave(3)  # three captions per image
    captions = torch.randint(3, V, (600, 4))
    torch.manual_seed(0)
    output = decoder(features, captions, index)
    per_image = output.sampled.view(200, 3)
    assert (per_image == per_image[:, :1]).all()  # every caption of an image makes the same choice
    assert 70 < int(per_image[:, 0].sum()) < 130
    assert (output.location_log_probs[~output.sampled] == 0).all()
    assert (output.location_log_probs[output.sampled] < 0).all()


def test_expected_context_warm_up_falls_from_every_image_to_the_mix():
    decoder = make_decoder(attention="hard", hard_expectation_prob=0.2, hard_expectation_warmup=0.5).train()
    features = torch.randn(400, L, D)
    captions = torch.randint(3, V, (400, 4))
    torch.manual_seed(0)
    shares = []
    for progress in (0.0, 0.25, 0.5, 1.0):  # the share falls linearly to 0.2 at half of training, then stays
        decoder.anneal(progress)
        shares.append(1.0 - float(decoder(features, captions).sampled.float().mean()))
    assert shares[0] == 1.0  # every image reads the expected context at the start: soft attention's training
    assert shares[1] == pytest.approx(0.6, abs=0.07)
    assert shares[2] == pytest.approx(0.2, abs=0.06) and shares[3] == pytest.approx(0.2, abs=0.06)
    mixed = make_decoder(attention="hard", hard_expectation_prob=0.2, hard_expectation_warmup=0.0).train()  # mix at 0
    mixed.anneal(0.0)
    assert 1.0 - float(mixed(features, captions).sampled.float().mean()) == pytest.approx(0.2, abs=0.06)


def test_gumbel_estimator_reads_one_location_and_trains_the_attention(batch):
    features, captions, index = batch
    decoder = make_decoder(attention="hard", hard_estimator="gumbel", hard_expectation_prob=0.0, gate="none").train()
    lstm_inputs = []
    decoder.lstm.register_forward_hook(lambda module, args, out: lstm_inputs.append(args[0]))
    output = decoder(features, captions, index)
    assert output.location_log_probs is None and output.sampled.all() and output.entropy.shape == (5, 6)
    z = lstm_inputs[0][:, E:]  # (N, D): one annotation vector of each caption's image, not a mixture
    distances = (z.unsqueeze(1) - features[index]).abs().sum(-1)  # (N, L)
    assert (distances.min(dim=1).values < 1e-5).all()
    F.cross_entropy(output.logits.reshape(-1, V), captions[:, 1:].reshape(-1)).backward()
    gradients = [p.grad for p in decoder.attention.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in gradients)


def test_gumbel_temperature_anneals_geometrically():
    decoder = make_decoder(attention="hard", hard_estimator="gumbel", gumbel_tau=2.0, gumbel_tau_min=0.5)
    assert decoder.gumbel_tau == 2.0
    decoder.anneal(0.5)
    assert decoder.gumbel_tau == pytest.approx(1.0)
    decoder.anneal(1.0)
    assert decoder.gumbel_tau == pytest.approx(0.5)


def test_multihead_hard_attention_is_refused():
    with pytest.raises(ConfigError, match="multihead works with soft attention only"):
        make_decoder(attention="hard", scorer="multihead", attention_heads=2)


def test_hard_with_expectation_always_equals_soft(batch):
    features, captions, index = batch
    soft = make_decoder().train()
    hard = make_decoder(attention="hard", hard_expectation_prob=1.0).train()
    hard.load_state_dict(soft.state_dict())
    expected, output = soft(features, captions, index), hard(features, captions, index)
    assert_close(output.logits, expected.logits)
    assert not output.sampled.any() and (output.location_log_probs == 0).all()


def test_hard_inference_uses_the_most_likely_location(batch):
    features, _, _ = batch
    decoder = make_decoder(attention="hard", gate="none").eval()
    lstm_inputs = []
    decoder.lstm.register_forward_hook(lambda module, args, out: lstm_inputs.append(args[0]))
    keys, state = decoder.attention.keys(features), decoder.init_state(features)
    _, _, alpha, log_prob, entropy = decoder.step(torch.tensor([1, 1, 1]), state, features, keys)
    assert log_prob is None and entropy is None
    assert_close(lstm_inputs[0][:, E:], features[torch.arange(3), alpha.argmax(-1)])


def test_hard_inference_expectation_equals_soft(batch):
    features, captions, index = batch
    soft = make_decoder().eval()
    hard = make_decoder(attention="hard", hard_inference="expectation").eval()
    hard.load_state_dict(soft.state_dict())
    assert_close(hard(features, captions, index).logits, soft(features, captions, index).logits)


def test_dropout_acts_in_training_only(batch):
    features, captions, index = batch
    decoder = make_decoder(dropout=0.5).train()
    assert not torch.equal(decoder(features, captions, index).logits, decoder(features, captions, index).logits)
    decoder.eval()
    assert torch.equal(decoder(features, captions, index).logits, decoder(features, captions, index).logits)


@pytest.mark.parametrize(
    "option",
    [
        dict(attention="stochastic"),
        dict(gate="sigmoid"),
        dict(hard_inference="sample"),
        dict(dropout=1.5),
        dict(scorer="luong"),
        dict(hard_expectation_prob=-0.1),
        dict(hard_estimator="straight"),
        dict(gumbel_tau=0.0),
    ],
)
def test_invalid_options_raise_config_error(option):
    with pytest.raises(ConfigError, match=next(iter(option))):
        make_decoder(**option)


@pytest.mark.parametrize("attention", ["additive", "dot", "scaled_dot", "bilinear", "multihead", "mean"])
@pytest.mark.parametrize("mode, hard_inference", [("soft", "argmax"), ("hard", "argmax"), ("hard", "expectation")])
def test_k_states_per_image_equal_the_features_repeated_per_state(batch, attention, mode, hard_inference):
    """A step of K sequences per image (tokens (B, K), states (B, K, H)) on one copy of the features and
    keys gives what the old layout, the features and keys repeated K times (B * K rows), gives."""
    if (mode, attention) == ("hard", "multihead"):
        pytest.skip("hard attention refuses the multihead scorer (test_multihead_hard_attention_is_refused)")
    features, _, _ = batch
    heads = 3 if attention == "multihead" else 1
    decoder = make_decoder(scorer=attention, attention_heads=heads, attention=mode, hard_inference=hard_inference)
    decoder.eval()
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, V, (3, 4), generator=generator)  # (B, K)
    state = tuple(torch.randn(3, 4, H, generator=generator) for _ in range(2))  # (B, K, H) x 2
    keys = decoder.attention.keys(features)
    logits, (h, c), alpha, _, _ = decoder.step(tokens, state, features, keys)
    assert logits.shape == (3, 4, V) and h.shape == c.shape == (3, 4, H) and alpha.shape == (3, 4, L)
    rows = decoder.step(
        tokens.view(-1),
        tuple(s.view(12, H) for s in state),
        features.repeat_interleave(4, 0),
        keys.repeat_interleave(4, 0),
    )
    assert_close(logits, rows[0].view(3, 4, V))
    assert_close((h, c), tuple(s.view(3, 4, H) for s in rows[1]))
    assert_close(alpha, rows[2].view(3, 4, L))


def test_a_deepcopy_of_a_compiled_decoder_steps_with_its_own_weights(monkeypatch: pytest.MonkeyPatch):
    """``compile_step``'s compiled step, copied with the decoder (``AveragedModel`` deep-copies its model), reads
    the copy's weights: with other weights than the original's, the copy's compiled step equals its eager one.
    Compiled by dynamo with the eager backend (inductor's kernels take a minute on a CPU: the step they run is
    dynamo's graph either way)."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **options: compile_(fn, backend="eager", **options))
    torch._dynamo.reset()
    decoder = make_decoder().train()
    decoder.compile_step(Compile.default)
    copied = copy.deepcopy(decoder)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.mul_(-1.5)
    features = torch.randn(3, L, D, generator=torch.Generator().manual_seed(2))
    for model in (copied, decoder):
        inputs = model.embedding(torch.tensor([4, 5, 6])), model.init_state(features), features
        compiled = model.compiled_step(*inputs, model.attention.keys(features), None)
        eager = model._eager_step(*inputs, model.attention.keys(features), None)
        torch.testing.assert_close(compiled[0], eager[0])  # logits (3, V)
        torch.testing.assert_close(compiled[1][0], eager[1][0])  # h (3, H)


def test_hard_read_is_the_one_answer_to_which_read_from_the_decoders_config():
    """None for soft attention; for hard attention its config's hard_inference, read when decoding: setting the
    config (what ``--hard-inference`` does to a loaded model's) changes what the decoder reads."""
    assert make_decoder().hard_read is None
    settings = net_config(attention="hard", embed_dim=E, hidden_dim=H, attention_dim=A, gate="none")
    decoder = ShowAttendTellDecoder(V, D, settings).eval()
    assert decoder.hard_read == "argmax" and not hasattr(decoder, "hard_inference")
    features = torch.randn(3, L, D, generator=torch.Generator().manual_seed(3))
    keys, state = decoder.attention.keys(features), decoder.init_state(features)
    tokens = torch.tensor([1, 1, 1])
    argmax = decoder.step(tokens, state, features, keys)[0]
    settings.decoder.hard_inference = "expectation"
    assert decoder.hard_read == "expectation"
    expectation = decoder.step(tokens, state, features, keys)[0]
    decoder.mode = "soft"  # the same weights reading the expected context
    assert_close(expectation, decoder.step(tokens, state, features, keys)[0])
    assert not torch.allclose(argmax, expectation)
