"""What every decoding method shares: its result, the constraints on a caption, the allowed words'
log-probabilities and the one step loop (``run_steps``) that greedy, sampling, rollouts and beam search
advance a word at a time.

The loop never shrinks the batch: finished rows are masked. Dynamic shapes: every ``EXIT_CHECK_INTERVAL``
steps one host read asks whether every row is done, and the loop stops early. Static shapes: all
``max_len`` steps run and nothing is read back inside the loop, so every call has the same shapes and
kernels, what a captured CUDA graph needs; the captions, scores and alphas are the same either way (the
extra steps only add <pad>).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from captioner.config import DecodingConfig
from captioner.data.vocab import END_ID, PAD_ID, START_ID

EXIT_CHECK_INTERVAL = 4  # steps between the host checks for "every row is done"


@dataclass
class Generation:
    """Generated captions, T = the longest of them; with ``DecodingConfig.n_best`` N > 1 (beam and diverse beam
    search), the N best of each image as well, best first (the first is the one caption above)."""

    tokens: Tensor  # (B, T) long: no <start>, <end> where emitted, <pad> after it
    scores: Tensor  # (B,) sum of the tokens' log-probabilities (beam: over the length penalty)
    alphas: Tensor  # (B, T, L) attention of each returned token, 0 after the end
    lengths: Tensor  # (B,) long, the <end> token included
    n_best_tokens: Tensor | None = None  # (B, N, T) as tokens, the N best captions of each image
    n_best_scores: Tensor | None = None  # (B, N) their scores, as scores, descending
    n_best_lengths: Tensor | None = None  # (B, N) long, as lengths


@dataclass(frozen=True)
class Constraints:
    """What a caption may not do: end before ``min_len`` words (never before its first: a caption is not empty),
    repeat an n-gram (n = ``no_repeat_ngram_size``)."""

    min_len: int = 1
    no_repeat_ngram_size: int = 0

    @classmethod
    def of(cls, settings: DecodingConfig) -> Constraints:
        """The constraints ``settings`` asks for, with at least one word a caption."""
        return cls(max(settings.min_len, 1), settings.no_repeat_ngram_size)

    def apply(self, log_probs: Tensor, words: Tensor | None, step: int) -> Tensor:
        """Set -inf, in place, in the log-probs (..., V) of step ``step`` (0-based) for the words the
        constraints forbid after ``words`` (..., step), each row's caption so far; return them.

        A word is blocked when the last n - 1 words followed by it form an n-gram that already occurs
        in the row. A row left with no word gets its <end> back. No value is read back to the host.
        """
        if step >= self.min_len and not self.no_repeat_ngram_size:
            return log_probs
        end = log_probs[..., END_ID].clone()  # (...,)
        if step < self.min_len:
            log_probs[..., END_ID] = float("-inf")
        n = self.no_repeat_ngram_size
        if n and step >= n:
            ngrams = words.unfold(-1, n, 1)  # (..., step - n + 1, n): every n-gram so far
            prefix = words[..., step - n + 1 :].unsqueeze(-2)  # (..., 1, n - 1): the next n-gram's first words
            repeats = (ngrams[..., :-1] == prefix).all(-1)  # (..., step - n + 1)
            # the word each repeat would complete; the others point at <pad>, which is -inf already
            blocked = torch.where(repeats, ngrams[..., -1], PAD_ID)
            log_probs.scatter_(-1, blocked, float("-inf"))
        stuck = log_probs.isneginf().all(-1)  # (...,)
        log_probs[..., END_ID] = torch.where(stuck, end, log_probs[..., END_ID])
        return log_probs


def never_generated(scores: Tensor, unk_id: int | None) -> Tensor:
    """``scores`` (..., V), changed in place: -inf for <pad>, <start> and <unk>, which are never generated (each set
    on the device: no host copy, so it may run inside a CUDA graph capture)."""
    scores[..., PAD_ID] = float("-inf")
    scores[..., START_ID] = float("-inf")
    if unk_id is not None:
        scores[..., unk_id] = float("-inf")
    return scores


def word_log_probs(logits: Tensor, unk_id: int | None) -> Tensor:
    """log p(word) (..., V) in float32; -inf for <pad>, <start> and <unk>, which are never generated."""
    return never_generated(logits.float().log_softmax(dim=-1), unk_id)


def static_steps(static_shapes: bool | None, features: Tensor) -> bool:
    """Whether to run every step (static shapes): as asked, or when None on CUDA only."""
    return features.is_cuda if static_shapes is None else bool(static_shapes)


def run_steps(max_len: int, static: bool, step: Callable[[int], Tensor]) -> int:
    """Call ``step(t)`` for t = 0, 1, ... ``max_len`` - 1, each call one word of every row; it returns
    which rows (any shape) are done. Without ``static``, stop after a multiple of ``EXIT_CHECK_INTERVAL``
    steps once every row is done (the loop's only host reads). Returns the number of steps run."""
    for t in range(max_len):
        done = step(t)
        if not static and (t + 1) % EXIT_CHECK_INTERVAL == 0 and done.all():
            return t + 1
    return max_len


def trimmed(generation: Generation) -> Generation:
    """Drop the trailing steps where every caption has ended (one host sync, after decoding)."""
    lengths = generation.lengths if generation.n_best_lengths is None else generation.n_best_lengths
    steps = int(lengths.max()) if lengths.numel() else 0
    n_best = generation.n_best_tokens
    return Generation(
        generation.tokens[:, :steps],
        generation.scores,
        generation.alphas[:, :steps],
        generation.lengths,
        None if n_best is None else n_best[..., :steps],
        generation.n_best_scores,
        generation.n_best_lengths,
    )
