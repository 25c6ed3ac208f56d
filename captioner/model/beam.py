"""Beam search over B images x K beams at once (``captioner.model.decoding.decode``'s "beam"), and diverse beam
search (its "diverse"; Vijayakumar et al. 2016), whose K beams are G groups of K / G that advance one after the
other at each word, each kept away from the words the earlier groups chose at that word."""

from __future__ import annotations

import torch
from torch import Tensor

from captioner.config import DecodeMethod, DecodingConfig, ModelConfig
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
    caption of each image, and its ``settings.n_best`` best when that is over 1 (``settings``: ``max_len``,
    ``length_penalty``, ``min_len``, ``no_repeat_ngram_size``; with ``method`` "diverse", ``groups`` and
    ``diversity`` too).

    Each step ranks the 2K best extensions (summed log-probs, never raw logits): those of the top K
    that end with <end> become finished hypotheses, the K best others stay live. Hypotheses are
    compared on score / lp(length), lp = ((5 + length) / 6) ** length_penalty (GNMT; 0 compares
    the sums). An image is done when its n_best-th finished hypothesis beats any score its live beams
    could still reach (score / lp(max_len), as log-probs only fall); at ``max_len`` the live beams
    compete too, so a caption is returned even when <end> was never emitted. Words, backpointers
    and alphas are kept per step and the chosen captions are traced back at the end. The features
    (B, L, D) and keys (B, L, A) stay one copy per image: the decoder scores the K beams' states
    (B, K, H) against them. <unk> is never generated when ``unk_id`` is given; ``static_shapes`` as
    ``ModelConfig.static_shapes`` says.

    Diverse beam search: the K beams are ``groups`` groups of W = K / G, each a beam search of width W as above.
    At each word the groups choose in order, group g ranking its extensions by its summed log-probs less
    ``diversity`` times the number of beams of groups 0 .. g - 1 that chose the same word at this word (Hamming
    diversity; a group that is done no longer counts). With diversity 0 every group is the beam search of width W.
    Each group keeps its min(n_best, W) best captions; the captions returned are the best of all groups' on the
    log-probs summed without the penalty (over lp), which the scores are.
    """
    return trimmed(untrimmed_beam_search(decoder, features, settings, unk_id, static_shapes))


# The rows of ``_Beams.found`` (B, 4, P): what each of an image's P best finished captions holds, one tensor so
# that merging a step's captions into them is one concatenation and one gather (each a kernel of a decoding
# call's CUDA graph, at every word).
VALUE, SUM, STEP, ROW = range(4)  # its score / lp (what ranks it), its sum / lp, the step of its <end>, its row


class _Beams:
    """One group of ``width`` beams of each of B images: its live beams and the best ``kept`` finished captions so
    far; ``offset``: its first row among all the groups' K rows."""

    def __init__(self, batch: int, width: int, kept: int, offset: int, device: torch.device) -> None:
        self.offset = offset
        self.scores = torch.full((batch, width), float("-inf"), device=device)  # (B, W) what the search ranks
        self.scores[:, 0] = 0.0  # the W rows start identical: expand one of them
        self.sums = self.scores.clone()  # (B, W) the log-probs summed (diverse: the scores without the penalty)
        # (B, 4, P) finished, best first: VALUE, SUM, STEP, ROW (steps and rows exact in float32); none: -inf, 0
        self.found = torch.zeros(batch, 4, kept, device=device)
        self.found[:, VALUE:STEP] = float("-inf")
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)

    def advance(self, log_probs: Tensor, penalised: Tensor, t: int, settings: DecodingConfig) -> tuple[Tensor, Tensor]:
        """Step ``t``: extend the beams by their words' ``log_probs`` (B, W, V) ranked by ``penalised`` (the same, or
        less the diversity penalty); the parent (within the group) and the word (B, W) of each new beam."""
        batch, width, vocab = log_probs.shape
        alpha = settings.length_penalty
        candidates = (self.scores.unsqueeze(-1) + penalised).view(batch, width * vocab)  # (B, W*V)
        top, index = candidates.topk(2 * width, dim=1)  # (B, 2W): at most W of them end with <end>
        sums = (self.sums.unsqueeze(-1) + log_probs).view(batch, width * vocab).gather(1, index)  # (B, 2W)
        parent, word = index // vocab, index % vocab  # (B, 2W)
        end = word == END_ID  # (B, 2W)
        ends = end[:, :width] & top[:, :width].isfinite() & ~self.done.unsqueeze(1)  # (B, W)
        lp = _penalty(t + 1, alpha)
        ended = (top[:, :width] / lp).masked_fill(~ends, float("-inf"))  # (B, W)
        steps = torch.full_like(ended, t)  # (B, W)
        self._keep_found(torch.stack([ended, sums[:, :width] / lp, steps, parent[:, :width] + self.offset], dim=1))
        self.scores, keep = top.masked_fill(end, float("-inf")).topk(width, dim=1)  # (B, W)
        self.sums = sums.gather(1, keep)
        self.done = self.found[:, VALUE, -1] >= self.scores.max(dim=1).values / _penalty(settings.max_len, alpha)
        return parent.gather(1, keep), word.gather(1, keep)

    def _keep_found(self, ended: Tensor) -> None:
        """Merge the hypotheses that ended at this step (B, 4, W) (VALUE -inf: none) into the ``kept`` best finished;
        on a tie the earlier one stays ahead."""
        merged = torch.cat([self.found, ended], dim=2)  # (B, 4, P + W)
        kept = self.found.size(2)
        order = merged[:, VALUE].sort(dim=1, descending=True, stable=True).indices[:, :kept]  # (B, P)
        self.found = merged.gather(2, order.unsqueeze(1).expand(-1, 4, -1))

    def best(self, steps: int, alpha: float) -> tuple[Tensor, Tensor, Tensor]:
        """After ``steps`` steps, the group's ``kept`` best captions, finished or live: their sums / lp, <end> steps
        (``steps`` for a live beam, which ends there without <end>) and rows (B, P). A finished caption goes before
        a live beam of the same score, a live beam before an empty slot of the finished ones."""
        batch, width = self.scores.shape
        lp = _penalty(steps, alpha)
        found = self.found[:, VALUE]  # (B, P)
        values = torch.cat([found, self.scores / lp], dim=1)  # (B, P + W)
        slot = torch.cat([torch.where(found.isfinite(), 0, 2), torch.ones_like(self.scores, dtype=torch.long)], 1)
        first = slot.sort(dim=1, stable=True).indices  # (B, P + W) finished, live, empty
        order = first.gather(1, values.gather(1, first).sort(dim=1, descending=True, stable=True).indices)
        order = order[:, : found.size(1)]  # (B, P)
        live_steps = torch.full_like(self.scores, steps)  # (B, W)
        live_rows = torch.arange(width, device=order.device, dtype=self.scores.dtype).expand(batch, width) + self.offset
        live = torch.stack([self.sums / lp, live_steps, live_rows], dim=1)  # (B, 3, W): SUM, STEP, ROW
        chosen = torch.cat([self.found[:, SUM:], live], dim=2).gather(2, order.unsqueeze(1).expand(-1, 3, -1))
        sums, end_steps, rows = chosen.unbind(1)  # (B, P) x 3
        return sums, end_steps.long(), rows.long()


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
    constraints, max_len = Constraints.of(settings), settings.max_len
    batch, beams, device = features.size(0), settings.beam_size, features.device
    groups = settings.groups if settings.method == DecodeMethod.diverse else 1
    width = beams // groups
    kept = settings.n_best if groups == 1 else min(settings.n_best, width)  # finished captions each group keeps
    keys = decoder.attention.keys(features)  # (B, L, A), once per image
    # (B, K, H) x 2, contiguous as every later step's state (one compiled step serves them all)
    state = tuple(s.unsqueeze(1).expand(-1, beams, -1).contiguous() for s in decoder.init_state(features))
    tokens = torch.full((batch, beams), START_ID, dtype=torch.long, device=device)  # (B, K)
    searches = [_Beams(batch, width, kept, group * width, device) for group in range(groups)]
    words, parents, alphas = [], [], []  # per step: (B, K), (B, K), (B, K, L)
    history = tokens.new_empty(batch, beams, 0) if constraints.no_repeat_ngram_size else None  # (B, K, t)

    def advance(t: int) -> Tensor:
        nonlocal state, tokens, history
        logits, state, alpha, _, _ = decoder.step(tokens, state, features, keys)  # (B, K, V), (B, K, L)
        log_probs = constraints.apply(word_log_probs(logits, unk_id), history, t)  # (B, K, V)
        chosen = log_probs.new_zeros(batch, log_probs.size(-1))  # (B, V) earlier groups' beams choosing each word
        parent, word = [], []
        for search in searches:
            own = log_probs[:, search.offset : search.offset + width]  # (B, W, V)
            penalised = own if groups == 1 else own - settings.diversity * chosen.unsqueeze(1)
            group_parent, group_word = search.advance(own, penalised, t, settings)  # (B, W) x 2
            if groups > 1:
                counted = (~search.done).unsqueeze(1).expand_as(group_word).to(chosen.dtype)  # (B, W)
                chosen.scatter_add_(1, group_word, counted)
            parent.append(group_parent + search.offset if search.offset else group_parent)
            word.append(group_word)
        parent, tokens = (parent[0], word[0]) if groups == 1 else (torch.cat(parent, 1), torch.cat(word, 1))  # (B, K)
        state = tuple(_rows(s, parent) for s in state)  # follow the parents
        if history is not None:
            history = torch.cat([_rows(history, parent), tokens.unsqueeze(-1)], dim=-1)  # (B, K, t + 1)
        words.append(tokens)
        parents.append(parent)
        alphas.append(alpha)
        return torch.stack([search.done for search in searches], dim=1) if groups > 1 else searches[0].done  # (B, [G])

    steps = run_steps(max_len, static_steps(static_shapes, features), advance)
    found = [search.best(steps, settings.length_penalty) for search in searches]  # G x (B, P) x 3
    sums, end_steps, rows = (torch.cat(part, dim=1) for part in zip(*found))  # (B, G * P)
    order = sums.sort(dim=1, descending=True, stable=True).indices[:, : settings.n_best]  # (B, N)
    scores, end_steps, rows = sums.gather(1, order), end_steps.gather(1, order), rows.gather(1, order)
    tokens, attention, lengths = _trace(words, parents, alphas, end_steps, rows)  # (B, N, T), (B, N, T, L), (B, N)
    generation = Generation(tokens[:, 0], scores[:, 0], attention[:, 0], lengths[:, 0])
    if settings.n_best > 1:
        generation.n_best_tokens, generation.n_best_scores, generation.n_best_lengths = tokens, scores, lengths
    return generation


def _rows(values: Tensor, parent: Tensor) -> Tensor:
    """The rows (B, K, ...) of each image's beams that ``parent`` (B, K) names."""
    return values.gather(1, parent.view(*parent.shape, *[1] * (values.dim() - 2)).expand_as(values))


def _penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha; 1 when alpha is 0."""
    return ((5 + length) / 6) ** alpha


def _trace(
    words: list[Tensor], parents: list[Tensor], alphas: list[Tensor], end_step: Tensor, row: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Follow the backpointers of N captions per image from beam ``row`` at ``end_step`` (B, N): <end> there when it
    lies before the last step (a finished hypothesis), the words of the beams it came from before it. Their tokens
    (B, N, T), alphas (B, N, T, L) and lengths (B, N).

    The loop only walks the rows back (a gather and a where per step); the words and attention maps of all steps
    are then read at once: every kernel here runs inside a decoding call's CUDA graph, once per word."""
    steps = len(words)
    at = torch.arange(steps, device=row.device)  # (T,)
    before = at < end_step.unsqueeze(-1)  # (B, N, T): the caption's words, <end> excluded
    rows, came_from = [], []  # per step, last first: the caption's beam after the step's reorder, and its parent
    for t in reversed(range(steps)):
        parent = parents[t].gather(1, row)  # (B, N)
        rows.append(row)
        came_from.append(parent)
        row = torch.where(before[..., t], parent, row)
    rows, came_from = torch.stack(rows[::-1], dim=2), torch.stack(came_from[::-1], dim=2)  # (B, N, T) x 2
    chosen = torch.stack(words, dim=2).gather(1, rows)  # (B, N, T): the word each beam chose
    tokens = torch.where(before, chosen, torch.where(at == end_step.unsqueeze(-1), END_ID, PAD_ID))
    history = torch.stack(alphas, dim=2)  # (B, K, T, L): alpha_t of each beam before the step's reorder
    spread = (-1, -1, -1, history.size(-1))
    read = history.gather(1, came_from.unsqueeze(-1).expand(*spread))  # (B, N, T, L): the parent's, for a word
    at_end = history.gather(1, rows.unsqueeze(-1).expand(*spread))  # (B, N, T, L): the ending beam's, for <end>
    attention = torch.where(before.unsqueeze(-1), read, at_end * (at == end_step.unsqueeze(-1)).unsqueeze(-1))
    return tokens, attention, end_step + (end_step < steps)
