"""The training objectives: teacher-forced cross-entropy, and self-critical sequence training (SCST).

Cross-entropy is the paper's masked word loss with the doubly stochastic attention term (and REINFORCE
for hard attention): ``captioner.model.losses.CaptionLoss``. SCST samples ``scst.samples`` captions per
image, rewards each with CIDEr-D against the image's references and subtracts a baseline (the samples'
mean or the greedy caption's reward): ``captioner.model.losses.SelfCriticalLoss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from captioner.config import DecodingConfig, ScstBaseline, ScstConfig
from captioner.data.vocab import END_ID, UNK_ID, Vocabulary
from captioner.evaluation.cider import CiderD
from captioner.model.captioner import Captioner
from captioner.model.decoding import Generation, Rollout, greedy, rollout
from captioner.model.losses import CaptionLoss, SelfCriticalLoss


def cached_features(batch: dict, dtype: torch.dtype) -> torch.Tensor:
    """Cached features (B, L, C), stored in fp16, cast on the device to the model's ``dtype``."""
    return batch["features"].to(dtype)


def teacher_forced(model: Captioner, batch: dict, dtype: torch.dtype) -> Any:
    """The model's teacher-forced output on a batch of images or of cached features, with all their captions:
    in the decoder's (B, K) layout when every image has K captions (``collate``'s ``captions_per_image``)."""
    per_image = batch.get("captions_per_image")
    captions, index = batch["captions"], batch["image_index"] if per_image is None else per_image
    if "features" in batch:
        return model.forward_features(cached_features(batch, dtype), captions, index)
    return model(batch["images"], captions, index)


def cross_entropy_terms(
    model: Captioner, criterion: CaptionLoss, batch: dict, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The cross-entropy loss terms of a batch (``"loss"`` and its parts): each caption weighted by its
    ``caption_weights`` (``collate``'s), every term divided by the batch's ``tokens`` when it carries them (under
    DDP: ``token_share``), else by its own weighted tokens."""
    output = teacher_forced(model, batch, dtype)
    return criterion(output, batch["captions"], batch.get("caption_weights"), batch.get("tokens"))


def token_share(criterion: CaptionLoss, batch: dict) -> torch.Tensor:
    """The weighted target tokens of the global batch (every rank's ``batch``) divided by the ranks: the
    normaliser under which DDP's mean of the ranks' gradients is the global batch's, as one process would take
    it (``CaptionLoss.forward``'s ``tokens``). One all-reduce of a scalar."""
    return _per_rank(criterion.target_mask(batch["captions"], batch.get("caption_weights")).sum())


def _per_rank(tokens: torch.Tensor) -> torch.Tensor:
    """This rank's count of tokens () summed over the ranks (an all-reduce) and divided by them: a loss's
    normaliser under DDP (at least 1 / ranks, for a global batch without a token)."""
    dist.all_reduce(tokens)
    return (tokens / dist.get_world_size()).clamp_min(1.0 / dist.get_world_size())


def sampled_token_share(lengths: torch.Tensor, real: torch.Tensor | None, samples: int) -> torch.Tensor:
    """The sampled tokens of the global batch (every rank's captions: ``lengths`` (B*k,), ``samples`` = k per image,
    the ``real`` (B,) images' only) divided by the ranks: ``SelfCriticalLoss``'s ``tokens`` under DDP, as
    ``token_share`` is cross-entropy's, so that ranks whose captions are longer or shorter weigh each token alike.
    One all-reduce of a scalar."""
    return _per_rank(SelfCriticalLoss.counted_lengths(lengths, real, samples).sum().float())


@dataclass
class SelfCriticalSamples:
    """What an SCST step draws before its reward: B images x k sampled captions and, for the greedy baseline, the
    images' greedy captions."""

    drawn: Rollout  # (B*k, T): tokens, lengths and log-probabilities, these in the autograd graph
    greedy: Generation | None  # (B, T') the greedy captions (no gradient); None for the mean baseline


def self_critical_samples(
    model: Captioner,
    batch: dict,
    dtype: torch.dtype,
    scst: ScstConfig,
    decoding: DecodingConfig,
    static_shapes: bool | None,
    trim: bool = True,
) -> SelfCriticalSamples:
    """The forward of an SCST step: the batch's features (its images encoded, or its cached features), ``scst.samples``
    captions of at most ``decoding.max_len`` words sampled per image and, for the greedy baseline, the greedy captions
    decoded as ``decoding`` constrains them, in eval mode (no dropout; hard attention's most likely location);
    ``static_shapes`` as ``ModelConfig.static_shapes`` says; ``trim``: ``decoding.greedy``'s."""
    encoded = (cached_features(batch, dtype),) if "features" in batch else model.encode(batch["images"])
    features = model.attend_grid(*model.finish_encoding(*encoded))  # (B, L, C)
    drawn = rollout(model.decoder, features, scst.samples, decoding, unk_id=UNK_ID, static_shapes=static_shapes)
    if scst.baseline != ScstBaseline.greedy:
        return SelfCriticalSamples(drawn, None)
    model.decoder.eval()
    try:
        best = greedy(model.decoder, features.detach(), decoding, UNK_ID, static_shapes, trim=trim)
    finally:
        model.decoder.train()
    return SelfCriticalSamples(drawn, best)


def self_critical_rewards(
    cider: CiderD,
    samples: SelfCriticalSamples,
    images: torch.Tensor,
    k: int,
    real: torch.Tensor | None = None,
    distributed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """CIDEr-D of the sampled captions (B, k) and of the greedy ones (B,) (None without them) against the references
    of the corpus ``images`` (B,) (``cider``'s rows ``batch["indices"]``), ``k`` samples per image; and, under DDP
    (``distributed``), the loss's normaliser (``sampled_token_share`` of the ``real`` images' samples; else None)."""
    drawn = samples.drawn
    rewards = caption_rewards(cider, drawn.tokens, drawn.lengths, images.repeat_interleave(k), END_ID).view(-1, k)
    tokens = sampled_token_share(drawn.lengths, real, k) if distributed else None
    if samples.greedy is None:
        return rewards, None, tokens
    return rewards, caption_rewards(cider, samples.greedy.tokens, samples.greedy.lengths, images, END_ID), tokens


def self_critical_terms(
    model: Captioner,
    criterion: SelfCriticalLoss,
    cider: CiderD,
    batch: dict,
    dtype: torch.dtype,
    scst: ScstConfig,
    decoding: DecodingConfig,
    vocab: Vocabulary,
    static_shapes: bool | None,
    distributed: bool = False,
) -> dict[str, torch.Tensor]:
    """SCST loss terms of a batch: ``scst.samples`` captions of at most ``decoding.max_len`` words sampled per
    image (a greedy baseline decoded as ``decoding`` constrains it), scored by CIDEr-D against its references
    (``cider``'s rows ``batch["indices"]``); ``static_shapes`` as ``ModelConfig.static_shapes`` says; under DDP
    (``distributed``) the surrogate divided by the global batch's sampled tokens per rank."""
    samples = self_critical_samples(model, batch, dtype, scst, decoding, static_shapes)
    real = batch.get("real")
    rewards, greedy_rewards, tokens = self_critical_rewards(
        cider, samples, batch["indices"], scst.samples, real, distributed
    )
    drawn = samples.drawn
    return criterion(drawn.log_probs, drawn.lengths, rewards, greedy_rewards, real, tokens)


def caption_rewards(
    cider: CiderD, tokens: torch.Tensor, lengths: torch.Tensor, images: torch.Tensor, end_id: int
) -> torch.Tensor:
    """CIDEr-D (N,) of captions (N, T) with ``lengths`` counting a final <end>, against corpus ``images``."""
    last = tokens.gather(1, (lengths - 1).clamp_min(0).unsqueeze(1)).squeeze(1)  # (N,)
    words = lengths - ((last == end_id) & (lengths > 0)).long()  # (N,) without <end>
    return cider.score_ids(tokens, words, images).float()
