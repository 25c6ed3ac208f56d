"""COCO and Karpathy readers: same Records from each format, one-line errors for malformed files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from captioner.data.readers import Box, Record, read_coco, read_image_info, read_karpathy
from captioner.errors import ConfigError, DataError


def write(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def coco_captions(name) -> dict:
    """A COCO captions file with images 42 and 9 (out of order) and 7 (no captions)."""
    return {
        "info": {},
        "licenses": [],
        "images": [
            {"id": 42, "file_name": name(42), "width": 640, "height": 480},
            {"id": 9, "file_name": name(9), "width": 200, "height": 100},
            {"id": 7, "file_name": name(7), "width": 10, "height": 10},
        ],
        "annotations": [
            {"id": 1, "image_id": 42, "caption": "A dog on a couch. "},
            {"id": 2, "image_id": 9, "caption": "Two cats\n"},
            {"id": 3, "image_id": 42, "caption": "a brown dog"},
        ],
    }


def coco_instances() -> dict:
    return {
        "images": [
            {"id": 42, "file_name": "x.jpg", "width": 640, "height": 480},
            {"id": 9, "file_name": "y.jpg", "width": 200, "height": 100},
        ],
        "annotations": [
            {"id": 10, "image_id": 42, "category_id": 18, "bbox": [64, 48, 320, 240]},
            {"id": 11, "image_id": 42, "category_id": 3, "bbox": [600, 0, 80, 48.0]},
        ],
        "categories": [{"id": 18, "name": "dog"}, {"id": 3, "name": "couch"}],
    }


@pytest.mark.parametrize(
    "name", [lambda i: f"COCO_train2014_{i:012d}.jpg", lambda i: f"{i:012d}.jpg"], ids=["2014", "2017"]
)
def test_read_coco_with_instances(tmp_path, capsys, name):
    captions = write(tmp_path / "annotations" / "captions_train.json", coco_captions(name))
    instances = write(tmp_path / "annotations" / "instances_train.json", coco_instances())
    records = read_coco(captions, tmp_path / "train", "train", instances_file=instances)
    assert capsys.readouterr().out == ""  # pycocotools' prints are suppressed
    assert records == [
        Record(str(tmp_path / "train" / name(9)), 9, ("Two cats",), "train"),
        Record(
            str(tmp_path / "train" / name(42)),
            42,
            ("A dog on a couch.", "a brown dog"),
            "train",
            (Box("dog", 0.1, 0.1, 0.6, 0.6), Box("couch", 600 / 640, 0.0, 1.0, 0.1)),
        ),
    ]


def test_read_coco_without_instances_has_no_boxes(tmp_path):
    captions = write(tmp_path / "c.json", coco_captions(lambda i: f"{i}.jpg"))
    records = read_coco(captions, "imgs", "val")
    assert [r.boxes for r in records] == [(), ()]
    assert [r.image_path for r in records] == [str(Path("imgs") / "9.jpg"), str(Path("imgs") / "42.jpg")]
    assert {r.split for r in records} == {"val"}


def karpathy_coco() -> dict:
    def entry(cocoid, imgid, split, folder):
        return {
            "filepath": folder,
            "filename": f"COCO_{folder}_{cocoid:012d}.jpg",
            "imgid": imgid,
            "cocoid": cocoid,
            "split": split,
            "sentids": [imgid * 2, imgid * 2 + 1],
            "sentences": [
                {"tokens": ["a", "cat"], "raw": f"A cat {cocoid}.", "imgid": imgid, "sentid": 0},
                {"tokens": ["a", "dog"], "raw": "a dog ", "imgid": imgid, "sentid": 1},
            ],
        }

    return {
        "dataset": "coco",
        "images": [
            entry(300, 0, "restval", "val2014"),
            entry(100, 1, "train", "train2014"),
            entry(200, 2, "val", "val2014"),
            entry(50, 3, "test", "val2014"),
        ],
    }


def test_read_karpathy_coco_format(tmp_path):
    split_file = write(tmp_path / "dataset_coco.json", karpathy_coco())
    records = read_karpathy(split_file, tmp_path / "coco")
    assert [(r.image_id, r.split) for r in records] == [(50, "test"), (100, "train"), (200, "val"), (300, "train")]
    assert records[1] == Record(
        str(tmp_path / "coco" / "train2014" / "COCO_train2014_000000000100.jpg"), 100, ("A cat 100.", "a dog"), "train"
    )
    assert all(r.boxes == () for r in records)


def test_captions_without_a_word_are_left_out_and_counted(tmp_path, caplog):
    # An empty caption, or one of punctuation only, would train <start> <end> and score as an empty reference.
    data = karpathy_coco()
    data["images"][1]["sentences"] += [{"raw": ""}, {"raw": " ... "}]
    data["images"][2]["sentences"] = [{"raw": "?!"}]
    split_file = write(tmp_path / "dataset_coco.json", data)
    with caplog.at_level("WARNING", logger="captioner.data.readers"):
        records = read_karpathy(split_file, tmp_path)
    assert [(r.image_id, r.captions) for r in records] == [
        (50, ("A cat 50.", "a dog")),
        (100, ("A cat 100.", "a dog")),
        (300, ("A cat 300.", "a dog")),
    ]
    assert caplog.messages == [
        f"{split_file}: 3 captions without a word (empty, or only punctuation or symbols) left out: image 100 '', "
        "image 100 '...', image 200 '?!'; 1 image left with none, left out too"
    ]
    coco = coco_captions(lambda i: f"{i}.jpg")
    coco["annotations"].append({"id": 4, "image_id": 9, "caption": " - "})
    caplog.clear()
    with caplog.at_level("WARNING", logger="captioner.data.readers"):
        records = read_coco(write(tmp_path / "c.json", coco), tmp_path, "train")
    assert [(r.image_id, r.captions) for r in records] == [
        (9, ("Two cats",)),
        (42, ("A dog on a couch.", "a brown dog")),
    ]
    assert len(caplog.messages) == 1 and "1 caption without a word" in caplog.messages[0]


def test_read_karpathy_restval_both_ways_and_split_selection(tmp_path):
    split_file = write(tmp_path / "dataset_coco.json", karpathy_coco())
    with_restval = read_karpathy(split_file, tmp_path, splits=("train",))
    assert [r.image_id for r in with_restval] == [100, 300]
    without = read_karpathy(split_file, tmp_path, splits=("train",), restval_as_train=False)
    assert [r.image_id for r in without] == [100]
    every = read_karpathy(split_file, tmp_path, restval_as_train=False)
    assert [r.image_id for r in every] == [50, 100, 200]
    assert [r.image_id for r in read_karpathy(split_file, tmp_path, splits=("val", "test"))] == [50, 200]


def test_read_karpathy_flickr_format(tmp_path):
    flickr = {
        "dataset": "flickr8k",
        "images": [
            {
                "filename": "1000268201_693b08cb0e.jpg",
                "imgid": 1,
                "split": "train",
                "sentids": [5],
                "sentences": [{"tokens": ["a", "child"], "raw": "A child in a pink dress .", "imgid": 1, "sentid": 5}],
            },
            {
                "filename": "1001773457_577c3a7d70.jpg",
                "imgid": 0,
                "split": "test",
                "sentids": [0],
                "sentences": [{"tokens": ["two", "dogs"], "raw": "Two dogs play", "imgid": 0, "sentid": 0}],
            },
        ],
    }
    split_file = write(tmp_path / "dataset_flickr8k.json", flickr)
    images = tmp_path / "flickr8k" / "images"
    records = read_karpathy(split_file, images)
    assert records == [
        Record(str(images / "1001773457_577c3a7d70.jpg"), 0, ("Two dogs play",), "test"),
        Record(str(images / "1000268201_693b08cb0e.jpg"), 1, ("A child in a pink dress .",), "train"),
    ]


def broken_caption(data):
    data["annotations"][1]["caption"] = 5
    return data


def missing_caption(data):
    del data["annotations"][2]["caption"]
    return data


def unknown_image(data):
    data["annotations"][0]["image_id"] = 1234
    return data


def missing_file_name(data):
    del data["images"][1]["file_name"]
    return data


def repeated_image(data):
    data["images"][2]["id"] = 42  # another file under image 42's id: its captions would go with that file
    return data


def no_annotations(data):
    del data["annotations"]
    return data


@pytest.mark.parametrize(
    "corrupt, problem",
    [
        (missing_caption, "annotation 2 has no 'caption'"),
        (broken_caption, "annotation 1 has 'caption' of type int, expected str"),
        (unknown_image, "annotation 0 has 'image_id' 1234, which no entry of the file defines"),
        (missing_file_name, "image 1 has no 'file_name'"),
        (repeated_image, "image 2 repeats image id 42"),
        (
            no_annotations,
            "the file has no 'annotations': it lists images without captions (an image_info file, as "
            "COCO ships for its test images), so there is nothing to score against; write its results "
            "file for the evaluation server with --image-info FILE --images DIR --out DIR",
        ),
    ],
)
def test_malformed_coco_captions(tmp_path, corrupt, problem):
    path = write(tmp_path / "annotations" / "x.json", corrupt(coco_captions(lambda i: f"{i}.jpg")))
    with pytest.raises(DataError) as info:
        read_coco(path, tmp_path, "train")
    assert str(info.value) == f"{path}: {problem}"


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda d: d["annotations"][1].update(bbox=[1, 2, 3]), "annotation 1 has 'bbox' [1, 2, 3]"),
        (lambda d: d["annotations"][0].update(category_id=99), "annotation 0 has 'category_id' 99"),
        (lambda d: d["images"][0].update(width=0), "image 0 has 'width' 0; expected a positive number"),
        (lambda d: d["images"][1].update(id=42), "image 1 repeats image id 42"),
        (lambda d: d["categories"][0].pop("name"), "category 0 has no 'name'"),
    ],
)
def test_malformed_coco_instances(tmp_path, change, problem):
    captions = write(tmp_path / "c.json", coco_captions(lambda i: f"{i}.jpg"))
    data = coco_instances()
    change(data)
    instances = write(tmp_path / "i.json", data)
    with pytest.raises(DataError) as info:
        read_coco(captions, tmp_path, "train", instances_file=instances)
    assert str(info.value).startswith(f"{instances}: {problem}")


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "is not valid JSON"),
        ([1, 2], "the top level is a JSON list, expected an object"),
    ],
)
def test_not_json_or_wrong_top_level(tmp_path, content, problem):
    path = write(tmp_path / "bad.json", content if isinstance(content, str) else json.dumps(content))
    for read in (lambda: read_coco(path, tmp_path, "train"), lambda: read_karpathy(path, tmp_path)):
        with pytest.raises(DataError) as info:
            read()
        assert str(path) in str(info.value) and problem in str(info.value)
        assert "\n" not in str(info.value)


def karpathy_broken(change) -> dict:
    data = karpathy_coco()
    change(data)
    return data


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda d: d.pop("images"), "the file has no 'images'"),
        (lambda d: d["images"][1].update(split="holdout"), "image 1 has split 'holdout'; expected one of"),
        (lambda d: d["images"][2]["sentences"][1].update(raw=["a"]), "image 2 sentence 1 has 'raw' of type list"),
        (lambda d: d["images"][0]["sentences"][0].pop("raw"), "image 0 sentence 0 has no 'raw'"),
        (lambda d: [d["images"][3].pop(k) for k in ("cocoid", "imgid")], "image 3 has neither 'cocoid' nor 'imgid'"),
        (lambda d: d["images"][3].update(cocoid=100), "image 3 repeats image id 100"),
        (lambda d: d["images"][1].pop("filename"), "image 1 has no 'filename'"),
    ],
)
def test_malformed_karpathy(tmp_path, change, problem):
    path = write(tmp_path / "dataset_coco.json", karpathy_broken(change))
    with pytest.raises(DataError) as info:
        read_karpathy(path, tmp_path)
    assert str(info.value).startswith(f"{path}: {problem}")


def test_missing_files_are_named(tmp_path):
    missing = tmp_path / "annotations" / "captions_val2014.json"
    with pytest.raises(DataError, match="captions_val2014.json"):
        read_coco(missing, tmp_path, "val")
    captions = write(tmp_path / "c.json", coco_captions(lambda i: f"{i}.jpg"))
    with pytest.raises(DataError, match="instances_val2014.json"):
        read_coco(captions, tmp_path, "val", instances_file=tmp_path / "instances_val2014.json")
    with pytest.raises(DataError, match="dataset_flickr30k.json"):
        read_karpathy(tmp_path / "dataset_flickr30k.json", tmp_path)


def test_unknown_split_is_a_config_error(tmp_path):
    captions = write(tmp_path / "c.json", coco_captions(lambda i: f"{i}.jpg"))
    with pytest.raises(ConfigError):
        read_coco(captions, tmp_path, "restval")
    with pytest.raises(ConfigError):
        read_karpathy(captions, tmp_path, splits=("dev",))


def test_read_image_info_lists_every_image_without_captions(tmp_path):
    info = {
        "info": {},
        "licenses": [],
        "categories": [],
        "images": [
            {"id": 42, "file_name": "COCO_test2014_000000000042.jpg", "width": 640, "height": 480},
            {"id": 9, "file_name": "COCO_test2014_000000000009.jpg", "width": 200, "height": 100},
        ],
    }
    path = write(tmp_path / "image_info_test2014.json", info)
    records = read_image_info(path, tmp_path / "test2014")
    assert records == [
        Record(str(tmp_path / "test2014" / "COCO_test2014_000000000009.jpg"), 9, (), "test"),
        Record(str(tmp_path / "test2014" / "COCO_test2014_000000000042.jpg"), 42, (), "test"),
    ]
    with pytest.raises(DataError, match="has no 'annotations': it lists images without captions"):
        read_coco(path, tmp_path, "test")  # an image_info file where a captions file was expected
    info["images"][1]["id"] = 42
    with pytest.raises(DataError, match="image 1 repeats image id 42"):
        read_image_info(write(path, info), tmp_path)
    with pytest.raises(DataError, match="image 0 has no 'file_name'"):
        read_image_info(write(path, {"images": [{"id": 1}]}), tmp_path)


def test_a_sentence_that_is_no_object_shows_the_object_it_must_be(tmp_path):
    path = write(tmp_path / "split.json", karpathy_broken(lambda d: d["images"][2]["sentences"].__setitem__(1, "a")))
    with pytest.raises(DataError) as info:
        read_karpathy(path, tmp_path)
    assert str(info.value) == (
        f"{path}: image 2 sentence 1 is a JSON str, expected an object: each sentence is an object with its caption "
        'under "raw", as in {"raw": "A dog runs.", "tokens": ["a", "dog", "runs"]}'
    )


def test_the_split_file_format_the_datasets_guide_shows_is_read(tmp_path):
    guide = (Path(__file__).parents[1] / "docs" / "datasets.md").read_text()
    (example,) = re.findall(r"```json\n(.*?)```", guide, flags=re.DOTALL)
    path = write(tmp_path / "split.json", example)
    (record,) = read_karpathy(path, tmp_path / "images")
    assert record == Record(str(tmp_path / "images" / "1000268201_693b08cb0e.jpg"), 0,
                            ("A child in a pink dress.",), "train")  # fmt: skip
