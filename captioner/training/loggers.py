"""What the run's loggers show besides what Lightning logs: TensorBoard opening on the run's curves, and the
run's final scores under names of their own.

TensorBoard's dashboards (Time Series, which opens first, Scalars, Images) group the tags by what comes before
their first ``/`` and sort the groups by name, so the run's tags begin with ``train/`` and ``val/``: the
learning rates are ``train/lr/<param group>`` (the module names its scheduler and Adam's param groups),
Lightning's ``epoch`` (added to every log) is ``train/epoch`` in TensorBoard (:class:`TensorBoardLogger`; the
CSV file keeps its ``epoch`` column) and the sample pictures are ``val/samples/...``.

The final scores (the picked checkpoint validated, and tested, as ``captioner evaluate`` decodes) are
validated with the loggers set aside (:func:`loggers_aside`) and then logged once, at the run's last step, as
``final/<split>/<name>`` (:func:`log_final`), never as another epoch of the ``val/`` curves: each epoch's
validation decodes as ``model.decoding`` says (greedy by default), the final one with beam search, and a
change of method is no progress. TensorBoard gets them as a table in its text tab, under ``final`` (a scalar
group ``final`` would come before ``train/``, and one point a tag is no curve); the CSV file, MLflow and W&B
as metrics under the same names, which metrics.json holds too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch import loggers
from lightning.pytorch.loggers import Logger

from captioner.training.metrics import FINAL, TRAIN, final, metric

EPOCH = metric(TRAIN, "epoch")  # Lightning's "epoch" in TensorBoard
LEARNING_RATES = metric(TRAIN, "lr")  # the scheduler's name: LearningRateMonitor logs train/lr/<param group>


class TensorBoardLogger(loggers.TensorBoardLogger):
    """Lightning's TensorBoard logger, with the ``epoch`` Lightning adds to every log written as ``train/epoch``:
    a tag of its own would open TensorBoard's dashboards, before the run's ``train/`` and ``val/`` groups."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Lightning's, ``epoch`` renamed."""
        super().log_metrics({EPOCH if name == "epoch" else name: value for name, value in metrics.items()}, step)


@contextmanager
def loggers_aside(trainer: L.Trainer) -> Iterator[list[Logger]]:
    """Run the body with ``trainer``'s loggers set aside (yielded): what it validates or tests is logged by
    nobody, so that the caller logs it under names of its own (:func:`log_final`)."""
    kept = trainer.loggers
    trainer.loggers = []
    try:
        yield kept
    finally:
        trainer.loggers = kept


def log_final(to: Sequence[Logger], scores: Mapping[str, Any], step: int, decoded: str) -> dict[str, float]:
    """Log the run's final ``scores`` (by their logged names: ``val/bleu4``, ``test/cider``, ...) to the loggers
    ``to`` once, at ``step`` (the run's last training step), as ``final/<name>``: TensorBoard as a table in its
    text tab headed by ``decoded`` (how they were decoded), every other logger as metrics. Returns the scores
    by their final names."""
    named = {final(name): float(value) for name, value in scores.items()}
    if not named:
        return named
    for logger in to:
        if isinstance(logger, loggers.TensorBoardLogger):
            logger.experiment.add_text(FINAL, final_table(named, decoded), step)
        else:
            logger.log_metrics(named, step)
        logger.finalize("success")  # as a validation's end finalizes them: written, TensorBoard's file closed
    return named


def final_table(named: Mapping[str, float], decoded: str) -> str:
    """The final scores (``named``: final name -> value) as TensorBoard's text tab shows them: a markdown table
    under a line saying how they were decoded."""
    rows = "\n".join(f"| `{name}` | {value:.4f} |" for name, value in named.items())
    return f"The run's final scores ({decoded}):\n\n| score | value |\n|---|---|\n{rows}"
