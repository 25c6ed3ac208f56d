"""The cluttered scenes of the built-in dataset (ShapesSpec.scenes=cluttered): objects, captions, pixels, files."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from PIL import Image

from captioner import cli
from captioner.config import SceneKind, ShapesSpec
from captioner.data import cluttered
from captioner.data.cluttered import COLOURS, KINDS, PLURALS, make_cluttered_scene, relations
from captioner.data.cluttered_pixels import render_cluttered
from captioner.data.shapes import generate_shapes, shapes_records
from captioner.data.vocab import tokenize
from captioner.errors import ConfigError, DataError
from captioner.training.validate import validate_config
from conftest import ROOT, compose_plain

SPEC = ShapesSpec(scenes=SceneKind.cluttered)
SCENES = [(split, i, make_cluttered_scene(SPEC, split, i)) for split in ("train", "val") for i in range(150)]
NUMBER_WORDS = {"a": 1, "two": 2, "three": 3, "four": 4}
SINGULAR = {**{kind: kind for kind in KINDS}, **{plural: kind for kind, plural in PLURALS.items()}}


def names_in(caption: str) -> list[tuple[str, str]]:
    """Every (colour, kind) a caption names, a plural once per kind ("two red circles" -> red circle)."""
    words = tokenize(caption)
    return [(w, SINGULAR[n]) for w, n in zip(words, words[1:]) if w in COLOURS and n in SINGULAR]


def test_same_seed_same_scene_and_another_seed_differs():
    again = make_cluttered_scene(SPEC, "train", 3)
    assert again == SCENES[3][2]
    image = np.asarray(render_cluttered(again, SPEC, "train", 3))
    assert np.array_equal(image, np.asarray(render_cluttered(SCENES[3][2], SPEC, "train", 3)))
    assert make_cluttered_scene(replace(SPEC, seed=1), "train", 3) != again


def test_two_to_four_objects_of_six_kinds_two_sizes_and_every_background():
    counts = Counter(len(scene.shapes) for _, _, scene in SCENES)
    assert set(counts) == {2, 3, 4}
    items = [item for _, _, scene in SCENES for item in scene.shapes]
    assert {item.shape for item in items} == set(KINDS) and len(KINDS) == 6
    assert {item.size for item in items} == {"small", "large"}
    assert {item.colour for item in items} == set(COLOURS) and len(COLOURS) >= 5
    assert {scene.background.style for _, _, scene in SCENES} == {"plain", "gradient", "noisy", "striped"}


def test_boxes_inside_the_image_and_apart_by_the_margin():
    width, height = SPEC.size
    gap = round(cluttered._GAP * min(width, height))
    for _, _, scene in SCENES:
        boxes = [item.box for item in scene.shapes]
        for x0, y0, w, h in boxes:
            assert w == h and x0 >= gap and y0 >= gap and x0 + w + gap <= width and y0 + h + gap <= height
        for k, a in enumerate(boxes):
            for b in boxes[k + 1 :]:
                assert cluttered._apart(a, b, gap), (a, b)
        # large ones are larger than small ones (sides 16-20 px and 29-36 px at 120 px)
        for item in scene.shapes:
            assert (16 <= item.box[2] <= 21) if item.size == "small" else (28 <= item.box[2] <= 36)


def test_captions_name_only_present_objects_and_every_object_somewhere():
    for _, _, scene in SCENES:
        present = {(item.colour, item.shape) for item in scene.shapes}
        named = [name for caption in scene.captions for name in names_in(caption)]
        assert set(named) <= present, scene.captions
        assert set(named) == present, scene.captions  # every object's colour and kind are said
        kinds = {item.shape for item in scene.shapes}
        for caption in scene.captions:
            assert {SINGULAR[w] for w in tokenize(caption) if w in SINGULAR} <= kinds, caption
        assert len(set(scene.captions)) == 5


def test_objects_named_uniquely_and_size_words_true():
    for _, _, scene in SCENES:
        refs = [item.ref for item in scene.shapes]
        assert len(set(refs)) == len(refs)
        for item in scene.shapes:
            assert item.ref in (f"{item.colour} {item.shape}", f"{item.size} {item.colour} {item.shape}")
        twins = Counter((item.colour, item.shape) for item in scene.shapes)
        assert max(twins.values()) <= 2
        for item in scene.shapes:
            if twins[item.colour, item.shape] == 2:
                assert item.ref.startswith(item.size)


def test_relations_true_by_the_centres_with_a_margin():
    pattern = re.compile(r"(?:a|the) (.+?) (?:is |sits )?(to the left of|to the right of|above|below) (?:a|the) (.+)$")
    width, height = SPEC.size
    said = Counter()
    for _, _, scene in SCENES:
        by_ref = {item.ref: item for item in scene.shapes}
        for caption in scene.captions:
            match = pattern.search(caption)
            if match is None:
                continue
            a, relation, b = by_ref[match[1]], match[2], by_ref[match[3]]
            (ax, ay), (bx, by) = a.centre, b.centre
            expected = {
                "to the left of": bx - ax >= 0.12 * width,
                "to the right of": ax - bx >= 0.12 * width,
                "above": by - ay >= 0.12 * height,
                "below": ay - by >= 0.12 * height,
            }
            assert expected[relation], (caption, a.box, b.box)
            said[relation] += 1
    assert set(said) == {"to the left of", "to the right of", "above", "below"} and sum(said.values()) > 300


def test_relations_left_unsaid_when_the_centres_are_close():
    item = cluttered.Item("red", "circle", "small", (50, 50, 16, 16), "red circle")
    near = cluttered.Item("blue", "star", "small", (68, 60, 16, 16), "blue star")  # 18 px right, 10 px down
    assert relations(item, near, 160, 120) == []
    far = replace(near, box=(90, 80, 16, 16))  # 40 px right, 30 px down
    assert relations(item, far, 160, 120) == ["to the left of", "above"]
    assert relations(far, item, 160, 120) == ["to the right of", "below"]


def test_count_words_match_the_objects():
    for _, _, scene in SCENES:
        per_name = Counter((item.colour, item.shape) for item in scene.shapes)
        per_kind = Counter(item.shape for item in scene.shapes)
        for caption in scene.captions:
            words = tokenize(caption)
            for number, noun in zip(words, words[1:]):
                if number in NUMBER_WORDS and noun in ("shapes", "objects"):
                    assert NUMBER_WORDS[number] == len(scene.shapes), caption
                if number in NUMBER_WORDS and noun in SINGULAR:  # by kind: "two circles and a star"
                    assert NUMBER_WORDS[number] == per_kind[SINGULAR[noun]], caption
                    assert (noun in KINDS) == (number == "a"), caption
            for number, colour, noun in zip(words, words[1:], words[2:]):
                if number in NUMBER_WORDS and colour in COLOURS:  # "two red circles", "a red circle" (the only one)
                    assert NUMBER_WORDS[number] == per_name[colour, SINGULAR[noun]], caption
                    assert (noun in KINDS) == (number == "a"), caption
    said = " ".join(c for _, _, s in SCENES for c in s.captions)
    assert all(f" {n} shapes" in said or f"{n} objects" in said for n in ("two", "three", "four"))
    assert re.search(r"two \w+ (circles|squares|triangles|stars|diamonds|crosses)", said)


def test_image_size_clutter_outside_the_boxes_and_no_caption_mentions_it():
    width, height = SPEC.size
    assert (width, height) == (160, 120)
    for split, index, scene in SCENES[:30]:
        image = render_cluttered(scene, SPEC, split, index)
        assert image.size == (160, 120) and image.mode == "RGB"
        assert 3 <= len(scene.clutter) <= 6
        for mark in scene.clutter:
            x0, y0, x1, y1 = mark.extent
            assert 0 <= x0 <= x1 < width and 0 <= y0 <= y1 < height
            assert max(x1 - x0, y1 - y0) <= 15  # smaller than the smallest object (16 px)
            for box in (item.box for item in scene.shapes):
                assert cluttered._apart((x0, y0, x1 - x0 + 1, y1 - y0 + 1), box, 1)
            assert mark.grey < 150  # grey, darker than the background
        pixels = np.asarray(image).astype(int)
        for item in scene.shapes:  # the object's colour fills its centre
            cx, cy = (round(v) for v in item.centre)
            assert np.abs(pixels[cy, cx] - COLOURS[item.colour]).max() <= 1
        assert pixels.mean() > 170  # light background
        for caption in scene.captions:
            assert not {"line", "lines", "dot", "dots", "ring", "rings", "clutter"} & set(tokenize(caption))


def test_the_dataset_files_carry_the_real_size_and_read_back_with_boxes(tmp_path):
    spec = ShapesSpec(n_train=6, n_val=2, n_test=2, scenes="cluttered")
    root = generate_shapes(tmp_path / "scenes", spec)
    meta = json.loads((root / "meta.json").read_text())
    assert meta["params"] == {
        "n_train": 6,
        "n_val": 2,
        "n_test": 2,
        "width": 160,
        "height": 120,
        "seed": 0,
        "scenes": "cluttered",
    }
    assert generate_shapes(root, spec) == root  # the same parameters: a no-op
    with pytest.raises(DataError, match="width=160"):
        generate_shapes(root, replace(spec, width=200))
    instances = json.loads((root / "annotations" / "instances_train.json").read_text())
    assert all(image["width"] == 160 and image["height"] == 120 for image in instances["images"])
    assert [c["name"] for c in instances["categories"]] == list(KINDS)
    for ann in instances["annotations"]:
        x, y, w, h = ann["bbox"]
        assert x >= 0 and y >= 0 and x + w <= 160 and y + h <= 120 and ann["size"] in ("small", "large")
    records = shapes_records(root, "train")
    assert len(records) == 6
    scenes = [make_cluttered_scene(spec, "train", i) for i in range(6)]
    for record, scene in zip(records, scenes):
        assert record.captions == scene.captions
        with Image.open(record.image_path) as image:
            assert image.size == (160, 120)
        assert [b.label for b in record.boxes] == [item.shape for item in scene.shapes]
        for box, item in zip(record.boxes, scene.shapes):
            x0, y0, w, h = item.box
            assert (box.x0, box.y0, box.x1, box.y1) == pytest.approx(
                (x0 / 160, y0 / 120, (x0 + w) / 160, (y0 + h) / 120)
            )


def test_spec_checks_the_kind_and_sizes_and_simple_meta_is_unchanged():
    assert ShapesSpec(scenes="cluttered").scenes is SceneKind.cluttered
    assert ShapesSpec().size == (96, 96) and SPEC.size == (160, 120)
    with pytest.raises(ConfigError, match="scenes='busy'"):
        ShapesSpec(scenes="busy")
    with pytest.raises(ConfigError, match="width"):
        ShapesSpec(scenes="cluttered", width=8)
    assert ShapesSpec(width=200).params() == {"n_train": 3000, "n_val": 250, "n_test": 250, "image_size": 96, "seed": 0}


def test_generation_is_byte_identical(tmp_path):
    spec = ShapesSpec(n_train=3, n_val=1, n_test=1, scenes="cluttered")

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(generate_shapes(tmp_path / "a", spec)) == files(generate_shapes(tmp_path / "b", spec))


def test_captioner_shapes_writes_cluttered_scenes_and_says_how_to_train_on_them(tmp_path, capsys):
    out = tmp_path / "scenes"
    args = ["shapes", "--scenes", "cluttered", "--out", str(out), "--train", "4", "--val", "2", "--test", "2"]
    assert cli.main([*args, "--width", "200"]) == 0
    assert capsys.readouterr().err == (
        f"{out}: generated, 4 train, 2 val and 2 test images of 200x120 px cluttered scenes (seed 0); train on it "
        f"with: python train.py experiment=scenes data.source.root={out} data.source.n_train=4 data.source.n_val=2 "
        "data.source.n_test=2 data.source.width=200 data.source.height=120 data.source.seed=0\n"
    )
    with Image.open(out / "images" / "train" / "000001.png") as image:
        assert image.size == (200, 120)
    assert cli.main(args) == 2 and "(width=200 (asked 160))" in capsys.readouterr().err
    assert cli.main([*args, "--height", "8"]) == 2
    assert capsys.readouterr().err == "error: --height=8 must be in [32, 4096]\n"


def test_data_scenes_composes_the_benchmark_and_the_source_builds_its_spec(tmp_path):
    cfg = compose_plain(["experiment=scenes", "model=hard"], tmp_path)
    settings = validate_config(cfg)  # demo: false, so the scenes' own recipe passes TrainConfig's checks
    assert settings.data.image_size == 128 and cfg["data"]["source"]["root"] == f"{ROOT}/data/scenes"
    assert settings.model.attention == "hard" and settings.model.encoder.grid == 16
    assert settings.model.objective == "cross_entropy" and not settings.demo
    assert cfg["trainer"]["max_epochs"] == 20 and cfg["trainer"]["gradient_clip_val"] == 5.0
    assert compose_plain(["experiment=scenes"], tmp_path)["model"]["attention"] == "soft"
    with pytest.raises(ConfigError, match="for this dataset train with experiment=scenes"):
        validate_config(compose_plain(["data=scenes"], tmp_path))  # the demo's recipe refuses these scenes
    source = instantiate(cfg["data"]["source"])
    assert source.spec == ShapesSpec(n_train=1600, n_val=200, n_test=200, scenes="cluttered", width=160, height=120)
    max_len = settings.data.max_len
    assert all(len(tokenize(c)) <= max_len for _, _, scene in SCENES for c in scene.captions)
