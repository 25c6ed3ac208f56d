"""Training loss of Show, Attend and Tell: masked cross-entropy, doubly stochastic regularisation and,
for hard attention, the REINFORCE terms of eq. 12 (Xu et al. 2015); and the self-critical loss that
fine-tunes a trained captioner on a caption metric (Rennie et al. 2017)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captioner.errors import ConfigError, check_choice, check_range
from captioner.model.decoder import DecoderOutput


class CaptionLoss(nn.Module):
    """Sum of the caption loss terms; ``forward`` returns each term and their total under "loss".

    Eq. 14 sums the negative log-likelihood over a caption's words and adds lambda times one penalty
    per caption. Every term here (the penalty, REINFORCE and entropy too) is divided by the same number,
    the real (non-pad) target tokens of the batch, so each keeps the paper's weight relative to the
    cross-entropy whatever the caption lengths. The moving-average reward baseline is a buffer
    (checkpointed) and moves only in training mode.
    """

    baseline: Tensor

    def __init__(self, pad_id: int, ds_lambda: float = 1.0, reinforce_weight: float = 1.0,
                 entropy_weight: float = 0.002, baseline_decay: float = 0.9) -> None:
        super().__init__()
        check_range("ds_lambda", ds_lambda, 0.0)
        check_range("reinforce_weight", reinforce_weight, 0.0)
        check_range("entropy_weight", entropy_weight, 0.0)
        check_range("baseline_decay", baseline_decay, 0.0, 1.0)
        self.pad_id = pad_id
        self.ds_lambda = ds_lambda
        self.reinforce_weight = reinforce_weight
        self.entropy_weight = entropy_weight
        self.baseline_decay = baseline_decay
        self.register_buffer("baseline", torch.zeros(()))

    def forward(self, output: DecoderOutput, captions: Tensor) -> dict[str, Tensor]:
        """Loss terms for ``output`` of teacher forcing on ``captions`` (N, T+1).

        Keys: "ce" (mean cross-entropy per real token), "ds" (doubly stochastic penalty, eq. 14),
        "loss" (the total to minimise) and, for hard attention in training, "reinforce" (the
        surrogate whose gradient is the REINFORCE term of eq. 12; "loss" carries its gradient only)
        and "entropy" (the bonus, weighted and subtracted in "loss").
        """
        targets = captions[:, 1:]  # (N, T)
        mask = (targets != self.pad_id).to(output.alphas.dtype)  # (N, T)
        tokens = mask.sum().clamp_min(1.0)
        nll = F.cross_entropy(output.logits.transpose(1, 2), targets, ignore_index=self.pad_id,
                              reduction="none")  # (N, T), 0 on pad
        ce = nll.sum() / tokens
        coverage = (output.alphas * mask.unsqueeze(-1)).sum(dim=1)  # (N, L): sum_t alpha_ti over real steps
        ds = self.ds_lambda * (1.0 - coverage).square().sum() / tokens  # eq. 14, same normaliser as ce
        terms = {"ce": ce, "ds": ds}
        loss = ce + ds
        if output.location_log_probs is not None:
            reinforce, entropy = self._reinforce(output, nll, mask, tokens)
            terms.update(reinforce=reinforce, entropy=entropy)
            # the surrogate adds its gradient, not its value: "loss" stays comparable with soft attention
            loss = loss + (reinforce - reinforce.detach()) - self.entropy_weight * entropy
        return {"loss": loss, **terms}

    def _reinforce(self, output: DecoderOutput, nll: Tensor, mask: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """REINFORCE surrogate and entropy bonus of eq. 12 over the sequences that sampled locations."""
        sampled = output.sampled.to(mask.dtype)  # (N,)
        reward = -nll.sum(dim=1).detach()  # (N,): log p(y | s, a)
        location = (output.location_log_probs * mask).sum(dim=1)  # (N,): log p(s | a), 0 for expectation rows
        reinforce = -self.reinforce_weight * ((reward - self.baseline) * location).sum() / tokens
        entropy = (output.entropy * mask * sampled.unsqueeze(1)).sum() / tokens
        if self.training:
            self._update_baseline(reward, sampled)
        return reinforce, entropy

    @torch.no_grad()
    def _update_baseline(self, reward: Tensor, sampled: Tensor) -> None:
        """b <- decay b + (1 - decay) mean log p(y | s) over the sampled sequences (no host sync)."""
        count = sampled.sum()
        mean = (reward * sampled).sum() / count.clamp_min(1.0)
        moved = self.baseline_decay * self.baseline + (1.0 - self.baseline_decay) * mean
        self.baseline.copy_(torch.where(count > 0, moved, self.baseline))


SCST_BASELINES = ("mean", "greedy")


def check_scst_samples(baseline: str, samples: int) -> None:
    """ConfigError when the mean baseline would have no other sample to average (fewer than 2 per image)."""
    if baseline == "mean" and samples < 2:
        raise ConfigError("model.scst.baseline=mean compares each sample with the image's other samples: "
                          "it needs model.scst.samples >= 2")


class SelfCriticalLoss(nn.Module):
    """Self-critical sequence training (Rennie et al. 2017): REINFORCE on sampled captions, with the model's
    own captions as the baseline.

    The gradient of the expected reward is estimated from the k captions sampled per image as
    -(r(w^s) - b) * grad log p(w^s) (Rennie et al. eq. 7-9). The baseline b is the reward of the image's
    greedy caption ("greedy", Rennie et al.) or the mean reward of the image's other k - 1 samples
    ("mean", which needs no extra decoding and leaves the estimate unbiased). The surrogate is summed over
    the sampled tokens and divided by their number.
    """

    def __init__(self, baseline: str = "mean") -> None:
        super().__init__()
        check_choice("baseline", baseline, SCST_BASELINES)
        self.baseline = baseline

    def forward(self, log_probs: Tensor, lengths: Tensor, rewards: Tensor,
                greedy_rewards: Tensor | None = None) -> dict[str, Tensor]:
        """Loss terms for B images x k samples.

        ``log_probs`` (B*k, T) holds the log-probability of each sampled token (0 after the end; the
        samples of image b are rows b*k .. b*k + k - 1), ``lengths`` (B*k,) the number of sampled
        tokens, ``rewards`` (B, k) the samples' rewards, ``greedy_rewards`` (B,) those of the greedy
        captions (needed by the greedy baseline). Returns "loss" (the surrogate to minimise), "reward"
        (the samples' mean reward) and, for the greedy baseline, "greedy_reward" (the greedy captions').
        """
        batch, samples = rewards.shape
        if self.baseline == "greedy":
            if greedy_rewards is None:
                raise ValueError("the greedy baseline needs the greedy captions' rewards")
            baseline = greedy_rewards.unsqueeze(1).expand(batch, samples)  # (B, k)
        else:
            check_scst_samples(self.baseline, samples)
            baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (samples - 1)  # (B, k): the others' mean
        advantage = (rewards - baseline).reshape(-1, 1).detach().to(log_probs.dtype)  # (B*k, 1)
        mask = torch.arange(log_probs.size(1), device=log_probs.device) < lengths.unsqueeze(1)  # (B*k, T)
        loss = -(advantage * log_probs * mask).sum() / mask.sum().clamp_min(1)
        terms = {"loss": loss, "reward": rewards.mean()}
        if self.baseline == "greedy":
            terms["greedy_reward"] = greedy_rewards.mean()
        return terms
