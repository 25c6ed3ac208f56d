"""``captioner splits``: Karpathy's split files rebuilt from the official annotation files, read back by the
Karpathy reader as training reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioner import cli
from captioner.data.readers import read_karpathy
from captioner.data.split_files import KARPATHY_COCO_SIZES, karpathy_coco_ids, tokenize

VAL = karpathy_coco_ids("val")[:3]
TEST = karpathy_coco_ids("test")[:2]
RESTVAL = [1, 2]  # no COCO image has these ids: val2014 images in neither list
TRAIN = [3, 4, 5]


def _captions_file(path: Path, folder: str, ids: list[int]) -> None:
    """A COCO 2014 captions file: two captions per image, with punctuation and capitals."""
    images = [{"id": i, "file_name": f"COCO_{folder}_{i:012d}.jpg"} for i in ids]
    annotations = [
        {"id": 10 * i + k, "image_id": i, "caption": f"A Dog's ball, number {i}-{k}. "} for i in ids for k in range(2)
    ]
    path.write_text(json.dumps({"images": images, "annotations": annotations}))


@pytest.fixture
def coco_annotations(tmp_path: Path) -> Path:
    folder = tmp_path / "annotations"
    folder.mkdir()
    _captions_file(folder / "captions_train2014.json", "train2014", TRAIN)
    _captions_file(folder / "captions_val2014.json", "val2014", VAL + TEST + RESTVAL)
    return folder


def test_the_listed_ids_ship_with_the_package() -> None:
    val, test = karpathy_coco_ids("val"), karpathy_coco_ids("test")
    assert len(val) == len(set(val)) == KARPATHY_COCO_SIZES["val"] == 5000
    assert len(test) == len(set(test)) == KARPATHY_COCO_SIZES["test"] == 5000
    assert not set(val) & set(test)
    assert sum(KARPATHY_COCO_SIZES.values()) - KARPATHY_COCO_SIZES["val"] - KARPATHY_COCO_SIZES["test"] == 113_287


def test_tokens_are_karpathys() -> None:
    assert tokenize("A man's  Hat, on a TABLE.") == ["a", "man", "s", "hat", "on", "a", "table"]
    assert tokenize("two-tone 3D!") == ["two", "tone", "3d"]


def test_coco_split_from_the_official_files(coco_annotations: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "karpathy" / "dataset_coco.json"
    assert cli.main(["splits", "coco", "--captions-dir", str(coco_annotations), "--out", str(out), "--partial"]) == 0
    assert capsys.readouterr().err.strip() == f"wrote {out}: 10 images (train 3, restval 2, val 3, test 2)"
    data = json.loads(out.read_text())
    by_id = {image["cocoid"]: image for image in data["images"]}
    assert {i: by_id[i]["split"] for i in VAL + TEST + RESTVAL + TRAIN} == {
        **dict.fromkeys(VAL, "val"), **dict.fromkeys(TEST, "test"),
        **dict.fromkeys(RESTVAL, "restval"), **dict.fromkeys(TRAIN, "train"),
    }  # fmt: skip
    first = by_id[VAL[0]]
    assert (first["filepath"], first["filename"]) == ("val2014", f"COCO_val2014_{VAL[0]:012d}.jpg")
    assert first["sentences"][1]["raw"] == f"A Dog's ball, number {VAL[0]}-1."
    assert first["sentences"][1]["tokens"] == ["a", "dog", "s", "ball", "number", str(VAL[0]), "1"]
    assert [s["sentid"] for image in data["images"] for s in image["sentences"]] == list(range(20))
    assert [image["imgid"] for image in data["images"]] == list(range(10))

    root = tmp_path / "coco"
    train = read_karpathy(out, root, splits=("train",))
    assert [r.image_id for r in train] == sorted(RESTVAL + TRAIN)  # restval joins train
    assert train[0].image_path == str(root / "val2014" / "COCO_val2014_000000000001.jpg")
    assert train[-1].image_path == str(root / "train2014" / "COCO_train2014_000000000005.jpg")
    assert [r.image_id for r in read_karpathy(out, root, splits=("test",))] == sorted(TEST)


def test_a_partial_coco_is_refused_unless_asked(coco_annotations: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dataset_coco.json"
    assert cli.main(["splits", "coco", "--captions-dir", str(coco_annotations), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4,997 of the 5,000 images of Karpathy's val split are not in it" in err
    assert "--partial" in err and not out.exists()


def test_swapped_caption_files_are_named(coco_annotations: Path, tmp_path: Path, capsys) -> None:
    train, val = coco_annotations / "captions_train2014.json", coco_annotations / "captions_val2014.json"
    text = train.read_text()
    train.write_text(val.read_text())
    val.write_text(text)
    assert cli.main(["splits", "coco", "--captions-dir", str(coco_annotations), "--out", str(tmp_path / "o.json")]) == 2
    assert "holds 5 images of Karpathy's val/test split" in capsys.readouterr().err


def test_an_existing_split_file_is_kept(coco_annotations: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dataset_coco.json"
    out.write_text("mine")
    args = ["splits", "coco", "--captions-dir", str(coco_annotations), "--out", str(out), "--partial"]
    assert cli.main(args) == 2
    assert "already exists; pass --force" in capsys.readouterr().err and out.read_text() == "mine"
    assert cli.main([*args, "--force"]) == 2  # --force replaces only a file captioner wrote
    assert capsys.readouterr().err == (
        f"error: --out {out}: {out} was not written by captioner, and --force replaces only the files it wrote: move "
        "it, or choose another --out\n"
    )
    assert out.read_text() == "mine"
    out.unlink()
    assert cli.main(args) == 0 and cli.main([*args, "--force"]) == 0  # its own file, replaced
    assert len(json.loads(out.read_text())["images"]) == 10


def test_missing_caption_files_are_named(tmp_path: Path, capsys) -> None:
    assert cli.main(["splits", "coco", "--captions-dir", str(tmp_path), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    missing = tmp_path / "captions_train2014.json"
    assert err == f"error: {missing}: file not found (from annotations_trainval2014.zip; see docs/datasets.md)\n"


def test_flickr8k_split_from_its_official_lists(tmp_path: Path, capsys) -> None:
    text = tmp_path / "Flickr8k_text"
    text.mkdir()
    names = {"train": ["a.jpg", "b.jpg"], "dev": ["c.jpg"], "test": ["d.jpg"]}
    lines = [
        f"{name}#{k}\t{name[0].upper()} dog runs .\n" for names_ in names.values() for name in names_ for k in range(5)
    ]
    (text / "Flickr8k.token.txt").write_text("".join(lines))
    for split, files in names.items():
        (text / f"Flickr_8k.{split}Images.txt").write_text("\n".join(files) + "\n")
    out = tmp_path / "dataset_flickr8k.json"
    assert cli.main(["splits", "flickr8k", "--captions-dir", str(text), "--out", str(out)]) == 0
    assert capsys.readouterr().err.strip() == f"wrote {out}: 4 images (train 2, val 1, test 1)"
    records = {r.split: r for r in read_karpathy(out, tmp_path / "images")}
    assert records["val"].image_path == str(tmp_path / "images" / "c.jpg")
    assert records["test"].captions == ("D dog runs .",) * 5
    assert json.loads(out.read_text())["images"][3]["sentences"][0]["tokens"] == ["d", "dog", "runs"]
    (text / "Flickr_8k.testImages.txt").write_text("e.jpg\n")
    assert cli.main(["splits", "flickr8k", "--captions-dir", str(text), "--out", str(out), "--force"]) == 2
    assert "e.jpg has no caption in Flickr8k.token.txt" in capsys.readouterr().err


def test_flickr8k_s_token_file_with_a_byte_order_mark_or_not_in_utf8(tmp_path: Path, capsys) -> None:
    # Saved again by an editor on Windows: a BOM hid the first image's first caption; cp1252 was a traceback.
    text = tmp_path / "Flickr8k_text"
    text.mkdir()
    lines = "".join(f"{name}#{k}\tA caf\u00e9 {k} .\r\n" for name in ("a.jpg", "b.jpg", "c.jpg") for k in range(5))
    for split, name in zip(("train", "dev", "test"), ("a.jpg", "b.jpg", "c.jpg")):
        (text / f"Flickr_8k.{split}Images.txt").write_text(name + "\n")
    out = tmp_path / "dataset_flickr8k.json"
    (text / "Flickr8k.token.txt").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    assert cli.main(["splits", "flickr8k", "--captions-dir", str(text), "--out", str(out)]) == 0
    first = json.loads(out.read_text())["images"][0]
    assert first["filename"] == "a.jpg" and [s["raw"] for s in first["sentences"]] == [
        f"A caf\u00e9 {k} ." for k in range(5)
    ]
    capsys.readouterr()
    (text / "Flickr8k.token.txt").write_bytes(lines.encode("cp1252"))
    assert cli.main(["splits", "flickr8k", "--captions-dir", str(text), "--out", str(out), "--force"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {text / 'Flickr8k.token.txt'} line 1: not UTF-8 text (byte 0xe9): save it as UTF-8, as "
        "Flickr8k_text.zip has it"
    )
