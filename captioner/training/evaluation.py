"""A validation or test epoch that really decodes: captions of every rank gathered, each image counted once,
scored against all its references.

Each rank decodes its shard (greedy or beam, never teacher-forced) and keeps its captions and the
attention-correctness statistics of the images with boxes; at the end of the epoch they are gathered from
every rank (an image the distributed sampler padded in twice is kept once) and scored with nltk's corpus
BLEU and CIDEr-D, plus attention correctness where the split has boxes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from captioner.data.vocab import Vocabulary
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.evaluation.cider import corpus_cider_d
from captioner.evaluation.correctness import AttentionCorrectness
from captioner.model.decoding import Generation
from captioner.training.metrics import CIDER, CORRECTNESS

log = logging.getLogger(__name__)


class EvaluationEpoch:
    """The captions (and attention statistics) one rank decodes in an epoch of one split, and their scores."""

    def __init__(self, split: str, references: dict[int, list[list[str]]], boxes: dict[int, Any]) -> None:
        """``references``: image id -> its reference captions (words); ``boxes``: image id -> its object boxes."""
        self.split = split
        self.references = references
        self.boxes = boxes
        self.predictions: dict[int, list[str]] = {}
        self.correctness = AttentionCorrectness()

    def add(self, image_ids: list[int], generation: Generation, grid: tuple[int, int], vocab: Vocabulary) -> None:
        """Keep the decoded captions of ``image_ids`` (and the attention statistics of those with boxes)."""
        tokens = generation.tokens.cpu()
        alphas = generation.alphas.float().cpu()
        for row, image_id in enumerate(image_ids):
            words = vocab.decode(tokens[row].tolist())
            self.predictions[image_id] = words
            if image_id in self.boxes:
                self.correctness.update(image_id, words, alphas[row, : len(words)], grid, self.boxes[image_id])

    def finish(self) -> tuple[dict[int, list[str]], dict[str, float]]:
        """The captions of every rank (image id -> words) and their scores (metric name -> value, in logging
        order; empty when no image of the split could be decoded). Every rank must call it."""
        predictions = gather_predictions(self.predictions)
        correctness = gather_list([self.correctness.state()])  # each image once, padded repeats too
        hypotheses = {i: words for i, words in predictions.items() if i in self.references}
        if not hypotheses:
            log.warning("no %s image could be decoded: BLEU not computed", self.split)
            return predictions, {}
        scores = dict(corpus_bleu_scores(self.references, hypotheses))
        scores[CIDER] = corpus_cider_d(self.references, hypotheses)
        merged = AttentionCorrectness.merge(correctness)
        if merged.words:
            scores[CORRECTNESS] = merged.compute()["mean_mass"]
        return predictions, scores


def gather_predictions(predictions: dict[int, list[str]]) -> dict[int, list[str]]:
    """Merge the per-rank predictions; an image the sampler padded in twice is kept once."""
    merged: dict[int, list[str]] = {}
    for part in gather_list([predictions]):
        merged.update(part)
    return merged


def gather_list(items: list[Any]) -> list[Any]:
    """The concatenation of ``items`` over every rank (``items`` itself outside a distributed run)."""
    if not (dist.is_available() and dist.is_initialized()):
        return items
    gathered: list[list[Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]
