"""Caption generation from image features: greedy, sampling (top-k, nucleus), beam search, diverse beam search
and SCST's rollouts, batched over images, each taking one checked ``DecodingConfig``.

Each method computes the attention keys once per image, then advances every caption a word at a time in
``steps.run_steps``, the one step loop (finished rows masked, early exit only with dynamic shapes).
``static_shapes`` None (``ModelConfig.static_shapes``) picks static on CUDA, dynamic elsewhere. <pad> and
<start> are never generated, nor <unk> when its ``unk_id`` is given (the vocabulary's: a caption never says
"unknown word"); the special tokens' ids are ``data.vocab``'s. Call them on a decoder in eval mode
(rollouts: in training mode too).

Two constraints apply to every method but rollouts, on the device: ``min_len`` forbids <end> before that
many words, and never as the first word (no method returns an empty caption), and ``no_repeat_ngram_size`` = n
forbids a word that would complete an n-gram already in the caption (0 turns it off). Where they leave a row no
word at all, <end> is allowed there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from captioner.config import DecodeMethod, DecodingConfig, ModelConfig
from captioner.data.vocab import END_ID, PAD_ID, START_ID
from captioner.model.beam import beam_search, untrimmed_beam_search
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.graphs import CapturedCall, capture_state, tensors_at
from captioner.model.steps import (
    Constraints,
    Generation,
    never_generated,
    run_steps,
    static_steps,
    trimmed,
    word_log_probs,
)

__all__ = ["Generation", "Rollout", "beam_search", "decode", "greedy", "rollout", "sample", "seeded_generator"]


@torch.no_grad()
def greedy(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    settings: DecodingConfig,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
    trim: bool = True,
) -> Generation:
    """Emit the most likely allowed word at each step for the features (B, L, D). ``trim``: drop the steps after
    every caption's end (one host read); False leaves T = the steps run, all ``max_len`` with static shapes (what a
    captured call can return: SCST's greedy baseline inside its graph)."""
    generation = _one_caption_each(decoder, features, settings, _most_likely, unk_id, static_shapes)
    return trimmed(generation) if trim else generation


def _most_likely(log_probs: Tensor) -> Tensor:
    """Greedy's choice: the most likely allowed word of each row (B,)."""
    return log_probs.argmax(dim=-1)


@torch.no_grad()
def sample(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    settings: DecodingConfig,
    generator: torch.Generator | None = None,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Generation:
    """Sample each word from softmax(logits / ``settings.temperature``) over the allowed words, among the
    ``settings.top_k`` most likely (0: all) and the nucleus of ``settings.top_p`` (1: all); scores use the
    untempered, uncut log-probs."""
    return trimmed(_one_caption_each(decoder, features, settings, _sampler(settings, generator), unk_id, static_shapes))


def _sampler(settings: DecodingConfig, generator: torch.Generator | None) -> Callable[[Tensor], Tensor]:
    """Sampling's choice: a word (B,) drawn from softmax(log-probs / ``settings.temperature``) of each row, cut to
    its top-k and nucleus (``truncated``)."""

    def choose(log_probs: Tensor) -> Tensor:
        tempered = truncated(log_probs / settings.temperature, settings.top_k, settings.top_p)  # (B, V)
        return torch.multinomial(tempered.softmax(dim=-1), 1, generator=generator).squeeze(1)  # (B,)

    return choose


def truncated(log_probs: Tensor, top_k: int, top_p: float) -> Tensor:
    """The log-probs (B, V) with -inf outside each row's ``top_k`` most likely words (0: no cut; more than V: all)
    and outside its nucleus, the fewest most likely words whose probabilities sum to ``top_p`` or more (1: no cut;
    the most likely word always stays). Ties rank the lower id first, as argmax does. Fixed shapes (a sort, a
    cumulative sum and a scatter): no host read, what a captured graph needs."""
    if not top_k and top_p >= 1.0:
        return log_probs
    ordered, order = log_probs.sort(dim=-1, descending=True, stable=True)  # (B, V)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k:
        keep[..., top_k:] = False
    if top_p < 1.0:
        probs = ordered.softmax(dim=-1)
        keep &= probs.cumsum(dim=-1) - probs < top_p  # the mass before a word is short of top_p
    keep[..., 0] = True
    return torch.full_like(log_probs, float("-inf")).scatter(-1, order, ordered.masked_fill(~keep, float("-inf")))


def _one_caption_each(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    settings: DecodingConfig,
    choose: Callable[[Tensor], Tensor],
    unk_id: int | None,
    static_shapes: bool | None,
) -> Generation:
    """One caption per image, ``choose`` picking each next token (B,) from the allowed log-probs (B, V); not
    trimmed (T = the steps run)."""
    constraints, batch = Constraints.of(settings), features.size(0)
    keys = decoder.attention.keys(features)  # (B, L, A), once per image
    state = decoder.init_state(features)
    tokens = torch.full((batch,), START_ID, dtype=torch.long, device=features.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=features.device)
    scores = features.new_zeros(batch, dtype=torch.float32)
    lengths = torch.zeros(batch, dtype=torch.long, device=features.device)
    words, alphas = [], []
    history = tokens.new_empty(batch, 0) if constraints.no_repeat_ngram_size else None  # (B, t) the words so far

    def advance(t: int) -> Tensor:
        nonlocal state, tokens, finished, history
        logits, state, alpha, _, _ = decoder.step(tokens, state, features, keys)  # (B, V), (B, L)
        log_probs = constraints.apply(word_log_probs(logits, unk_id), history, t)  # (B, V)
        tokens = choose(log_probs).masked_fill(finished, PAD_ID)  # (B,)
        if history is not None:
            history = torch.cat([history, tokens.unsqueeze(1)], dim=1)
        scores.add_(log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).masked_fill(finished, 0.0))
        lengths.add_(~finished)
        words.append(tokens)
        alphas.append(alpha.masked_fill(finished.unsqueeze(1), 0.0))
        finished = finished | (tokens == END_ID)
        return finished

    run_steps(settings.max_len, static_steps(static_shapes, features), advance)
    return Generation(torch.stack(words, 1), scores, torch.stack(alphas, 1), lengths)


@dataclass
class Rollout:
    """Captions sampled with their log-probabilities kept differentiable, for a policy-gradient step.

    N = B images x k samples; the samples of image b are rows b*k .. b*k + k - 1.
    """

    tokens: Tensor  # (N, T) long: no <start>, <end> where emitted, <pad> after it
    lengths: Tensor  # (N,) long, the <end> token included
    log_probs: Tensor  # (N, T) log p(w_t) (+ log alpha_t(s_t) for hard attention), 0 after the end


def rollout(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    samples: int,
    settings: DecodingConfig,
    generator: torch.Generator | None = None,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Rollout:
    """Sample ``samples`` (>= 1, ``ScstConfig.samples``) captions of at most ``settings.max_len`` words for
    each image of ``features`` (B, L, D) from the decoder's policy (temperature 1, no constraints).

    All B x k captions advance together, one decoder step for all of them per word (keys and initial
    state computed once per image). Words are drawn from softmax over the vocabulary without <pad> and
    <start> (and <unk> when ``unk_id`` is given); the log-probability of each drawn word stays in the graph.
    In training mode hard attention draws a location s_t ~ alpha_t at every step as well (Xu et al. section
    4.1): its log-probability is added to the word's, so the gradient of a reward covers both choices
    (REINFORCE on the joint action). With static shapes T is always ``max_len`` (<pad> and 0 after the end).
    """
    rows, device = features.size(0) * samples, features.device
    keys = decoder.attention.keys(features).repeat_interleave(samples, dim=0)  # (N, L, A)
    state = tuple(s.repeat_interleave(samples, dim=0) for s in decoder.init_state(features))  # (N, H) x 2
    features = features.repeat_interleave(samples, dim=0)  # (N, L, D)
    tokens = torch.full((rows,), START_ID, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    words, log_probs = [], []

    def advance(t: int) -> Tensor:
        nonlocal state, tokens, finished
        logits, state, _, location_log_prob, _ = decoder.step(tokens, state, features, keys)  # (N, V)
        # the words never drawn left out before the softmax: the distribution sampled is over the others only
        log_p = never_generated(logits.to(torch.float32, copy=True), unk_id).log_softmax(dim=-1)  # (N, V)
        tokens = torch.multinomial(log_p.detach().exp(), 1, generator=generator).squeeze(1)  # (N,)
        chosen = log_p.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (N,)
        if location_log_prob is not None:
            chosen = chosen + location_log_prob
        words.append(tokens.masked_fill(finished, PAD_ID))
        log_probs.append(chosen.masked_fill(finished, 0.0))
        lengths.add_(~finished)
        finished = finished | (tokens == END_ID)
        return finished

    run_steps(settings.max_len, static_steps(static_shapes, features), advance)
    return Rollout(torch.stack(words, dim=1), lengths, torch.stack(log_probs, dim=1))


def seeded_generator(settings: DecodingConfig, device: torch.device) -> torch.Generator | None:
    """A random generator on ``device`` seeded with ``settings.seed`` for sampling; None (torch's own) without a
    seed. Seeded once, it serves all the batches of a captioning call."""
    if settings.seed is None:
        return None
    return torch.Generator(device).manual_seed(settings.seed)


def decode(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    settings: DecodingConfig,
    generator: torch.Generator | None = None,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Generation:
    """Caption the features (B, L, D) as ``settings`` says (its method and that method's options);
    ``generator`` serves sampling (None: one seeded with ``settings.seed`` when set, else torch's own).

    On CUDA with static shapes every word of the call is one CUDA graph replay (``decoder.decoding_graphs``: one
    capture per batch shape and settings) and the host reads the result once, to trim it; a call with a generator
    of its own, or whose decoder replays a graph per word (``compile_step``), runs eagerly. Same captions."""
    if settings.method == DecodeMethod.sample:
        generator = generator or seeded_generator(settings, features.device)
    static = static_steps(static_shapes, features)
    graphs = decoder.decoding_graphs
    if graphs is None or not graphs.serves(features, static) or generator is not None or decoder.graphed:
        return trimmed(_untrimmed(decoder, settings, generator, unk_id, static, features))
    key = (features.shape, features.dtype, dataclasses.astuple(settings), unk_id, decoder.training, decoder.hard_read)
    key += capture_state(features.device)
    run = torch.no_grad()(functools.partial(_untrimmed, decoder, settings, None, unk_id, True))
    with graphs.lock:  # one caller at a time copies its features in and its captions out (threads, one model)
        call = graphs.get(key, lambda: CapturedCall(run, [features], decoder, graphs.capture), tensors_at(decoder))
        replayed = call(features)
        copied = (getattr(replayed, field.name) for field in dataclasses.fields(Generation))
        outputs = Generation(*(None if value is None else value.clone() for value in copied))
        return trimmed(outputs)  # its host read waits for the copies, before the next caller's replay


def _untrimmed(
    decoder: ShowAttendTellDecoder,
    settings: DecodingConfig,
    generator: torch.Generator | None,
    unk_id: int | None,
    static: bool,
    features: Tensor,
) -> Generation:
    """``decode``'s Generation before trimming: T = the steps run (all ``max_len`` with ``static`` shapes)."""
    if settings.method == DecodeMethod.greedy:
        return _one_caption_each(decoder, features, settings, _most_likely, unk_id, static)
    if settings.method == DecodeMethod.sample:
        return _one_caption_each(decoder, features, settings, _sampler(settings, generator), unk_id, static)
    return untrimmed_beam_search(decoder, features, settings, unk_id, static)  # beam, diverse
