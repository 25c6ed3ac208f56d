"""Corpus-level BLEU-1..4 with nltk (pure Python, no Java): the validation metric.

Each image contributes once: its hypothesis is scored against ALL of its reference captions, and
n-gram matches and lengths are pooled over the corpus before the geometric mean (Papineni et al.),
which is what ``nltk.translate.bleu_score.corpus_bleu`` does. No smoothing, as in the paper's tables.
The numbers differ slightly from the coco-caption scorer (different tokenisation and
brevity-penalty details); report :mod:`captioner.evaluation.cococaption` for comparisons with papers.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from nltk.translate.bleu_score import corpus_bleu

BLEU_WEIGHTS = tuple(tuple([1.0 / n] * n) for n in range(1, 5))  # cumulative, uniform weights


def scored_ids(references: Mapping[int, Sequence], hypotheses: Mapping[int, object]) -> list[int]:
    """The image ids to score, sorted; ValueError when there are none or one has no references."""
    if not hypotheses:
        raise ValueError("no hypotheses to score")
    missing = [image_id for image_id in hypotheses if not references.get(image_id)]
    if missing:
        shown = ", ".join(str(i) for i in sorted(missing)[:5])
        raise ValueError(f"{len(missing)} image(s) have a hypothesis but no references (ids: {shown})")
    return sorted(hypotheses)


def _checked(
    references: Mapping[int, list[list[str]]], hypotheses: Mapping[int, list[str]]
) -> tuple[list[int], list[list[list[str]]], list[list[str]]]:
    """The scored image ids with their references and hypotheses, in id order; see ``corpus_bleu_scores``."""
    image_ids = scored_ids(references, hypotheses)
    list_of_references = [references[i] for i in image_ids]
    hyps = [hypotheses[i] for i in image_ids]
    for image_id, refs, hyp in zip(image_ids, list_of_references, hyps):
        if not isinstance(hyp, list) or any(not isinstance(ref, list) for ref in refs):
            raise TypeError(f"image {image_id}: captions must be lists of tokens, not strings")
    return image_ids, list_of_references, hyps


def _bleu(list_of_references: list[list[list[str]]], hyps: list[list[str]]) -> dict[str, float]:
    """``{"bleu1": ..., "bleu4": ...}`` of nltk's corpus BLEU, its zero-count warnings suppressed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores = corpus_bleu(list_of_references, hyps, weights=list(BLEU_WEIGHTS))
    return {f"bleu{n}": float(score) for n, score in enumerate(scores, start=1)}


def corpus_bleu_scores(references: dict[int, list[list[str]]], hypotheses: dict[int, list[str]]) -> dict[str, float]:
    """Corpus BLEU-1..4 in [0, 1] of tokenised ``hypotheses`` against tokenised ``references``.

    ``references`` maps image id -> its reference captions (each a list of tokens) and may hold more
    images than ``hypotheses``; only the images in ``hypotheses`` (image id -> generated tokens) are
    scored, each once with all of its references. An empty hypothesis scores zero matches (and a
    brevity penalty); nltk's zero-count warnings are suppressed.

    Returns ``{"bleu1": ..., "bleu2": ..., "bleu3": ..., "bleu4": ...}``.
    Raises ValueError when there is nothing to score, or when an image of ``hypotheses`` has no
    references; TypeError when a caption is a string instead of a token list.
    """
    _, list_of_references, hyps = _checked(references, hypotheses)
    return _bleu(list_of_references, hyps)


def image_bleu_scores(
    references: dict[int, list[list[str]]], hypotheses: dict[int, list[str]]
) -> dict[int, dict[str, float]]:
    """BLEU-1..4 of each image alone (its hypothesis against its references), as ``corpus_bleu_scores``
    computes them for a corpus of one image: image id -> ``{"bleu1": ..., "bleu4": ...}``.

    Without smoothing, an image whose hypothesis shares no n-gram of some order with its references
    scores 0 from that order up. Raises as ``corpus_bleu_scores`` does.
    """
    image_ids, list_of_references, hyps = _checked(references, hypotheses)
    return {i: _bleu([refs], [hyp]) for i, refs, hyp in zip(image_ids, list_of_references, hyps)}
