"""Result files: COCO evaluation-server captions and metric summaries with their scale."""

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO

from captioner.errors import ConfigError
from captioner.evaluation.results import SCALE, server_results_name, write_metrics, write_results


def test_results_are_coco_server_format_sorted_by_image_id(tmp_path):
    path = tmp_path / "sub" / "captions_val_results.json"
    write_results(path, {42: "a red circle", np.int64(7): 'a "quoted" \u00e9 caption', 13: ""})
    rows = json.loads(path.read_text())
    assert rows == [
        {"image_id": 7, "caption": 'a "quoted" \u00e9 caption'},
        {"image_id": 13, "caption": ""},
        {"image_id": 42, "caption": "a red circle"},
    ]
    assert [type(row["image_id"]) for row in rows] == [int, int, int]

    ground_truth = COCO()
    ground_truth.dataset = {
        "images": [{"id": i} for i in (7, 13, 42)],
        "annotations": [{"id": 1, "image_id": 7, "caption": "x"}],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        ground_truth.createIndex()
        loaded = ground_truth.loadRes(str(path))
    assert sorted(loaded.getImgIds()) == [7, 13, 42]


def test_results_reject_bad_types_and_write_nothing(tmp_path):
    path = tmp_path / "results.json"
    with pytest.raises(TypeError, match="not an integer"):
        write_results(path, {"7": "a caption"})
    with pytest.raises(TypeError, match="caption of image 7"):
        write_results(path, {7: ["a", "caption"]})
    assert not path.exists()


def test_metrics_carry_the_scale_and_become_plain_json(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")
    write_metrics(
        path,
        {
            "BLEU-4": np.float32(0.25),
            "CIDEr": 1.5,
            "images": np.int64(5),
            "loss": torch.tensor(0.5),
            "correctness": {"mean_mass": math.nan, "words": 0},
            "beam": [3, 5],
        },
    )
    text = path.read_text()
    assert "NaN" not in text
    metrics = json.loads(text)
    assert list(metrics)[0] == "scale"
    assert metrics == {
        "scale": SCALE,
        "BLEU-4": 0.25,
        "CIDEr": 1.5,
        "images": 5,
        "loss": 0.5,
        "correctness": {"mean_mass": None, "words": 0},
        "beam": [3, 5],
    }
    assert "multiply by 100" in SCALE


def test_metrics_accept_only_their_own_scale_and_refuse_unknown_types(tmp_path):
    write_metrics(tmp_path / "ok.json", {"bleu": {"bleu4": 0.2}, "scale": SCALE})
    assert json.loads((tmp_path / "ok.json").read_text()) == {"scale": SCALE, "bleu": {"bleu4": 0.2}}
    with pytest.raises(ValueError, match="scale"):
        write_metrics(tmp_path / "m.json", {"scale": "0-100"})
    with pytest.raises(TypeError, match="'when'"):
        write_metrics(tmp_path / "m.json", {"when": object()})
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize(
    "image_list, name, expected",
    [
        ("annotations/image_info_test2014.json", "sat-soft", "captions_test2014_sat-soft_results.json"),
        ("image_info_test-dev2015.json", "captioner", "captions_test-dev2015_captioner_results.json"),
        ("/data/coco/captions_val2014.json", "Model2", "captions_val2014_Model2_results.json"),
    ],
)
def test_the_server_results_file_is_named_as_the_server_asks(image_list, name, expected):
    assert server_results_name(image_list, name) == expected


@pytest.mark.parametrize(
    "image_list, name, message",
    [
        ("my_test_images.json", "x", "cannot tell the COCO split from this file name"),
        ("image_info_test2014.json.bak", "x", "cannot tell the COCO split"),
        ("image_info_test2014.json", "my_model", "use letters, digits and hyphens only"),
        ("image_info_test2014.json", "", "use letters, digits and hyphens only"),
    ],
)
def test_a_results_file_name_the_server_would_misread_is_refused(image_list, name, message):
    with pytest.raises(ConfigError, match=message):
        server_results_name(image_list, name)
