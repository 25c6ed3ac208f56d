"""Built-in shapes dataset: files, determinism, captions true to the scene, no overwriting, resuming."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.config import ShapesSpec
from captioner.data import scenes, shapes
from captioner.data.readers import read_karpathy
from captioner.data.scenes import CELLS, COLOURS, SHAPES, make_scene
from captioner.data.shapes import generate_shapes, shapes_records
from captioner.errors import ConfigError, DataError
from conftest import snapshot

SMALL = ShapesSpec(n_train=10, n_val=4, n_test=3, image_size=48)
OBJECT = re.compile(rf"\b({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})\b")
RELATION = re.compile(r"\b(\w+ \w+) (?:is |sits )?(to the left of|to the right of|above|below) (?:a|the) (\w+ \w+)")
POSITION = re.compile(r"\b(top left|top right|bottom left|bottom right|top|bottom|left|right|center|middle)\b")


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("shapes") / "shapes", SMALL)


def test_layout_and_meta(small):
    files = snapshot(small)
    expected = {"meta.json", "dataset_shapes.json"} | {
        f"annotations/{kind}_{split}.json" for kind in ("captions", "instances") for split in ("train", "val", "test")
    }
    assert expected <= set(files)
    assert len([f for f in files if f.startswith("images/train/") and f.endswith(".png")]) == 10
    assert len([f for f in files if f.startswith("images/test/")]) == 3
    assert not any(Path(f).name.startswith(".") for f in files)  # no marker or temporary file left
    meta = json.loads((small / "meta.json").read_text())
    assert meta == {
        "format": "captioner-shapes",
        "version": 1,
        "params": {"n_train": 10, "n_val": 4, "n_test": 3, "image_size": 48, "seed": 0},
    }
    with Image.open(small / "images" / "val" / "000011.png") as image:
        assert image.size == (48, 48) and image.mode == "RGB"


def test_same_seed_gives_identical_files_and_another_seed_differs(tmp_path, small):
    again = snapshot(generate_shapes(tmp_path / "again", SMALL))
    assert again == snapshot(small)
    other = snapshot(generate_shapes(tmp_path / "other", replace(SMALL, seed=1)))
    assert set(other) == set(again)
    assert other["images/train/000001.png"] != again["images/train/000001.png"]
    assert other["annotations/captions_train.json"] != again["annotations/captions_train.json"]


def instances_by_image(root: Path, split: str) -> dict[int, list[dict]]:
    data = json.loads((root / "annotations" / f"instances_{split}.json").read_text())
    names = {c["id"]: c["name"] for c in data["categories"]}
    assert sorted(names.values()) == ["circle", "square", "triangle"]
    objects: dict[int, list[dict]] = {}
    for ann in data["annotations"]:
        name = f"{ann['colour']} {names[ann['category_id']]}"
        objects.setdefault(ann["image_id"], []).append({**ann, "name": name})
    return objects


def test_captions_name_exactly_the_shapes_present(small):
    for split in ("train", "val", "test"):
        objects = instances_by_image(small, split)
        for record in shapes_records(small, split):
            present = {o["name"] for o in objects[record.image_id]}
            mentioned = [{" ".join(m) for m in OBJECT.findall(c)} for c in record.captions]
            assert all(m and m <= present for m in mentioned), (record.captions, present)
            assert set().union(*mentioned) == present  # every shape is named by some caption
            assert len(set(record.captions)) == 5


def cell_of(shape: scenes.Shape) -> str:
    return CELLS[shape.cell]


def check_caption(caption: str, scene: scenes.Scene) -> None:
    """Positions and relations a caption states hold in the scene."""
    by_name = {s.name: s for s in scene.shapes}
    words = caption.split()
    assert 4 <= len(words) <= 16, caption
    relation = RELATION.search(caption)
    if relation:
        a, rel, b = by_name[relation.group(1)], relation.group(2), by_name[relation.group(3)]
        (row_a, col_a), (row_b, col_b) = divmod(a.cell, 3), divmod(b.cell, 3)
        holds = {
            "to the left of": col_a < col_b,
            "to the right of": col_a > col_b,
            "above": row_a < row_b,
            "below": row_a > row_b,
        }[rel]
        assert holds, (caption, a, b)
        return
    named = [by_name[" ".join(m)] for m in OBJECT.findall(caption)]
    places = [p.replace("middle", "center") for p in POSITION.findall(caption)]
    if places:  # "a red circle in the top left and a blue square at the bottom": in the same order
        assert places == [cell_of(s) for s in named], (caption, scene.shapes)


def test_positions_and_relations_in_captions_are_true():
    spec = ShapesSpec(n_train=300, image_size=96, seed=3)
    counts = {1: 0, 2: 0, 3: 0}
    for index in range(300):
        scene = make_scene(spec, "train", index)
        counts[len(scene.shapes)] += 1
        for caption in scene.captions:
            check_caption(caption, scene)
        if len(scene.shapes) > 1:  # multi-object scenes say which shape is where
            assert sum(bool(RELATION.search(c) or POSITION.search(c)) for c in scene.captions) >= 3
    assert min(counts.values()) > 30


def test_shapes_sit_in_distinct_cells_with_their_colour(small):
    cell = 48 / 3
    for split in ("train", "val"):
        objects = instances_by_image(small, split)
        for image_id, anns in objects.items():
            with Image.open(small / "images" / split / f"{image_id:06d}.png") as image:
                pixels = np.asarray(image).astype(int)
            cells = set()
            for ann in anns:
                x, y, w, h = ann["bbox"]
                row, col = int((y + h / 2) // cell), int((x + w / 2) // cell)
                cells.add((row, col))
                assert col * cell <= x and x + w <= (col + 1) * cell + 1e-9
                assert row * cell <= y and y + h <= (row + 1) * cell + 1e-9
                assert 0.55 * cell - 1 <= w <= 0.8 * cell + 1 and w == h
                centre = pixels[int(y + h / 2), int(x + w / 2)]
                assert np.abs(centre - np.array(COLOURS[ann["colour"]])).max() <= scenes._NOISE
            assert len(cells) == len(anns) and 1 <= len(anns) <= 3
            assert pixels[0, 0].min() > 200 or any(a["bbox"][0] < 1 for a in anns)  # light background


def test_records_have_boxes_and_match_the_karpathy_file(small):
    records = shapes_records(small, "val")
    assert [r.image_id for r in records] == [11, 12, 13, 14]
    assert all(1 <= len(r.boxes) <= 3 and {b.label for b in r.boxes} <= set(SHAPES) for r in records)
    assert all(0 <= b.x0 < b.x1 <= 1 and 0 <= b.y0 < b.y1 <= 1 for r in records for b in r.boxes)
    karpathy = read_karpathy(small / "dataset_shapes.json", small, splits=("val",))
    assert [(r.image_id, r.image_path, r.captions) for r in karpathy] == [
        (r.image_id, r.image_path, r.captions) for r in records
    ]
    assert all(Path(r.image_path).is_file() for r in records)


def test_generating_again_is_a_no_op(small):
    before = {p: p.stat().st_mtime_ns for p in small.rglob("*") if p.is_file()}
    assert generate_shapes(small, SMALL) == small
    assert {p: p.stat().st_mtime_ns for p in small.rglob("*") if p.is_file()} == before


def test_different_parameters_are_refused_and_nothing_is_touched(small):
    before = snapshot(small)
    with pytest.raises(DataError, match=r"different parameters \(seed=0 \(asked 5\)\)"):
        generate_shapes(small, replace(SMALL, seed=5))
    with pytest.raises(DataError, match="n_train=10 \\(asked 11\\)"):
        generate_shapes(small, replace(SMALL, n_train=11))
    assert snapshot(small) == before


def test_a_foreign_non_empty_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        generate_shapes(tmp_path, SMALL)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_shapes_records_needs_a_generated_dataset(tmp_path):
    with pytest.raises(DataError, match="generate_shapes"):
        shapes_records(tmp_path, "train")


def test_bad_parameters_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="n_train=0 must be >= 1"):
        ShapesSpec(n_train=0)
    with pytest.raises(ConfigError, match=r"image_size=12 must be in \[32, 4096\]"):
        ShapesSpec(image_size=12)


def test_interrupted_generation_resumes_with_only_missing_images(tmp_path, monkeypatch, small):
    render = shapes.render

    def failing(scene, spec, split, index):
        if split == "train" and index == 6:
            raise KeyboardInterrupt
        return render(scene, spec, split, index)

    monkeypatch.setattr(shapes, "render", failing)
    root = tmp_path / "shapes"
    with pytest.raises(KeyboardInterrupt):
        generate_shapes(root, SMALL)
    assert not (root / "meta.json").exists() and (root / shapes.PARTIAL).is_file()
    written = sorted((root / "images" / "train").glob("*.png"))
    assert 0 < len(written) < 10
    with pytest.raises(DataError, match="unfinished shapes dataset made with different parameters"):
        generate_shapes(root, replace(SMALL, seed=1))
    monkeypatch.setattr(shapes, "render", render)
    old = 1_000_000_000_000_000_000
    for path in written:
        os.utime(path, ns=(old, old))
    generate_shapes(root, SMALL)
    assert all(path.stat().st_mtime_ns == old for path in written)  # existing images not rewritten
    assert snapshot(root) == snapshot(small)


def test_copy_without_meta_but_with_marker_is_completed(tmp_path, small):
    root = tmp_path / "copy"
    shutil.copytree(small, root)
    (root / "meta.json").rename(root / shapes.PARTIAL)
    (root / "images" / "test" / "000017.png").unlink()
    (root / "images" / "test" / ".000017.png.abc.tmp").write_bytes(b"half")
    generate_shapes(root, SMALL)
    assert snapshot(root) == snapshot(small)
