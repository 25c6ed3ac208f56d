"""Lightning's quick-check overrides finish cleanly: ``python train.py`` with each of them (tiny sizes) returns
without an error or a traceback, writes its run folder, and its closing summary says which scores exist and
why the others were not computed.

The runs are ``train.py`` run as a script, in this process (a subprocess each would take longer than the runs):
what ``python train.py ARGS`` does, exit status included (``cli`` returns: status 0; it exits otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint

from captioner.config import ShapesSpec
from captioner.data.shapes import generate_shapes
from captioner.training.callbacks import BestCheckpoint
from conftest import run_train_here

SPEC = ShapesSpec(n_train=40, n_val=8, n_test=8)  # 10 training batches of 4: an epoch that max_steps can cut
BASE = [
    "data.image_size=64",
    "data.batch_size=4",
    *(f"data.source.{key}={getattr(SPEC, key)}" for key in ("n_train", "n_val", "n_test")),
    "trainer.max_epochs=1",
    "model.objective=cross_entropy",
    "model.decoding.max_len=8",
    "data.num_workers=0",
    "trainer.enable_progress_bar=false",
    "logger=csv",
]
BEST = "checkpoints/epoch000-bleu4"  # the best checkpoint's name starts so
NO_VALIDATION = "no validation during training, so no early stopping and no best checkpoint"
VALIDATED = "validation BLEU (0-1"
TESTED = "test BLEU: BLEU-1"

# override -> (lines the summary and the start notes must hold, the checkpoint evaluated: BEST or a note)
CASES = {
    "+trainer.max_steps=3": (
        [f"trainer.max_steps=3 ends the only epoch (of 10 steps) before its validation: {NO_VALIDATION}"],
        "(the last one: no epoch logged val/bleu4; trainer.max_steps=3 ends the only epoch",
    ),
    "+trainer.limit_train_batches=3": ([], BEST),
    "+trainer.limit_val_batches=0": (
        [
            f"trainer.limit_val_batches=0: {NO_VALIDATION}",
            "validation scores: not computed (trainer.limit_val_batches=0)",
        ],
        "(the last one: no epoch logged val/bleu4; trainer.limit_val_batches=0)",
    ),
    "+trainer.limit_val_batches=0.5": (
        ["trainer.limit_val_batches=0.5 of 1 validation batch(es) is less than one batch: validating 1 batch"],
        BEST,
    ),
    "+trainer.val_check_interval=0.5": ([], BEST),
    "trainer.check_val_every_n_epoch=2": (
        [f"trainer.check_val_every_n_epoch=2 with 1 epoch(s) to run: {NO_VALIDATION}"],
        "(the last one: no epoch logged val/bleu4; trainer.check_val_every_n_epoch=2 with 1 epoch(s) to run)",
    ),
    "+trainer.fast_dev_run=true": ([], "(the last one: no epoch logged val/bleu4; trainer.fast_dev_run selects"),
    "+trainer.accumulate_grad_batches=2": ([], BEST),
    "+trainer.max_time=00:00:00:20": ([], BEST),
    "debug=fast": (["test scores: not computed (test=false)"], "trainer.fast_dev_run selects no best checkpoint"),
    "debug=overfit": ([], BEST),
    "model.objective=scst": (
        [
            "model.objective=scst switches to self-critical training after 5 cross-entropy epoch(s) "
            "(model.scst.after_epochs), but this run ends within 1 epoch(s): it trains with cross-entropy only"
        ],
        BEST,
    ),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dataset and a feature cache that every run shares."""
    root = tmp_path_factory.mktemp("quick")
    generate_shapes(root / "shapes", SPEC)
    return root


@pytest.mark.parametrize("override", CASES)
def test_a_quick_check_override_finishes_and_says_what_it_left_out(
    override: str, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    args = [
        *BASE,
        f"data.source.root={data / 'shapes'}",
        f"data.feature_cache={data / 'cache'}",
        f"paths.log_dir={tmp_path}",
        f"hydra.run.dir={run}",
        override,
    ]
    status = run_train_here(args, monkeypatch)
    out, err = capfd.readouterr()
    assert status == 0, err[-3000:]
    assert "Traceback" not in out + err and "error:" not in err, err[-3000:]
    lines, checkpoint = CASES[override]
    for line in lines:
        assert line in out, out[-3000:]
    (evaluated,) = [line for line in out.splitlines() if line.startswith("checkpoint:")]
    assert checkpoint in evaluated
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "bundle.pt").is_file()
    assert (run / "config.yaml").is_file() and not (run / "FAILED").exists()
    metrics = json.loads((run / "metrics.json").read_text())
    validated = override != "+trainer.limit_val_batches=0"
    assert (VALIDATED in out) == validated and ("final/val/bleu4" in metrics) == validated
    assert (run / "val_captions.json").is_file() == validated
    tested = override != "debug=fast"
    assert (TESTED in out) == tested and ("final/test/bleu4" in metrics) == tested


def test_a_validation_without_the_monitored_metric_is_no_candidate_for_the_best(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    validated = SimpleNamespace(_has_run=True)  # Lightning raises once a validation has run
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(val_loop=validated)), lightning_module=None
    )
    trainer.current_epoch, trainer.global_step = 2, 30
    metrics = {"val/bleu4": torch.tensor(0.5)}  # no val/attention_correctness: no caption named a boxed object
    options = {"dirpath": tmp_path, "monitor": "val/attention_correctness", "mode": "max"}
    with pytest.raises(MisconfigurationException, match="could not find the monitored key"):
        ModelCheckpoint(**options)._save_topk_checkpoint(trainer, metrics)
    best = BestCheckpoint(**options)
    best._save_topk_checkpoint(trainer, metrics)
    assert best.best_model_path == "" and list(tmp_path.iterdir()) == []
    assert "epoch 2, step 30: no val/attention_correctness, so no candidate for the best checkpoint" in caplog.text


@pytest.mark.parametrize(
    "batches, accumulate, every, interval",
    [(10, 1, 10, 2), (15, 1, 10, 3), (2, 1, 10, 1), (20, 2, 10, 2), (40, 1, 10, 10), (94, 1, 10, 10), (10, 1, 1, 1)],
)
def test_an_epoch_of_few_steps_logs_several_points(batches: int, accumulate: int, every: int, interval: int) -> None:
    from captioner.training.quick_checks import fit_log_interval

    trainer = SimpleNamespace(num_training_batches=batches, accumulate_grad_batches=accumulate, log_every_n_steps=every)
    note = fit_log_interval(trainer)
    assert trainer.log_every_n_steps == interval
    steps = batches // accumulate
    assert (note is None) == (interval == every)
    if note is not None:
        assert note == (
            f"trainer.log_every_n_steps={every} with {steps} optimiser steps an epoch: the training metrics are "
            f"logged every {interval} step(s) instead, {steps // interval} points an epoch"
        )


def test_an_epoch_without_a_length_keeps_its_log_interval() -> None:
    from captioner.training.quick_checks import fit_log_interval

    trainer = SimpleNamespace(num_training_batches=float("inf"), accumulate_grad_batches=1, log_every_n_steps=10)
    assert fit_log_interval(trainer) is None and trainer.log_every_n_steps == 10


@pytest.mark.parametrize(
    "interval, every, refused",
    [(10, 1, False), (11, 1, True), (11, None, False), (0.5, 1, False), (1.0, 1, False)],
)
def test_a_validation_interval_longer_than_an_epoch_is_one_line(
    interval: float, every: int | None, refused: bool
) -> None:
    from captioner.errors import ConfigError
    from captioner.training.quick_checks import check_val_interval

    trainer = SimpleNamespace(val_check_interval=interval, check_val_every_n_epoch=every, limit_train_batches=1.0)
    datamodule = SimpleNamespace(train_items=lambda: 40, settings=SimpleNamespace(batch_size=4))  # 10 batches
    if not refused:
        check_val_interval(trainer, datamodule)
        return
    with pytest.raises(ConfigError) as info:
        check_val_interval(trainer, datamodule)
    assert str(info.value).startswith(
        "trainer.val_check_interval=11 is more than the 10 training batches of an epoch: give at most that many"
    )
