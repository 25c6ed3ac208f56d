"""Training loss of Show, Attend and Tell: masked cross-entropy, doubly stochastic regularisation and,
for hard attention, the REINFORCE terms of eq. 12 (Xu et al. 2015); and the self-critical loss that
fine-tunes a trained captioner on a caption metric (Rennie et al. 2017)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captioner.config import LossConfig, ReinforceReward, ScstBaseline
from captioner.errors import check_choice
from captioner.model.decoder import DecoderOutput

BASELINE_SLOTS = 64  # per-step baselines kept; steps (or remaining lengths) beyond share the last one


class CaptionLoss(nn.Module):
    """Sum of the caption loss terms; ``forward`` returns each term and their total under "loss".

    Eq. 14 sums the negative log-likelihood over a caption's words and adds lambda times one penalty
    per caption. Every term here (the penalty, REINFORCE and entropy too) is divided by the same number,
    the real target tokens of the batch (neither <pad> nor <unk>, which never enter the loss), so each
    keeps its weight relative to the cross-entropy whatever the caption lengths.

    Hard attention's REINFORCE term (eq. 12) rewards each step's sampled location s_t with a per-step
    reward, as the authors' code does, not with the whole caption's log-likelihood (which is mostly the
    caption's length: its gradient on the attention is noise). ``reinforce_reward="word"``: r_t = log p(y_t | s_<=t),
    the word that location was read for; ``"suffix"``: r_t = sum_{t' >= t} log p(y_t'), everything s_t
    can influence. Its baseline b is kept per step t ("word") or per remaining length ("suffix"), starts
    at the first batch's mean and then moves as b <- decay b + (1 - decay) mean. The baselines are a
    buffer (checkpointed) and move only in training mode.
    """

    baseline: Tensor
    baseline_seen: Tensor

    def __init__(self, config: LossConfig, pad_id: int, unk_id: int | None = None) -> None:
        """``config`` holds the weights, the reward and the baseline's decay; ``pad_id`` and ``unk_id`` (None:
        no <unk>) are the vocabulary's ids that never enter the loss."""
        super().__init__()
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.ds_lambda = config.ds_lambda
        self.reinforce_weight = config.reinforce_weight
        self.reinforce_reward = config.reinforce_reward
        self.entropy_weight = config.entropy_weight
        self.baseline_decay = config.baseline_decay
        self.register_buffer("baseline", torch.zeros(BASELINE_SLOTS))
        self.register_buffer("baseline_seen", torch.zeros(BASELINE_SLOTS, dtype=torch.bool))

    def forward(
        self, output: DecoderOutput, captions: Tensor, weights: Tensor | None = None, tokens: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Loss terms for ``output`` of teacher forcing on ``captions`` (N, T+1).

        ``weights`` (N,): what each caption counts (``collate``'s ``caption_weights``: 0 for a repeated caption
        or a masked row; None: 1 each). ``tokens``: the number every term is divided by; None: this batch's
        weighted real target tokens (``target_mask``); under DDP the module passes the whole global batch's
        divided by the ranks, so that DDP's mean of the ranks' gradients is the global batch's.

        Keys: "ce" (mean cross-entropy per real token), "ds" (doubly stochastic penalty, eq. 14, weighted; absent
        with ``ds_lambda`` 0, where it would be 0 whatever the attention), "loss" (the total to minimise) and, for
        hard attention in training, "entropy" (the bonus, weighted and subtracted in "loss") and, with the
        REINFORCE estimator, "reinforce" (the surrogate whose gradient is the REINFORCE term of eq. 12; "loss"
        carries its gradient only).
        """
        targets = captions[:, 1:]  # (N, T)
        mask = self.target_mask(captions, weights).to(output.alphas.dtype)  # (N, T)
        tokens = mask.sum().clamp_min(1.0) if tokens is None else tokens
        nll = F.cross_entropy(output.logits.transpose(1, 2), targets, reduction="none") * mask  # (N, T)
        ce = nll.sum() / tokens
        terms = {"ce": ce}
        loss = ce
        if self.ds_lambda > 0:  # weight 0: no term, rather than a term that is 0 by construction
            coverage = (output.alphas * mask.unsqueeze(-1)).sum(dim=1)  # (N, L): sum_t alpha_ti over real steps
            penalty = (1.0 - coverage).square()  # (N, L)
            if weights is not None:
                penalty = penalty * weights.to(penalty.dtype).unsqueeze(1)  # a caption of weight 0 pays none
            terms["ds"] = self.ds_lambda * penalty.sum() / tokens  # eq. 14, same normaliser as ce
            loss = loss + terms["ds"]
        if output.entropy is not None:
            entropy = (output.entropy * mask * output.sampled.to(mask.dtype).unsqueeze(1)).sum() / tokens
            terms["entropy"] = entropy
            loss = loss - self.entropy_weight * entropy
        if output.location_log_probs is not None:
            reinforce = self._reinforce(output, nll, mask, tokens)
            terms["reinforce"] = reinforce
            # the surrogate adds its gradient, not its value: "loss" stays comparable with soft attention
            loss = loss + (reinforce - reinforce.detach())
        return {"loss": loss, **terms}

    def target_mask(self, captions: Tensor, weights: Tensor | None = None) -> Tensor:
        """(N, T) float: each target token's weight in the loss, its caption's weight (``forward``'s
        ``weights``) where it is a real word or <end>, 0 on <pad> and <unk>."""
        targets = captions[:, 1:]  # (N, T)
        real = targets != self.pad_id
        if self.unk_id is not None:
            real = real & (targets != self.unk_id)
        if weights is None:
            return real.float()
        return real.float() * weights.unsqueeze(1)

    def step_rewards(self, nll: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Per-step rewards r (N, T) (0 on pad steps) and the baseline slot (N, T) of each step."""
        log_lik = -nll.detach() * mask  # (N, T): log p(y_t | ...) on real steps
        steps = torch.arange(nll.size(1), device=nll.device).expand_as(nll)  # (N, T)
        if self.reinforce_reward == ReinforceReward.word:
            return log_lik, steps.clamp(max=BASELINE_SLOTS - 1)
        suffix = log_lik.flip(1).cumsum(1).flip(1)  # (N, T): sum_{t' >= t} log p(y_t')
        remaining = mask.flip(1).cumsum(1).flip(1).long()  # (N, T): real steps from t on
        return suffix, (remaining - 1).clamp(0, BASELINE_SLOTS - 1)

    def _reinforce(self, output: DecoderOutput, nll: Tensor, mask: Tensor, tokens: Tensor) -> Tensor:
        """REINFORCE surrogate of eq. 12: -w sum_t (r_t - b_t) log p(s_t), over the real sampled steps."""
        reward, slot = self.step_rewards(nll, mask)  # (N, T) x 2
        used = mask * output.sampled.to(mask.dtype).unsqueeze(1)  # (N, T): steps that sampled a location
        if self.training:
            self._update_baseline(reward, slot, used)
        advantage = (reward - self.baseline[slot]) * used  # (N, T)
        return -self.reinforce_weight * (advantage * output.location_log_probs).sum() / tokens

    @torch.no_grad()
    def _update_baseline(self, reward: Tensor, slot: Tensor, used: Tensor) -> None:
        """Per slot: b <- decay b + (1 - decay) mean r over the batch's steps of that slot, or b <- mean r
        the first time the slot is seen (no host sync)."""
        dtype = self.baseline.dtype  # float32, whatever precision the rewards come in (autocast)
        sums = torch.zeros_like(self.baseline).index_add_(0, slot.flatten(), (reward * used).flatten().to(dtype))
        counts = torch.zeros_like(self.baseline).index_add_(0, slot.flatten(), used.flatten().to(dtype))
        present = counts > 0
        mean = sums / counts.clamp_min(1.0)
        moved = self.baseline_decay * self.baseline + (1.0 - self.baseline_decay) * mean
        self.baseline.copy_(torch.where(present, torch.where(self.baseline_seen, moved, mean), self.baseline))
        self.baseline_seen.logical_or_(present)


class SelfCriticalLoss(nn.Module):
    """Self-critical sequence training (Rennie et al. 2017): REINFORCE on sampled captions, with the model's
    own captions as the baseline.

    The gradient of the expected reward is estimated from the k captions sampled per image as
    -(r(w^s) - b) * grad log p(w^s) (Rennie et al. eq. 7-9). The baseline b is the reward of the image's
    greedy caption ("greedy", Rennie et al.) or the mean reward of the image's other k - 1 samples
    ("mean", which needs no extra decoding and leaves the estimate unbiased). The surrogate is summed over
    the sampled tokens and divided by their number (under DDP: by the global batch's share per rank, ``tokens``).
    """

    def __init__(self, baseline: ScstBaseline | str) -> None:
        super().__init__()
        check_choice("scst.baseline", baseline, list(ScstBaseline))
        self.baseline = ScstBaseline(baseline)

    def forward(
        self,
        log_probs: Tensor,
        lengths: Tensor,
        rewards: Tensor,
        greedy_rewards: Tensor | None = None,
        real: Tensor | None = None,
        tokens: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Loss terms for B images x k samples.

        ``log_probs`` (B*k, T) holds the log-probability of each sampled token (0 after the end; the
        samples of image b are rows b*k .. b*k + k - 1), ``lengths`` (B*k,) the number of sampled
        tokens, ``rewards`` (B, k) the samples' rewards, ``greedy_rewards`` (B,) those of the greedy
        captions (needed by the greedy baseline), ``real`` (B,) bool whether an image is one (``collate``'s
        masked rows are not: their samples count nowhere; None: all are), ``tokens`` () what the summed surrogate
        is divided by (None: the real samples' tokens). Returns "loss" (the surrogate to minimise), "reward" (the
        samples' mean reward) and, for the greedy baseline, "greedy_reward" (the greedy captions').
        """
        batch, samples = rewards.shape
        if self.baseline == ScstBaseline.greedy:
            if greedy_rewards is None:
                raise ValueError("the greedy baseline needs the greedy captions' rewards")
            baseline = greedy_rewards.unsqueeze(1).expand(batch, samples)  # (B, k)
        else:
            if samples < 2:
                raise ValueError("the mean baseline averages the image's other samples: it needs samples >= 2")
            baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (samples - 1)  # (B, k): the others' mean
        advantage = (rewards - baseline).reshape(-1, 1).detach().to(log_probs.dtype)  # (B*k, 1)
        counted = self.counted_lengths(lengths, real, samples).unsqueeze(1)  # (B*k, 1)
        mask = torch.arange(log_probs.size(1), device=log_probs.device) < counted  # (B*k, T)
        normaliser = mask.sum().clamp_min(1) if tokens is None else tokens
        loss = -(advantage * log_probs * mask).sum() / normaliser
        terms = {"loss": loss, "reward": _mean_over(rewards, real)}
        if self.baseline == ScstBaseline.greedy:
            terms["greedy_reward"] = _mean_over(greedy_rewards, real)
        return terms

    @staticmethod
    def counted_lengths(lengths: Tensor, real: Tensor | None, samples: int) -> Tensor:
        """The sampled tokens of each caption (B*k,) that the loss counts: its ``lengths``, none for the ``samples``
        captions of an image that is not ``real`` (B,) (None: all are)."""
        return lengths if real is None else lengths * real.repeat_interleave(samples)


def _mean_over(values: Tensor, real: Tensor | None) -> Tensor:
    """The mean of ``values`` (B, ...) over the real images' rows (``real`` (B,) bool; None: all rows), with no
    host synchronisation."""
    if real is None:
        return values.mean()
    weights = real.to(values.dtype).view(-1, *[1] * (values.dim() - 1)).expand_as(values)  # (B, ...)
    return (values * weights).sum() / weights.sum().clamp_min(1)
