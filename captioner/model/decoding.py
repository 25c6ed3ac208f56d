"""Caption generation from image features: greedy, sampling and beam search, batched over images.

Each function computes the attention keys once per image, then runs at most ``max_len`` steps with
finished rows masked (the batch never shrinks). Dynamic shapes (``static_shapes=False``): every
``EXIT_CHECK_INTERVAL`` steps one host read asks whether every image is done, and the loop stops early.
Static shapes (``True``): all ``max_len`` steps run and nothing is read back inside the loop, so every
call has the same shapes and kernels, what a captured CUDA graph needs; the captions, scores and alphas
are the same either way (the extra steps only add <pad>). ``None`` (``ModelConfig.static_shapes``)
picks static on CUDA, dynamic elsewhere. <pad> and <start> are never generated, nor <unk> when its
``unk_id`` is given (the vocabulary's: a caption never says "unknown word"). Defaults are read from their
owners: ``DecodingConfig`` (the settings) and ``data.vocab`` (the special-token ids).
Call them on a decoder in eval mode.

Two constraints apply to every method, on the device: ``min_len`` forbids <end> before that many
words, and ``no_repeat_ngram_size`` = n forbids a word that would complete an n-gram already in the
caption (0 turns either off). Where they leave a row no word at all, <end> is allowed there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from captioner.config import DecodeMethod, DecodingConfig, ModelConfig
from captioner.data.vocab import END_ID, PAD_ID, START_ID
from captioner.errors import ConfigError, check_range
from captioner.model.decoder import ShowAttendTellDecoder

EXIT_CHECK_INTERVAL = 4  # steps between the host checks for "every image is done"


@dataclass
class Generation:
    """Generated captions, T = the longest of them."""

    tokens: Tensor  # (B, T) long: no <start>, <end> where emitted, <pad> after it
    scores: Tensor  # (B,) sum of the tokens' log-probabilities (beam: over the length penalty)
    alphas: Tensor  # (B, T, L) attention of each returned token, 0 after the end
    lengths: Tensor  # (B,) long, the <end> token included


@dataclass(frozen=True)
class Constraints:
    """What a caption may not do: end before ``min_len`` words, repeat an n-gram (n = ``no_repeat_ngram_size``)."""

    end_id: int
    min_len: int = 0
    no_repeat_ngram_size: int = 0

    def apply(self, log_probs: Tensor, words: Tensor | None, step: int) -> Tensor:
        """Set -inf, in place, in the log-probs (..., V) of step ``step`` (0-based) for the words the
        constraints forbid after ``words`` (..., step), each row's caption so far; return them.

        A word is blocked when the last n - 1 words followed by it form an n-gram that already occurs
        in the row. A row left with no word gets its <end> back. No value is read back to the host.
        """
        if not (self.min_len or self.no_repeat_ngram_size):
            return log_probs
        end = log_probs[..., self.end_id].clone()  # (...,)
        if step < self.min_len:
            log_probs[..., self.end_id] = float("-inf")
        n = self.no_repeat_ngram_size
        if n and step >= n:
            ngrams = words.unfold(-1, n, 1)  # (..., step - n + 1, n): every n-gram so far
            prefix = words[..., step - n + 1 :].unsqueeze(-2)  # (..., 1, n - 1): the next n-gram's first words
            repeats = (ngrams[..., :-1] == prefix).all(-1)  # (..., step - n + 1)
            # the word each repeat would complete; the others point at <pad>, which is -inf already
            blocked = torch.where(repeats, ngrams[..., -1], PAD_ID)
            log_probs.scatter_(-1, blocked, float("-inf"))
        stuck = log_probs.isneginf().all(-1)  # (...,)
        log_probs[..., self.end_id] = torch.where(stuck, end, log_probs[..., self.end_id])
        return log_probs


@torch.no_grad()
def greedy(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    max_len: int = DecodingConfig.max_len,
    start_id: int = START_ID,
    end_id: int = END_ID,
    min_len: int = DecodingConfig.min_len,
    no_repeat_ngram_size: int = DecodingConfig.no_repeat_ngram_size,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Generation:
    """Emit the most likely allowed word at each step for the features (B, L, D)."""
    return _decode(
        decoder,
        features,
        max_len,
        start_id,
        _constraints(end_id, max_len, min_len, no_repeat_ngram_size),
        lambda log_probs: log_probs.argmax(dim=-1),
        unk_id,
        _static(static_shapes, features),
    )


@torch.no_grad()
def sample(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    max_len: int = DecodingConfig.max_len,
    start_id: int = START_ID,
    end_id: int = END_ID,
    temperature: float = DecodingConfig.temperature,
    generator: torch.Generator | None = None,
    min_len: int = DecodingConfig.min_len,
    no_repeat_ngram_size: int = DecodingConfig.no_repeat_ngram_size,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Generation:
    """Sample each word from softmax(logits / temperature) over the allowed words; scores use the
    untempered log-probs."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ConfigError(f"temperature={temperature!r} must be a number > 0")
    constraints = _constraints(end_id, max_len, min_len, no_repeat_ngram_size)

    def choose(log_probs: Tensor) -> Tensor:
        probs = (log_probs / temperature).softmax(dim=-1)  # (B, V)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)

    return _decode(decoder, features, max_len, start_id, constraints, choose, unk_id, _static(static_shapes, features))


def _constraints(end_id: int, max_len: int, min_len: int, no_repeat_ngram_size: int) -> Constraints:
    """Check the length options and return the constraints (ConfigError naming a bad value)."""
    check_range("max_len", max_len, 1, kind=int)
    check_range("min_len", min_len, 0, max_len - 1, kind=int)
    check_range("no_repeat_ngram_size", no_repeat_ngram_size, 0, kind=int)
    return Constraints(end_id, min_len, no_repeat_ngram_size)


def _static(static_shapes: bool | None, features: Tensor) -> bool:
    """Whether to run every step (static shapes): as asked, or when None on CUDA only."""
    return features.is_cuda if static_shapes is None else bool(static_shapes)


def _decode(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    max_len: int,
    start_id: int,
    constraints: Constraints,
    choose: Callable[[Tensor], Tensor],
    unk_id: int | None,
    static: bool,
) -> Generation:
    """One caption per image, ``choose`` picking each next token (B,) from the allowed log-probs (B, V)."""
    end_id = constraints.end_id
    batch = features.size(0)
    keys = decoder.attention.keys(features)  # (B, L, A), once per image
    state = decoder.init_state(features)
    tokens = torch.full((batch,), start_id, dtype=torch.long, device=features.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=features.device)
    scores = features.new_zeros(batch, dtype=torch.float32)
    lengths = torch.zeros(batch, dtype=torch.long, device=features.device)
    words, alphas = [], []
    history = tokens.new_empty(batch, 0) if constraints.no_repeat_ngram_size else None  # (B, t) the words so far
    for t in range(max_len):
        logits, state, alpha, _, _ = decoder.step(tokens, state, features, keys)  # (B, V), (B, L)
        log_probs = constraints.apply(_word_log_probs(logits, start_id, unk_id), history, t)  # (B, V)
        tokens = choose(log_probs).masked_fill(finished, PAD_ID)  # (B,)
        if history is not None:
            history = torch.cat([history, tokens.unsqueeze(1)], dim=1)
        scores += log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).masked_fill(finished, 0.0)
        lengths += ~finished
        words.append(tokens)
        alphas.append(alpha.masked_fill(finished.unsqueeze(1), 0.0))
        finished = finished | (tokens == end_id)
        if not static and (t + 1) % EXIT_CHECK_INTERVAL == 0 and finished.all():
            break
    return _trimmed(Generation(torch.stack(words, 1), scores, torch.stack(alphas, 1), lengths))


@torch.no_grad()
def beam_search(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    max_len: int = DecodingConfig.max_len,
    start_id: int = START_ID,
    end_id: int = END_ID,
    beam_size: int = DecodingConfig.beam_size,
    length_penalty: float = DecodingConfig.length_penalty,
    min_len: int = DecodingConfig.min_len,
    no_repeat_ngram_size: int = DecodingConfig.no_repeat_ngram_size,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Generation:
    """Beam search over B images x K beams at once, returning the best caption of each image.

    Each step ranks the 2K best extensions (summed log-probs, never raw logits): those of the top K
    that end with <end> become finished hypotheses, the K best others stay live. Hypotheses are
    compared on score / lp(length), lp = ((5 + length) / 6) ** length_penalty (GNMT; 0 compares
    the sums). An image is done when its best finished hypothesis beats any score its live beams
    could still reach (score / lp(max_len), as log-probs only fall); at ``max_len`` the live beams
    compete too, so a caption is returned even when <end> was never emitted. Words, backpointers
    and alphas are kept per step and the chosen caption is traced back at the end. The features
    (B, L, D) and keys (B, L, A) stay one copy per image: the decoder scores the K beams' states
    (B, K, H) against them.
    """
    check_range("beam_size", beam_size, 1, kind=int)
    check_range("length_penalty", length_penalty, 0.0)
    constraints = _constraints(end_id, max_len, min_len, no_repeat_ngram_size)
    static = _static(static_shapes, features)
    batch, beams, device = features.size(0), beam_size, features.device
    keys = decoder.attention.keys(features)  # (B, L, A), once per image
    state = tuple(s.unsqueeze(1).expand(-1, beams, -1) for s in decoder.init_state(features))  # (B, K, H)
    tokens = torch.full((batch, beams), start_id, dtype=torch.long, device=device)  # (B, K)
    scores = torch.full((batch, beams), float("-inf"), device=device)  # (B, K) live beams' log-probs
    scores[:, 0] = 0.0  # the K rows start identical: expand one of them
    best = torch.full((batch,), float("-inf"), device=device)  # (B,) best finished score / lp
    best_step = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) step of its <end>
    best_row = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) beam that emitted it
    done = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    words, parents, alphas = [], [], []  # per step: (B, K), (B, K), (B, K, L)
    history = tokens.new_empty(batch, beams, 0) if no_repeat_ngram_size else None  # (B, K, t) each beam's words
    for t in range(max_len):
        logits, state, alpha, _, _ = decoder.step(tokens, state, features, keys)  # (B, K, V), (B, K, L)
        vocab = logits.size(-1)
        log_probs = constraints.apply(_word_log_probs(logits, start_id, unk_id), history, t)  # (B, K, V)
        candidates = (scores.unsqueeze(-1) + log_probs).view(batch, beams * vocab)  # (B, K*V)
        top, index = candidates.topk(2 * beams, dim=1)  # (B, 2K): at most K of them end with <end>
        parent, word = index // vocab, index % vocab  # (B, 2K)
        ends = (word[:, :beams] == end_id) & top[:, :beams].isfinite() & ~done.unsqueeze(1)  # (B, K)
        value, pick = (top[:, :beams] / _penalty(t + 1, length_penalty)).masked_fill(~ends, float("-inf")).max(1)
        better = value > best  # (B,)
        best = torch.where(better, value, best)
        best_step = best_step.masked_fill(better, t)
        best_row = torch.where(better, parent.gather(1, pick.unsqueeze(1)).squeeze(1), best_row)
        scores, keep = top.masked_fill(word == end_id, float("-inf")).topk(beams, dim=1)  # (B, K)
        parent, word = parent.gather(1, keep), word.gather(1, keep)  # (B, K)
        state = tuple(_rows(s, parent) for s in state)  # follow the parents
        if history is not None:
            history = torch.cat([_rows(history, parent), word.unsqueeze(-1)], dim=-1)  # (B, K, t + 1)
        tokens = word  # (B, K)
        words.append(word)
        parents.append(parent)
        alphas.append(alpha)
        done = best >= scores.max(dim=1).values / _penalty(max_len, length_penalty)
        if not static and (t + 1) % EXIT_CHECK_INTERVAL == 0 and done.all():
            break
    steps = len(words)
    live, live_row = (scores / _penalty(steps, length_penalty)).max(dim=1)  # (B,)
    use_live = (live > best) | best.isneginf()  # nothing finished, or a live beam is better
    end_step = torch.where(use_live, steps, best_step)  # (B,) the words before it are traced back
    row = torch.where(use_live, live_row, best_row)
    return _trimmed(_trace(words, parents, alphas, end_step, row, end_id, torch.where(use_live, live, best)))


def _rows(values: Tensor, parent: Tensor) -> Tensor:
    """The rows (B, K, ...) of each image's beams that ``parent`` (B, K) names."""
    return values.gather(1, parent.view(*parent.shape, *[1] * (values.dim() - 2)).expand_as(values))


def _word_log_probs(logits: Tensor, start_id: int, unk_id: int | None) -> Tensor:
    """log p(word) (..., V) in float32; -inf for <pad>, <start> and <unk>, which are never generated."""
    log_probs = logits.float().log_softmax(dim=-1)
    log_probs[..., PAD_ID] = float("-inf")
    log_probs[..., start_id] = float("-inf")
    if unk_id is not None:
        log_probs[..., unk_id] = float("-inf")
    return log_probs


def _penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha; 1 when alpha is 0."""
    return ((5 + length) / 6) ** alpha


def _trace(
    words: list[Tensor],
    parents: list[Tensor],
    alphas: list[Tensor],
    end_step: Tensor,
    row: Tensor,
    end_id: int,
    scores: Tensor,
) -> Generation:
    """Follow the backpointers from beam ``row`` at ``end_step`` (B,): <end> there when it lies before
    the last step (a finished hypothesis), the words of the beams it came from before it."""
    history = torch.stack(alphas, dim=1)  # (B, steps, K, L)
    batch, steps, _, locations = history.shape
    images = torch.arange(batch, device=row.device)
    ended = end_step < steps  # (B,)
    last = end_step.clamp(max=steps - 1)
    tokens = torch.full((batch, steps), PAD_ID, dtype=torch.long, device=row.device)
    tokens[images, last] = torch.where(ended, end_id, PAD_ID)
    attention = history.new_zeros(batch, steps, locations)
    attention[images, last] = history[images, last, row] * ended.unsqueeze(1)
    for t in reversed(range(steps)):
        before = t < end_step  # (B,)
        parent = parents[t][images, row]  # (B,)
        tokens[:, t] = torch.where(before, words[t][images, row], tokens[:, t])
        attention[:, t] = torch.where(before.unsqueeze(1), history[images, t, parent], attention[:, t])
        row = torch.where(before, parent, row)
    return Generation(tokens, scores, attention, end_step + ended)


def _trimmed(generation: Generation) -> Generation:
    """Drop the trailing steps where every caption has ended (one host sync, after decoding)."""
    steps = int(generation.lengths.max()) if generation.lengths.numel() else 0
    return Generation(generation.tokens[:, :steps], generation.scores, generation.alphas[:, :steps], generation.lengths)


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
    max_len: int = DecodingConfig.max_len,
    start_id: int = START_ID,
    end_id: int = END_ID,
    generator: torch.Generator | None = None,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Rollout:
    """Sample ``samples`` captions for each image of ``features`` (B, L, D) from the decoder's policy.

    All B x k captions advance together, one decoder step for all of them per word (keys and initial
    state computed once per image). Words are drawn from softmax over the vocabulary without <pad> and
    <start> (and <unk> when ``unk_id`` is given); the log-probability of each drawn word stays in the graph.
    In training mode hard attention draws a location s_t ~ alpha_t at every step as well (Xu et al. section
    4.1): its log-probability is added to the word's, so the gradient of a reward covers both choices
    (REINFORCE on the joint action). With static shapes T is always ``max_len`` (<pad> and 0 after the end).
    """
    check_range("samples", samples, 1, kind=int)
    check_range("max_len", max_len, 1, kind=int)
    static = _static(static_shapes, features)
    rows, device = features.size(0) * samples, features.device
    keys = decoder.attention.keys(features).repeat_interleave(samples, dim=0)  # (N, L, A)
    state = tuple(s.repeat_interleave(samples, dim=0) for s in decoder.init_state(features))  # (N, H) x 2
    features = features.repeat_interleave(samples, dim=0)  # (N, L, D)
    tokens = torch.full((rows,), start_id, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    never = torch.tensor([PAD_ID, start_id, *([] if unk_id is None else [unk_id])], device=device)  # never drawn
    words, log_probs = [], []
    for t in range(max_len):
        logits, state, _, location_log_prob, _ = decoder.step(tokens, state, features, keys)  # (N, V)
        log_p = logits.float().index_fill(1, never, float("-inf")).log_softmax(dim=-1)  # (N, V)
        tokens = torch.multinomial(log_p.detach().exp(), 1, generator=generator).squeeze(1)  # (N,)
        chosen = log_p.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (N,)
        if location_log_prob is not None:
            chosen = chosen + location_log_prob
        words.append(tokens.masked_fill(finished, PAD_ID))
        log_probs.append(chosen.masked_fill(finished, 0.0))
        lengths += ~finished
        finished = finished | (tokens == end_id)
        if not static and (t + 1) % EXIT_CHECK_INTERVAL == 0 and finished.all():
            break
    return Rollout(torch.stack(words, dim=1), lengths, torch.stack(log_probs, dim=1))


def decode(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    settings: DecodingConfig,
    generator: torch.Generator | None = None,
    start_id: int = START_ID,
    end_id: int = END_ID,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Generation:
    """Caption the features (B, L, D) as ``settings`` says (its method and that method's options)."""
    common = dict(
        max_len=settings.max_len,
        start_id=start_id,
        end_id=end_id,
        min_len=settings.min_len,
        no_repeat_ngram_size=settings.no_repeat_ngram_size,
        unk_id=unk_id,
        static_shapes=static_shapes,
    )
    if settings.method == DecodeMethod.greedy:
        return greedy(decoder, features, **common)
    if settings.method == DecodeMethod.sample:
        return sample(decoder, features, temperature=settings.temperature, generator=generator, **common)
    return beam_search(
        decoder, features, beam_size=settings.beam_size, length_penalty=settings.length_penalty, **common
    )
