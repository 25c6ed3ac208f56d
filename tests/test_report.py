"""evaluate_split: every image decoded once, scored against all its references, written as results, metrics and
per-image scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from captioner.config import DecodingConfig, to_dict
from captioner.data.readers import Box, Record
from captioner.errors import DataError
from captioner.evaluation.report import evaluate_split
from captioner.inference import LoadedModel
from conftest import never_ending_captioner

GREEDY = DecodingConfig(method="greedy", max_len=3)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    """A captioner that says "circle circle circle" of every image (64 px: a 2x2 attention grid)."""
    model, vocab, config = never_ending_captioner(["a", "red", "circle", "square"], favoured=["circle"])
    return LoadedModel(model, vocab, config, 64)


@pytest.fixture
def records(tmp_path: Path) -> list[Record]:
    """Image 2 (described as the model describes it, its circle filling the image), image 1 (a red square) and
    image 3, whose file is missing."""
    for name in ("one", "two"):
        Image.new("RGB", (50, 40), "red").save(tmp_path / f"{name}.png")
    whole = (Box("circle", 0.0, 0.0, 1.0, 1.0),)
    return [
        Record(str(tmp_path / "two.png"), 2, ("circle circle circle", "a red circle"), "test", whole),
        Record(str(tmp_path / "one.png"), 1, ("a red square",), "test"),
        Record(str(tmp_path / "gone.png"), 3, ("a circle",), "test"),
    ]


def test_each_image_is_scored_against_its_references_and_written(
    loaded: LoadedModel, records: list[Record], tmp_path: Path
) -> None:
    out = tmp_path / "eval"
    metrics, skipped = evaluate_split(loaded, records, out, batch_size=2, coco=False, decoding=GREEDY)
    assert [s.path for s in skipped] == [records[2].image_path] and skipped[0].reason == "file not found"
    assert json.loads((out / "results.json").read_text()) == [
        {"image_id": 1, "caption": "circle circle circle"},
        {"image_id": 2, "caption": "circle circle circle"},
    ]
    assert metrics["images"] == 2 and metrics["skipped_images"] == 1 and metrics["decoding"] == to_dict(GREEDY)
    # 3 of the 6 words match (all of image 2's, none of image 1's), both captions as long as a reference
    assert metrics["bleu"]["bleu1"] == pytest.approx(0.5) and "coco_caption" not in metrics
    correctness = metrics["attention_correctness"]  # the box covers the image: all the attention falls in it
    assert correctness == {"mean_mass": pytest.approx(1.0), "uniform_mass": 1.0, "words": 3, "images": 1}
    per_image = json.loads((out / "per_image.json").read_text())
    assert [row["image_id"] for row in per_image] == [1, 2]  # sorted by id, the unreadable image left out
    assert per_image[1]["references"] == ["circle circle circle", "a red circle"]
    assert per_image[1]["file"] == records[0].image_path
    assert (per_image[0]["bleu1"], per_image[1]["bleu1"], per_image[1]["bleu3"]) == (0.0, 1.0, pytest.approx(1.0))
    assert json.loads((out / "metrics.json").read_text())["bleu"] == metrics["bleu"]
    table = metrics["table"].splitlines()
    assert table[0].startswith("2 images scored (1 skipped: missing or unreadable); scores on the 0-1 scale")
    assert "  nltk BLEU1      0.5000" in table and table[-1] == f"per image: {out / 'per_image.json'}"


def test_a_split_without_a_decodable_image_is_refused(
    loaded: LoadedModel, records: list[Record], tmp_path: Path
) -> None:
    with pytest.raises(DataError, match="the split has no images to evaluate"):
        evaluate_split(loaded, [], tmp_path / "none", coco=False, decoding=GREEDY)
    with pytest.raises(DataError, match="none of the 1 images could be decoded"):
        evaluate_split(loaded, records[2:], tmp_path / "gone", coco=False, decoding=GREEDY)
    assert not (tmp_path / "none").exists() and not (tmp_path / "gone").exists()
