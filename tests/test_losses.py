"""CaptionLoss: masked cross-entropy, doubly stochastic penalty, REINFORCE with a moving baseline."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from captioner.errors import ConfigError
from captioner.model.decoder import DecoderOutput, ShowAttendTellDecoder
from conftest import make_loss, net_config

V, L = 9, 4
CAPTIONS = torch.tensor(
    [
        [1, 4, 5, 6, 2],
        [1, 7, 2, 0, 0],
        [1, 8, 3, 2, 0],
    ]
)  # 4 + 2 + 3 = 9 real target tokens


def random_output(seed: int = 0, hard: bool = False) -> DecoderOutput:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, V, generator=generator)
    alphas = torch.randn(3, 4, L, generator=generator).softmax(-1)
    if not hard:
        return DecoderOutput(logits, alphas)
    sampled = torch.tensor([True, False, True])
    log_probs = torch.rand(3, 4, generator=generator).log() * sampled.unsqueeze(1)
    entropy = -(alphas * alphas.log()).sum(-1)
    return DecoderOutput(logits, alphas, log_probs, entropy, sampled)


def real_tokens():
    return CAPTIONS[:, 1:] != 0  # (N, T)


def test_cross_entropy_is_the_mean_over_real_tokens():
    output = random_output()
    terms = make_loss()(output, CAPTIONS)
    targets, mask = CAPTIONS[:, 1:], real_tokens()
    log_probs = output.logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert_close(terms["ce"], -log_probs[mask].sum() / 9)
    assert set(terms) == {"loss", "ce", "ds"}
    assert_close(terms["loss"], terms["ce"] + terms["ds"])


def test_pad_positions_never_count():
    output = random_output()
    loss = make_loss()
    terms = loss(output, CAPTIONS)
    pad = ~real_tokens()
    changed = DecoderOutput(
        output.logits.masked_fill(pad.unsqueeze(-1), 50.0),
        torch.where(pad.unsqueeze(-1), torch.eye(L)[0], output.alphas),
    )
    for name, value in loss(changed, CAPTIONS).items():
        assert_close(value, terms[name])


def test_doubly_stochastic_penalty():
    output = random_output()
    terms = make_loss(ds_lambda=0.5)(output, CAPTIONS)
    mask = real_tokens()
    per_sample = [((1 - output.alphas[n][mask[n]].sum(0)) ** 2).sum() for n in range(3)]
    assert_close(terms["ds"], 0.5 * torch.stack(per_sample).sum() / 9)  # per real token, like ce


def test_a_doubly_stochastic_weight_of_0_leaves_the_term_out():
    output = random_output()
    terms = make_loss(ds_lambda=0.0)(output, CAPTIONS)
    assert set(terms) == {"loss", "ce"}  # no "ds" that would be 0 whatever the attention (nor a flat train/ds)
    assert_close(terms["loss"], make_loss()(output, CAPTIONS)["ce"])


def test_appending_pad_steps_changes_no_term():
    torch.manual_seed(0)
    decoder = ShowAttendTellDecoder(V, 5, net_config(embed_dim=8, hidden_dim=8, attention_dim=8, dropout=0.3)).eval()
    features = torch.randn(2, L, 5)
    index = torch.tensor([0, 1, 1])
    loss = make_loss()
    padded = torch.cat([CAPTIONS, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    terms, longer = loss(decoder(features, CAPTIONS, index), CAPTIONS), loss(decoder(features, padded, index), padded)
    for name in ("loss", "ce", "ds"):
        assert_close(longer[name], terms[name])


def per_step_log_likelihood(output: DecoderOutput) -> torch.Tensor:
    mask = real_tokens().float()
    return output.logits.log_softmax(-1).gather(-1, CAPTIONS[:, 1:].unsqueeze(-1)).squeeze(-1) * mask  # (N, T)


def slot_means(values: torch.Tensor, slots: torch.Tensor, used: torch.Tensor) -> dict[int, torch.Tensor]:
    return {int(k): values[(slots == k) & used].mean() for k in slots[used].unique()}


def test_word_reward_per_step_with_a_per_step_baseline_from_the_first_batch():
    output, second = random_output(hard=True), random_output(seed=1, hard=True)
    loss = make_loss(reinforce_weight=0.5, entropy_weight=0.1, baseline_decay=0.9).train()
    used = real_tokens() & output.sampled.unsqueeze(1)  # (N, T): row 1 read the expected context
    steps = torch.arange(4).expand(3, 4)

    reward = per_step_log_likelihood(output)  # r_t = log p(y_t | ...)
    first = slot_means(reward, steps, used)  # the first batch's mean per step, not 0
    baseline = torch.stack([first[int(t)] for t in steps.flatten()]).view(3, 4)
    terms = loss(output, CAPTIONS)
    expected = -0.5 * ((reward - baseline) * used * output.location_log_probs).sum() / 9
    assert_close(terms["reinforce"], expected)
    assert_close(terms["entropy"], (output.entropy * real_tokens())[output.sampled].sum() / 9)
    assert_close(terms["loss"], terms["ce"] + terms["ds"] - 0.1 * terms["entropy"])
    assert_close(loss.baseline[:4], torch.stack([first[t] for t in range(4)]))
    assert not loss.baseline_seen[4:].any() and (loss.baseline[4:] == 0).all()

    loss(second, CAPTIONS)  # then b_t <- 0.9 b_t + 0.1 mean_t
    later = slot_means(per_step_log_likelihood(second), steps, real_tokens() & second.sampled.unsqueeze(1))
    assert_close(loss.baseline[:4], torch.stack([0.9 * first[t] + 0.1 * later[t] for t in range(4)]))


def test_suffix_reward_sums_the_words_from_t_on_with_a_baseline_per_remaining_length():
    output = random_output(hard=True)
    loss = make_loss(reinforce_weight=1.0, reinforce_reward="suffix").train()
    log_lik = per_step_log_likelihood(output)
    lengths = real_tokens().sum(1)
    reward = torch.zeros(3, 4)
    remaining = torch.zeros(3, 4, dtype=torch.long)
    for n in range(3):
        for t in range(int(lengths[n])):
            reward[n, t] = log_lik[n, t:].sum()
            remaining[n, t] = lengths[n] - t
    used = real_tokens() & output.sampled.unsqueeze(1)
    means = slot_means(reward, remaining, used)
    baseline = torch.stack([means.get(int(k), torch.tensor(0.0)) for k in remaining.flatten()]).view(3, 4)
    terms = loss(output, CAPTIONS)
    assert_close(terms["reinforce"], -((reward - baseline) * used * output.location_log_probs).sum() / 9)
    assert_close(loss.baseline[[k - 1 for k in sorted(means)]], torch.stack([means[k] for k in sorted(means)]))


def test_reinforce_gradient_on_the_attention_scores_has_its_analytic_form():
    """d/de_t of the surrogate = -w / tokens * (r_t - b_t) * (onehot(s_t) - alpha_t) on sampled real steps."""
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(3, 4, L, generator=generator, requires_grad=True)  # e_t, (N, T, L)
    alphas = scores.softmax(-1)
    chosen = torch.randint(0, L, (3, 4), generator=generator)  # s_t
    sampled = torch.tensor([True, False, True])
    log_probs = alphas.log().gather(-1, chosen.unsqueeze(-1)).squeeze(-1) * sampled.unsqueeze(1)
    logits = torch.randn(3, 4, V, generator=generator)
    output = DecoderOutput(logits, alphas.detach(), log_probs, torch.zeros(3, 4), sampled)
    loss = make_loss(ds_lambda=0.0, reinforce_weight=0.3, entropy_weight=0.0).train()
    loss.baseline.copy_(torch.linspace(-3.0, -1.0, 64))
    loss.baseline_seen.fill_(True)
    loss.baseline_decay = 1.0  # keep b fixed for the check
    loss(output, CAPTIONS)["loss"].backward()

    advantage = (per_step_log_likelihood(output) - loss.baseline[:4]) * (real_tokens() & sampled.unsqueeze(1))
    analytic = -0.3 / 9 * advantage.unsqueeze(-1) * (F.one_hot(chosen, L) - alphas.detach())
    assert_close(scores.grad, analytic)


def test_unk_targets_never_enter_the_loss():
    output = random_output()
    with_unk = make_loss(unk_id=3)(output, CAPTIONS)  # caption 2 has <unk> (id 3) as a target
    log_probs = output.logits.log_softmax(-1).gather(-1, CAPTIONS[:, 1:].unsqueeze(-1)).squeeze(-1)
    counted = real_tokens() & (CAPTIONS[:, 1:] != 3)
    assert_close(with_unk["ce"], -log_probs[counted].sum() / 8)


def test_baseline_holds_in_eval_mode_and_without_samples():
    output = random_output(hard=True)
    loss = make_loss().eval()
    loss(output, CAPTIONS)
    assert not loss.baseline.any() and not loss.baseline_seen.any()
    output.sampled = torch.zeros(3, dtype=torch.bool)
    output.location_log_probs = torch.zeros(3, 4)
    loss.train()(output, CAPTIONS)
    assert not loss.baseline.any() and not loss.baseline_seen.any()


def test_baseline_is_checkpointed():
    loss = make_loss()
    loss(random_output(hard=True), CAPTIONS)
    restored = make_loss()
    restored.load_state_dict(loss.state_dict())
    assert "baseline" in loss.state_dict() and torch.equal(restored.baseline, loss.baseline)
    assert restored.baseline_seen[:4].all() and loss.baseline[:4].ne(0).all()


def attention_gradients(decoder: ShowAttendTellDecoder) -> list[torch.Tensor | None]:
    return [p.grad for p in decoder.attention.parameters()]


def test_reinforce_is_the_path_from_the_loss_to_hard_attention():
    torch.manual_seed(0)
    decoder = ShowAttendTellDecoder(
        V,
        5,
        net_config(
            attention="hard", embed_dim=8, hidden_dim=8, attention_dim=8, hard_expectation_prob=0.0, dropout=0.0
        ),
    ).train()
    features = torch.randn(2, L, 5)
    loss = make_loss(ds_lambda=0.0)
    terms = loss(decoder(features, CAPTIONS, torch.tensor([0, 1, 1])), CAPTIONS)
    terms["ce"].backward(retain_graph=True)  # z_t = a_{s_t}: no gradient reaches the scorer
    assert all(g is None or not g.any() for g in attention_gradients(decoder))
    (terms["loss"] - terms["ce"]).backward()
    gradients = attention_gradients(decoder)
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in gradients)


def test_soft_output_has_no_reinforce_terms():
    terms = make_loss()(random_output(), CAPTIONS)
    assert "reinforce" not in terms and "entropy" not in terms


@pytest.mark.parametrize(
    "option",
    [dict(ds_lambda=-1.0), dict(baseline_decay=1.5), dict(entropy_weight="x"), dict(reinforce_reward="sequence")],
)
def test_invalid_weights_raise(option):
    with pytest.raises(ConfigError, match=next(iter(option))):
        make_loss(**option)


def test_cross_entropy_matches_torch_with_ignore_index():
    output = random_output(seed=3)
    expected = F.cross_entropy(output.logits.reshape(-1, V), CAPTIONS[:, 1:].reshape(-1), ignore_index=0)
    assert_close(make_loss()(output, CAPTIONS)["ce"], expected)
