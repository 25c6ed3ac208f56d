"""Self-critical sequence training: the batched policy rollout, the self-critical loss, and SCST runs of
train.py (from a cross-entropy run, resumed, under DDP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from captioner.errors import ConfigError
from captioner.model import decoding
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import PAD_ID, rollout
from captioner.model.losses import SelfCriticalLoss
from conftest import run_train, tiny_overrides

START, END = 1, 2
V, D, L = 12, 6, 4


def make_decoder(mode: str = "soft", seed: int = 0) -> ShowAttendTellDecoder:
    torch.manual_seed(seed)
    return ShowAttendTellDecoder(V, D, 16, 16, 16, mode=mode, dropout=0.0)


def features_for(batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, L, D, generator=torch.Generator().manual_seed(seed))


def teacher_forced_log_probs(decoder: ShowAttendTellDecoder, features: torch.Tensor, tokens: torch.Tensor,
                             samples: int) -> torch.Tensor:
    """log p of each token of ``tokens`` (N, T) under teacher forcing, over the words rollout may draw."""
    captions = torch.cat([torch.full((tokens.size(0), 1), START), tokens], dim=1)  # (N, T+1)
    index = torch.arange(features.size(0)).repeat_interleave(samples)
    logits = decoder(features, captions, index).logits  # (N, T, V)
    logits[..., [PAD_ID, START]] = float("-inf")
    return logits.log_softmax(-1).gather(2, tokens.unsqueeze(2)).squeeze(2)  # (N, T)


def test_rollout_samples_k_captions_per_image_with_their_log_probs() -> None:
    decoder, features = make_decoder().eval(), features_for(3)
    torch.manual_seed(0)
    drawn = rollout(decoder, features, 4, 9, START, END)
    rows, steps = drawn.tokens.shape
    assert rows == 12 and steps <= 9 and drawn.log_probs.shape == (12, steps) and drawn.lengths.shape == (12,)
    mask = torch.arange(steps) < drawn.lengths.unsqueeze(1)
    assert bool((drawn.tokens[~mask] == PAD_ID).all()) and bool((drawn.log_probs[~mask] == 0).all())
    assert not bool(((drawn.tokens == PAD_ID) | (drawn.tokens == START))[mask].any())
    ended = drawn.lengths < steps
    last = drawn.tokens.gather(1, (drawn.lengths - 1).unsqueeze(1)).squeeze(1)
    assert bool((last[ended] == END).all())
    assert drawn.log_probs.requires_grad
    # each token's log-probability is the policy's for that token given the sampled prefix
    expected = teacher_forced_log_probs(decoder, features, drawn.tokens, 4)
    assert_close(drawn.log_probs[mask], expected[mask], atol=1e-5, rtol=0)
    # the samples of one image differ (it is sampling, not k copies of one caption)
    assert len({tuple(row) for row in drawn.tokens[:4].tolist()}) > 1


def test_rollout_runs_all_samples_at_once_without_host_reads_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = make_decoder().eval()
    with torch.no_grad():
        decoder.classifier.bias[END] = float("-inf")  # never ends: every step runs
    steps, reads = [], []
    decoder.lstm.register_forward_hook(lambda module, args, out: steps.append(args[0].shape[0]))

    def counted(name):
        original = getattr(torch.Tensor, name)
        return lambda self, *args: reads.append(name) or original(self, *args)

    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    rollout(decoder, features_for(3), 5, 12, START, END)
    assert steps == [15] * 12  # one decoder step per word for the 3 x 5 captions together
    assert reads == ["__bool__"] * (12 // decoding.EXIT_CHECK_INTERVAL)  # only the early-exit checks


def test_hard_attention_rollout_carries_the_sampled_locations_in_the_policy_gradient() -> None:
    decoder, features = make_decoder("hard").train(), features_for(2)
    torch.manual_seed(1)
    drawn = rollout(decoder, features, 3, 6, START, END)
    drawn.log_probs.sum().backward()
    # a sampled location a_s reaches the words without any gradient to the attention scorer: its
    # gradient comes from log alpha(s), the location's own log-probability
    assert decoder.attention.query.weight.grad.abs().sum() > 0
    decoder.zero_grad()
    drawn = rollout(decoder.eval(), features, 3, 6, START, END)  # eval: the most likely location, no sampling
    drawn.log_probs.sum().backward()
    assert decoder.attention.query.weight.grad is None or decoder.attention.query.weight.grad.abs().sum() == 0


def test_self_critical_gradient_raises_samples_above_the_baseline_and_lowers_those_below() -> None:
    log_probs = torch.zeros(6, 3, requires_grad=True)  # 2 images x 3 samples, 3 steps
    lengths = torch.tensor([3, 3, 3, 2, 3, 1])
    rewards = torch.tensor([[1.0, 0.0, 0.5], [2.0, 2.0, 2.0]])
    terms = SelfCriticalLoss("mean")(log_probs, lengths, rewards)
    terms["loss"].backward()
    # advantages: r_i minus the mean of the image's other samples
    advantage = torch.tensor([0.75, -0.75, 0.0, 0.0, 0.0, 0.0])
    mask = (torch.arange(3) < lengths.unsqueeze(1)).float()
    assert_close(log_probs.grad, -advantage.unsqueeze(1) * mask / mask.sum())
    assert terms.keys() == {"loss", "reward"} and terms["reward"].item() == pytest.approx(7.5 / 6)

    log_probs.grad = None
    terms = SelfCriticalLoss("greedy")(log_probs, lengths, rewards, greedy_rewards=torch.tensor([0.5, 3.0]))
    terms["loss"].backward()
    assert terms["greedy_reward"].item() == pytest.approx(1.75)
    advantage = torch.tensor([0.5, -0.5, 0.0, -1.0, -1.0, -1.0])  # r_i minus the greedy caption's reward
    assert_close(log_probs.grad, -advantage.unsqueeze(1) * mask / mask.sum())
    with pytest.raises(ValueError, match="greedy captions' rewards"):
        SelfCriticalLoss("greedy")(log_probs, lengths, rewards)
    with pytest.raises(ConfigError, match="samples >= 2"):
        SelfCriticalLoss("mean")(log_probs[:2], lengths[:2], rewards[:, :1])
    with pytest.raises(ConfigError, match="baseline='best' is not valid"):
        SelfCriticalLoss("best")


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_one_self_critical_step_makes_the_better_sample_likelier_and_the_worse_less_likely(mode: str) -> None:
    decoder, features = make_decoder(mode, seed=3).train(), features_for(1, seed=3)
    torch.manual_seed(4)
    drawn = rollout(decoder, features, 2, 6, START, END)
    assert not torch.equal(drawn.tokens[0], drawn.tokens[1])
    decoder.eval()  # scored without location sampling: the words' probabilities alone
    before = teacher_forced_log_probs(decoder, features, drawn.tokens, 2).detach()
    mask = torch.arange(drawn.tokens.size(1)) < drawn.lengths.unsqueeze(1)
    optimizer = torch.optim.SGD(decoder.parameters(), lr=0.5)
    loss = SelfCriticalLoss("mean")(drawn.log_probs, drawn.lengths, torch.tensor([[1.0, 0.0]]))["loss"]
    loss.backward()
    optimizer.step()
    after = teacher_forced_log_probs(decoder, features, drawn.tokens, 2).detach()
    gain = ((after - before) * mask).sum(dim=1)  # change of log p(caption)
    assert gain[0] > 0 > gain[1]
