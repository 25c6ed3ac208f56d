"""The names of the metrics training logs: ``<split>/<name>``, and ``final/<split>/<name>`` for the run's final scores.

``CaptionerModule`` logs them, the checkpoint and early-stopping callbacks monitor them
(``conf/callbacks``), ``training.validate`` accepts a ``monitor`` only from ``MONITORS`` and ``train.py``
reports them. Each epoch's validation logs ``val/<name>``, decoded as ``model.decoding`` says (greedy by
default); the run's final scores, its picked checkpoint decoded as ``captioner evaluate`` decodes (beam search
by default), are ``final/val/<name>`` and ``final/test/<name>`` (``training.loggers.log_final``, metrics.json):
another decoding of one checkpoint, never another point of the epochs' curves.
"""

from __future__ import annotations

from captioner.data.splits import SPLITS

TRAIN, VAL, TEST = SPLITS
LOSS = "loss"  # the training objective's loss; on val and test the teacher-forced cross-entropy
BLEU = ("bleu1", "bleu2", "bleu3", "bleu4")  # captioner.evaluation.bleu.corpus_bleu_scores's keys
CIDER = "cider"  # CIDEr-D of the decoded captions
CORRECTNESS = "attention_correctness"  # mean attention mass inside the named object's box
GRAPH_REPLAYS = "graph_replays"  # the share of an epoch's training steps that replayed the CUDA graph (model.graphs)
PROGRESS = "bleu4"  # the evaluation metric shown in the progress bar
EVALUATION = (*BLEU, CIDER, LOSS, CORRECTNESS)  # what a validation or test epoch logs (when it can)


FINAL = "final"  # the prefix of the run's final scores


def metric(split: str, name: str) -> str:
    """The logged name of metric ``name`` on ``split`` (``"val/bleu4"``)."""
    return f"{split}/{name}"


def final(name: str) -> str:
    """The name of the run's final score of the logged ``name`` (``"val/bleu4"`` -> ``"final/val/bleu4"``)."""
    return f"{FINAL}/{name}"


MONITORS = (*(metric(VAL, name) for name in EVALUATION), metric(TRAIN, LOSS))  # what a callback can monitor
