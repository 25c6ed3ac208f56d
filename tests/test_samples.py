"""The pictures a run draws while it trains (``captioner.training.samples``, ``captioner.viz.training``): the
sample sheets of every validation, in the run folder and in the loggers, and the curves at the end."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, TENSORS, EventAccumulator

from captioner.bundle import load_trained
from captioner.errors import ConfigError
from captioner.training.samples import TrainingPictures, caption_markdown, publish, untouched
from captioner.viz.training import TRAIN_LOSS, Sample, curves_figure
from tests.conftest import compose_cfg, tiny_overrides

EPOCHS = 2


def _train(tiny_shapes: Path, tmp_path: Path, *extra: str) -> tuple[Path, str]:
    """A two-epoch run of two steps each (CSV and TensorBoard loggers); its folder and what it printed."""
    import train

    base = [o for o in tiny_overrides(tiny_shapes, tmp_path) if o != "logger=csv"]
    overrides = [*base, "logger=[csv,tensorboard]", f"trainer.max_epochs={EPOCHS}", "+trainer.limit_train_batches=2"]
    cfg = compose_cfg([*overrides, "trainer.log_every_n_steps=1", "test=false", *extra], tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.train(cfg)
    return Path(cfg.paths.output_dir), printed.getvalue()


@pytest.fixture(scope="module")
def runs(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The same seeded run with the pictures on (the default) and off (``callbacks.samples=null``)."""
    return {
        "on": _train(tiny_shapes, tmp_path_factory.mktemp("on")),
        "off": _train(tiny_shapes, tmp_path_factory.mktemp("off"), "callbacks.samples=null"),
    }


def _events(run: Path) -> EventAccumulator:
    (folder,) = (run / "tensorboard").glob("version_*")
    events = EventAccumulator(str(folder), size_guidance={IMAGES: 0, TENSORS: 0, SCALARS: 0})
    return events.Reload()


@pytest.mark.slow
def test_tensorboard_gets_an_image_and_a_text_per_sample_at_each_validations_step(runs) -> None:
    run, _ = runs["on"]
    events = _events(run)
    picked = json.loads((run / "samples" / "picked.json").read_text())
    tags = [f"val/samples/image_{p['image_id']}" for p in picked]  # after val/'s scalars, TensorBoard sorting tags
    assert len(tags) == 4 and sorted(events.Tags()["images"]) == sorted(tags)
    # the fit's validations (train.py's final one of the picked checkpoint is final/..., no pictures)
    validation_steps = [e.step for e in events.Scalars("val/bleu4")]
    assert len(validation_steps) == EPOCHS
    for tag, entry in zip(tags, picked):
        images = events.Images(tag)
        assert [i.step for i in images] == validation_steps  # beside the scalars of the same validation
        picture = Image.open(io.BytesIO(images[-1].encoded_image_string))
        assert picture.width == images[-1].width == 384 and picture.height > 200  # drawn for the images tab
        texts = events.Tensors(f"{tag}/text_summary")  # the text plugin's entries: string tensors
        assert [t.step for t in texts] == validation_steps
        text = texts[-1].tensor_proto.string_val[0].decode()
        assert "**caption:**" in text and all(reference in text for reference in entry["references"])


@pytest.mark.slow
def test_the_run_folder_holds_a_sheet_per_epoch_and_the_curves(runs) -> None:
    run, printed = runs["on"]
    sheets = sorted((run / "samples").glob("epoch_*.png"))
    assert [s.name for s in sheets] == [f"epoch_{e:03d}.png" for e in range(EPOCHS)]
    for sheet in sheets:
        with Image.open(sheet) as picture:
            picture.load()
            assert picture.width > 400 and picture.height > 4 * 200  # four overlays, one under the other
    with Image.open(run / "curves.png") as curves:
        curves.load()
        assert curves.size == (1000, 700)
    picked = json.loads((run / "samples" / "picked.json").read_text())
    assert all(Path(p["image"]).is_file() and p["references"] for p in picked)
    assert f"training curves:  {run / 'curves.png'}" in printed


@pytest.mark.slow
def test_off_writes_no_picture_and_the_pictures_never_change_training(runs) -> None:
    on, off = runs["on"][0], runs["off"][0]
    assert not (off / "samples").exists() and not (off / "curves.png").exists()
    assert _events(off).Tags()["images"] == []
    trained = [load_trained(run / "bundle.pt").model.state_dict() for run in (on, off)]
    assert trained[0].keys() == trained[1].keys()
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])  # same RNG, modes and metrics
    assert json.loads((on / "metrics.json").read_text()) == json.loads((off / "metrics.json").read_text())


def test_a_failure_to_draw_is_one_warning_and_training_goes_on(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import train

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("captioner.training.samples.draw_sample_sheet", full_disk)
    monkeypatch.setattr("captioner.training.samples.draw_curves", full_disk)
    cfg = compose_cfg([*tiny_overrides(tiny_shapes, tmp_path), "debug=fast"], tmp_path)
    with caplog.at_level(logging.WARNING, logger="captioner.training.samples"):
        train.train(cfg)
    warnings = [r.getMessage() for r in caplog.records if r.name == "captioner.training.samples"]
    assert warnings == [
        "could not draw the samples (OSError: [Errno 28] No space left on device); training goes on",
        "could not draw the curves (OSError: [Errno 28] No space left on device); training goes on",
    ]
    assert (Path(cfg.paths.output_dir) / "bundle.pt").is_file()


def test_the_decoding_leaves_modes_and_random_generators_as_they_were() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(2))
    model.train()
    model[2].eval()  # a frozen part stays in eval mode
    model.device = torch.device("cpu")
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    with untouched(model):
        assert not any(m.training for m in model.modules())
        torch.rand(5), random.random(), np.random.rand(2)
        assert not torch.is_grad_enabled()
    assert [m.training for m in model.modules()] == [True, True, True, False]
    after = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]


def _history() -> list[dict]:
    rows = [(0, 3.0, 0.10), (1, 2.0, 0.30), (2, 1.5, 0.45), (3, -0.2, 0.52), (4, -0.3, 0.50)]
    return [
        {"epoch": e, "step": 10 * (e + 1), TRAIN_LOSS: loss, "scst": e >= 3, "val/bleu4": b, "monitor": b}
        for e, loss, b in rows
    ]


def test_the_curves_mark_the_switch_to_scst_and_the_picked_checkpoint() -> None:
    fig = curves_figure(_history(), picked_epoch=3)
    loss, bleu, cider, correctness = fig.axes[:4]
    assert [ax.get_title() for ax in (loss, bleu)] == ["training loss (mean per epoch)", "validation BLEU-4"]
    assert list(bleu.lines[0].get_xdata()) == [0, 1, 2, 3, 4]
    assert list(bleu.lines[0].get_ydata()) == [0.10, 0.30, 0.45, 0.52, 0.50]
    labels = [text.get_text() for text in bleu.get_legend().get_texts()]
    assert labels == ["SCST from epoch 3", "picked checkpoint (epoch 3)"]
    star = [line for line in bleu.lines if line.get_marker() == "*"]
    assert [list(star[0].get_xdata()), list(star[0].get_ydata())] == [[3], [0.52]]
    assert "not computed" in [t.get_text() for t in cider.texts]  # no CIDEr-D in this history


def test_a_resumed_run_keeps_the_picked_images_and_the_whole_history(tiny_shapes: Path, tmp_path: Path) -> None:
    from captioner.data.sources import ShapesSource

    records = ShapesSource(tiny_shapes).records("val")
    first = TrainingPictures(dirpath=str(tmp_path / "pictures"), count=3)
    chosen = first._records(records)
    assert [r.image_id for r in chosen] == [records[0].image_id, records[8].image_id, records[16].image_id]
    first.history = _history()
    resumed = TrainingPictures(dirpath=str(tmp_path / "resumed"), count=3)
    resumed.load_state_dict(first.state_dict())
    assert resumed.history == _history() and [r.image_id for r in resumed._records(records)] == first.picked
    trainer = mock.Mock()
    trainer.checkpoint_callback.best_model_score = torch.tensor(0.52)
    assert resumed.picked_epoch(trainer) == 3


def test_a_sample_count_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"callbacks.samples.count=0 must be in \[1, 32\]"):
        TrainingPictures(dirpath=".", count=0)


def _sample(image_id: int) -> Sample:
    return Sample(image_id, Image.new("RGB", (8, 8)), ["a", "dog"], torch.full((2, 4), 0.25), (2, 2), ("a cat",))


def test_wandb_gets_the_images_with_their_captions_and_mlflow_the_sheet(tmp_path: Path) -> None:
    wandb = mock.create_autospec(WandbLogger, instance=True)
    mlflow = mock.create_autospec(MLFlowLogger, instance=True)
    mlflow.run_id = "run-1"
    trainer = mock.Mock(loggers=[wandb, mlflow])
    trainer.fit_loop.epoch_loop._batches_that_stepped = 12
    samples, overlays = [_sample(5), _sample(9)], [Image.new("RGB", (4, 4)), Image.new("RGB", (4, 4))]
    publish(trainer, samples, overlays, tmp_path / "epoch_001.png")
    wandb.log_image.assert_called_once_with(
        key="samples", images=overlays, step=12, caption=["5: a dog (reference: a cat)", "9: a dog (reference: a cat)"]
    )
    mlflow.experiment.log_artifact.assert_called_once_with("run-1", str(tmp_path / "epoch_001.png"), "samples")
    assert caption_markdown(samples[0]) == "**caption:** a dog\n\n**references:**\n\n- a cat"


def test_a_sample_picture_is_the_sheet_the_cli_draws_under_its_two_line_heading(tmp_path: Path) -> None:
    from captioner.viz.overlay import shade
    from captioner.viz.sheet import CELL, TEXT, sheet_picture
    from captioner.viz.training import draw_sample_sheet, sample_picture

    red = Image.new("RGB", (48, 24), (200, 0, 0))
    words = ["w0", "w1", "w2"]
    sample = Sample(7, red, words, torch.full((len(words), 4), 0.25), (2, 2), ("a red box",))
    picture = sample_picture(sample, 3)
    assert sample.title(3) == "image 7, epoch 3: w0 w1 w2\nreference: a red box"
    shading = shade(red.resize((CELL, CELL // 2)), words, sample.alphas, (2, 2))  # the image shown CELL wide
    assert picture.tobytes() == sheet_picture(shading, words, sample.title(3)).tobytes()
    one_line = sheet_picture(shading, words, "image 7, epoch 3: w0 w1 w2")
    assert picture.width == one_line.width and picture.height == one_line.height + TEXT + 6  # the reference's line
    pixels = np.asarray(picture)
    assert ((pixels == (200, 0, 0)).all(axis=-1)).sum() >= CELL * (CELL // 2)  # the image, then uniform panels
    sheet = tmp_path / "epoch_003.png"
    pictures = draw_sample_sheet([sample, sample], 3, sheet)
    with Image.open(sheet) as drawn:
        assert drawn.size == (picture.width, 2 * picture.height + 24)
    assert [p.size for p in pictures] == [picture.size] * 2


def test_tensorboard_gets_a_sample_drawn_narrow_enough_to_read_in_its_images_tab() -> None:
    """TensorBoard's images tab shows every picture 348 px wide (benchmarks/tensorboard_view.py): the sheet's
    picture of a 10-word caption (1226 px) came out at 0.28 of its size, its 16 px text 4.5 px high."""
    from captioner.viz.sheet import GAP, TEXT
    from captioner.viz.training import TENSORBOARD, sample_picture

    words = "a purple square above a red circle next to it".split()
    sample = Sample(7, Image.new("RGB", (160, 120), (200, 0, 0)), words, torch.full((10, 4), 0.25), (2, 2), ("r",))
    wide, narrow = sample_picture(sample, 3), sample_picture(sample, 3, TENSORBOARD)
    assert wide.width > 1200 and narrow.width == 3 * 112 + 4 * GAP == 384  # three panels a row, no colour bar
    assert 348 / narrow.width * TEXT > 14  # its text as the images tab shows it, in pixels
    red = (np.asarray(narrow) == (200, 0, 0)).all(axis=-1)  # uniform attention: every panel is the image as is
    columns = [GAP + c * (112 + GAP) for c in range(3)]
    assert all(red[:, left : left + 112].any(axis=0).all() for left in columns)  # each column 112 px wide
    rows = red.any(axis=1).nonzero()[0]
    assert red.sum() == 11 * 112 * 84 and rows[0] > 3 * (TEXT + 6)  # 11 panels of 112 x 84 under a 3-line heading
