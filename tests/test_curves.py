"""Curves that do not lie: what a run logs each epoch and at its end (metrics.csv, TensorBoard, metrics.json,
curves.png), what it says at its start, and what TensorBoard opens on (a real server, a headless browser).

One small run serves every test: 2 epochs of 2 steps (the log interval of 10 falls to 1, the warm-up of 50 steps
takes the whole run), whose validations are told which epochs' captions name a boxed object (epoch 0's, not epoch
1's), then the final validation and test of the picked checkpoint with beam search.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, TENSORS, EventAccumulator

from captioner.training.evaluation import EvaluationEpoch
from captioner.training.metrics import CORRECTNESS, VAL
from captioner.training.samples import RECORDED
from captioner.viz.training import curves_figure
from conftest import ROOT, compose_cfg, logged, metrics_rows, tiny_overrides

EPOCHS, STEPS = 2, 2
CORRECTNESS_BY_EPOCH = {0: 0.25}  # epoch 1's captions name no boxed object: no correctness
SCORES = ("bleu1", "bleu2", "bleu3", "bleu4", "cider", "loss", CORRECTNESS)


@pytest.fixture(scope="module")
def run(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The run's folder and the lines it logged."""
    import train

    tmp_path = tmp_path_factory.mktemp("curves")
    base = [o for o in tiny_overrides(tiny_shapes, tmp_path) if o != "logger=csv"]
    overrides = [*base, "logger=[csv,tensorboard]", f"trainer.max_epochs={EPOCHS}"]
    cfg = compose_cfg([*overrides, f"+trainer.limit_train_batches={STEPS}"], tmp_path)
    scored = EvaluationEpoch.finish
    validations = []

    def finish(self: EvaluationEpoch) -> tuple[dict, dict]:
        """The real scores, but for the correctness of the fit's validations: CORRECTNESS_BY_EPOCH's."""
        predictions, scores = scored(self)
        if self.split == VAL and len(validations) < EPOCHS:
            scores.pop(CORRECTNESS, None)
            if (value := CORRECTNESS_BY_EPOCH.get(len(validations))) is not None:
                scores[CORRECTNESS] = value
            validations.append(scores)
        return predictions, scores

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("captioner")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
            patch.setattr(EvaluationEpoch, "finish", finish)
            train.train(cfg)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return Path(cfg.paths.output_dir), lines


def _events(run: Path) -> EventAccumulator:
    (folder,) = (run / "tensorboard").glob("version_*")
    return EventAccumulator(str(folder), size_guidance={IMAGES: 0, TENSORS: 0, SCALARS: 0}).Reload()


@pytest.mark.slow
def test_the_final_scores_are_logged_under_their_own_names_not_as_another_epoch(run) -> None:
    folder, _ = run
    rows = metrics_rows(folder)
    assert [int(row["epoch"]) for row in rows if row["val/bleu4"]] == list(range(EPOCHS))  # one a validation
    (last,) = [row for row in rows if row.get("final/val/bleu4")]
    assert int(last["step"]) == EPOCHS * STEPS and last["epoch"] == ""  # at the run's last step, no epoch of its own
    assert not any(value for key, value in last.items() if key.startswith(("val/", "test/", "train/")))
    assert not any(key.startswith("test/") for key in rows[0])  # the test split has final scores only
    written = json.loads((folder / "metrics.json").read_text())
    assert written["decoding"]["method"] == "beam"  # as `captioner evaluate` decodes: not the epochs' greedy
    for split in ("val", "test"):
        for name in SCORES[:-1]:
            key = f"final/{split}/{name}"
            assert float(last[key]) == pytest.approx(written[key], abs=1e-6)
    assert not any(key.startswith(("val/", "test/")) for key in written)
    events = _events(folder)  # TensorBoard: the epochs' curves, and the final scores as a table in the text tab
    assert [e.step for e in events.Scalars("val/bleu4")] == [int(r["step"]) for r in rows if r["val/bleu4"]]
    assert not any(tag.startswith(("final", "test")) for tag in events.Tags()[SCALARS])
    (table,) = events.Tensors("final/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert table.step == EPOCHS * STEPS and "beam search (beam 3) as `captioner evaluate` decodes" in text
    assert f"| `final/val/bleu4` | {written['final/val/bleu4']:.4f} |" in text
    assert f"| `final/test/cider` | {written['final/test/cider']:.4f} |" in text


@pytest.mark.slow
def test_the_curves_are_drawn_from_every_validation_as_the_csv_logged_it(run) -> None:
    folder, _ = run
    checkpoint = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    (history,) = [state["history"] for name, state in checkpoint["callbacks"].items() if "TrainingPictures" in name]
    rows = {int(row["epoch"]): row for row in metrics_rows(folder) if row["val/bleu4"]}
    assert [row["epoch"] for row in history] == list(rows) == list(range(EPOCHS))
    for row in history:  # each key of the history as the CSV logged it: epoch 1 has no correctness (not epoch 0's)
        logged_row = {key: float(rows[row["epoch"]][key]) for key in RECORDED if rows[row["epoch"]][key]}
        assert {key: row[key] for key in RECORDED if key in row} == pytest.approx(logged_row)
    assert logged(folder, f"val/{CORRECTNESS}") == {
        int(rows[e]["step"]): value for e, value in CORRECTNESS_BY_EPOCH.items()
    }
    correctness = curves_figure(history, None).axes[3]
    curve, gaps = correctness.lines
    assert list(curve.get_xdata()) == [0] and list(curve.get_ydata()) == [0.25]  # epoch 0's point drawn
    assert list(gaps.get_xdata()) == [1] and gaps.get_label() == "not computed: no caption named a boxed object"


@pytest.mark.slow
def test_a_small_run_says_its_warm_up_is_longer_than_it_and_logs_several_points_an_epoch(run) -> None:
    folder, lines = run
    steps = EPOCHS * STEPS
    assert (
        f"model.scheduler.warmup_steps=50 warms up over all {steps} optimiser steps of this run's cross-entropy "
        "training: its learning rate only rises, from 2e-06 to 0.002 at its last step, and the cosine schedule "
        "never decays it (a warm-up of at most 1 step(s), a tenth of them, leaves it room)"
    ) in lines
    assert (
        f"trainer.log_every_n_steps=10 with {STEPS} optimiser steps an epoch: the training metrics are logged every "
        f"1 step(s) instead, {STEPS} points an epoch"
    ) in lines
    assert sorted(logged(folder, "train/loss")) == list(range(steps))  # every step, not one point an epoch
    rates = logged(folder, "train/lr/decoder")  # the learning rates in train/, by their param group's name
    assert sorted(rates) == list(range(steps)) and list(rates.values()) == sorted(rates.values())  # only rising
    columns = set(metrics_rows(folder)[0])
    assert "train/ce" in columns and "train/ds" not in columns  # model.loss.ds_lambda=0: no flat 0 series
    assert not any(column.startswith("lr-") for column in columns)


@pytest.mark.slow
def test_tensorboard_opens_on_the_train_and_val_groups(run, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real TensorBoard server, its Time Series page (the one it opens on) rendered by a headless Chromium."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import tensorboard_view

    if tensorboard_view.browser() is None:
        pytest.skip("no headless browser (apt-get install chromium)")
    folder, _ = run
    with tensorboard_view.serve(folder / "tensorboard") as url:
        groups = tensorboard_view.time_series(tensorboard_view.render(url))
    assert list(groups) == ["train", "val"]  # not epoch, lr-Adam, samples, test nor final before them
    assert {"train/ce", "train/loss", "train/epoch", "train/lr/decoder"} <= set(groups["train"])
    scalars = set(_events(folder).Tags()[SCALARS])
    assert "train/epoch" in scalars and "epoch" not in scalars and "train/lr/encoder" in scalars
