"""Beam search over B images x K beams at once (``captioner.model.decoding.decode``'s "beam")."""

from __future__ import annotations

import torch
from torch import Tensor

from captioner.config import DecodingConfig, ModelConfig
from captioner.data.vocab import END_ID, PAD_ID, START_ID
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.steps import Constraints, Generation, run_steps, static_steps, trimmed, word_log_probs


@torch.no_grad()
def beam_search(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    settings: DecodingConfig,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Generation:
    """Beam search of ``settings.beam_size`` beams per image of the features (B, L, D), returning the best
    caption of each image (``settings``: ``max_len``, ``length_penalty``, ``min_len``, ``no_repeat_ngram_size``).

    Each step ranks the 2K best extensions (summed log-probs, never raw logits): those of the top K
    that end with <end> become finished hypotheses, the K best others stay live. Hypotheses are
    compared on score / lp(length), lp = ((5 + length) / 6) ** length_penalty (GNMT; 0 compares
    the sums). An image is done when its best finished hypothesis beats any score its live beams
    could still reach (score / lp(max_len), as log-probs only fall); at ``max_len`` the live beams
    compete too, so a caption is returned even when <end> was never emitted. Words, backpointers
    and alphas are kept per step and the chosen caption is traced back at the end. The features
    (B, L, D) and keys (B, L, A) stay one copy per image: the decoder scores the K beams' states
    (B, K, H) against them. <unk> is never generated when ``unk_id`` is given; ``static_shapes`` as
    ``ModelConfig.static_shapes`` says.
    """
    return trimmed(untrimmed_beam_search(decoder, features, settings, unk_id, static_shapes))


@torch.no_grad()
def untrimmed_beam_search(
    decoder: ShowAttendTellDecoder,
    features: Tensor,
    settings: DecodingConfig,
    unk_id: int | None = None,
    static_shapes: bool | None = ModelConfig.static_shapes,
) -> Generation:
    """``beam_search`` without its final trimming (one host read): T = the steps run, all ``max_len`` with
    static shapes."""
    constraints, alpha_lp, max_len = Constraints.of(settings), settings.length_penalty, settings.max_len
    batch, beams, device = features.size(0), settings.beam_size, features.device
    keys = decoder.attention.keys(features)  # (B, L, A), once per image
    # (B, K, H) x 2, contiguous as every later step's state (one compiled step serves them all)
    state = tuple(s.unsqueeze(1).expand(-1, beams, -1).contiguous() for s in decoder.init_state(features))
    tokens = torch.full((batch, beams), START_ID, dtype=torch.long, device=device)  # (B, K)
    scores = torch.full((batch, beams), float("-inf"), device=device)  # (B, K) live beams' log-probs
    scores[:, 0] = 0.0  # the K rows start identical: expand one of them
    best = torch.full((batch,), float("-inf"), device=device)  # (B,) best finished score / lp
    best_step = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) step of its <end>
    best_row = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) beam that emitted it
    done = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    words, parents, alphas = [], [], []  # per step: (B, K), (B, K), (B, K, L)
    history = tokens.new_empty(batch, beams, 0) if constraints.no_repeat_ngram_size else None  # (B, K, t)

    def advance(t: int) -> Tensor:
        nonlocal state, tokens, scores, best, best_step, best_row, done, history
        logits, state, alpha, _, _ = decoder.step(tokens, state, features, keys)  # (B, K, V), (B, K, L)
        vocab = logits.size(-1)
        log_probs = constraints.apply(word_log_probs(logits, unk_id), history, t)  # (B, K, V)
        candidates = (scores.unsqueeze(-1) + log_probs).view(batch, beams * vocab)  # (B, K*V)
        top, index = candidates.topk(2 * beams, dim=1)  # (B, 2K): at most K of them end with <end>
        parent, word = index // vocab, index % vocab  # (B, 2K)
        ends = (word[:, :beams] == END_ID) & top[:, :beams].isfinite() & ~done.unsqueeze(1)  # (B, K)
        value, pick = (top[:, :beams] / _penalty(t + 1, alpha_lp)).masked_fill(~ends, float("-inf")).max(1)
        better = value > best  # (B,)
        best = torch.where(better, value, best)
        best_step = best_step.masked_fill(better, t)
        best_row = torch.where(better, parent.gather(1, pick.unsqueeze(1)).squeeze(1), best_row)
        scores, keep = top.masked_fill(word == END_ID, float("-inf")).topk(beams, dim=1)  # (B, K)
        parent, word = parent.gather(1, keep), word.gather(1, keep)  # (B, K)
        state = tuple(_rows(s, parent) for s in state)  # follow the parents
        if history is not None:
            history = torch.cat([_rows(history, parent), word.unsqueeze(-1)], dim=-1)  # (B, K, t + 1)
        tokens = word  # (B, K)
        words.append(word)
        parents.append(parent)
        alphas.append(alpha)
        done = best >= scores.max(dim=1).values / _penalty(max_len, alpha_lp)
        return done

    steps = run_steps(max_len, static_steps(static_shapes, features), advance)
    live, live_row = (scores / _penalty(steps, alpha_lp)).max(dim=1)  # (B,)
    use_live = (live > best) | best.isneginf()  # nothing finished, or a live beam is better
    end_step = torch.where(use_live, steps, best_step)  # (B,) the words before it are traced back
    row = torch.where(use_live, live_row, best_row)
    return _trace(words, parents, alphas, end_step, row, torch.where(use_live, live, best))


def _rows(values: Tensor, parent: Tensor) -> Tensor:
    """The rows (B, K, ...) of each image's beams that ``parent`` (B, K) names."""
    return values.gather(1, parent.view(*parent.shape, *[1] * (values.dim() - 2)).expand_as(values))


def _penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha; 1 when alpha is 0."""
    return ((5 + length) / 6) ** alpha


def _trace(
    words: list[Tensor], parents: list[Tensor], alphas: list[Tensor], end_step: Tensor, row: Tensor, scores: Tensor
) -> Generation:
    """Follow the backpointers from beam ``row`` at ``end_step`` (B,): <end> there when it lies before
    the last step (a finished hypothesis), the words of the beams it came from before it."""
    history = torch.stack(alphas, dim=1)  # (B, steps, K, L)
    batch, steps, _, locations = history.shape
    images = torch.arange(batch, device=row.device)
    ended = end_step < steps  # (B,)
    last = end_step.clamp(max=steps - 1)
    tokens = torch.full((batch, steps), PAD_ID, dtype=torch.long, device=row.device)
    tokens[images, last] = torch.where(ended, END_ID, PAD_ID)
    attention = history.new_zeros(batch, steps, locations)
    attention[images, last] = history[images, last, row] * ended.unsqueeze(1)
    for t in reversed(range(steps)):
        before = t < end_step  # (B,)
        parent = parents[t][images, row]  # (B,)
        tokens[:, t] = torch.where(before, words[t][images, row], tokens[:, t])
        attention[:, t] = torch.where(before.unsqueeze(1), history[images, t, parent], attention[:, t])
        row = torch.where(before, parent, row)
    return Generation(tokens, scores, attention, end_step + ended)
