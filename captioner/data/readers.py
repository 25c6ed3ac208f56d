"""Annotation readers: COCO caption/instance files and Karpathy split files, all into ``Record``s.

Every reader checks the file's structure before using it, so a malformed file fails with one
DataError that names the file and the problem (``<file>: annotation 3 has no 'caption'``). A caption without a
word (empty, or only punctuation or symbols) is left out, counted in one warning (``_worded``): a dataset's own
files are not the user's to fix, and such a caption would train, and score against, an empty sentence.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from pycocotools.coco import COCO

from captioner.data.splits import SPLITS
from captioner.data.vocab import has_words
from captioner.errors import DataError, check_choice
from captioner.fileio import read_json

log = logging.getLogger(__name__)

KARPATHY_SPLITS = ("train", "restval", "val", "test")
# What each of an image's ``sentences`` is in a Karpathy split file (only ``raw`` is read; ``tokens`` is Karpathy's).
SENTENCE_FORMAT = (
    'each sentence is an object with its caption under "raw", as in {"raw": "A dog runs.", "tokens": ["a", "dog", '
    '"runs"]}'
)


@dataclass(frozen=True)
class Box:
    """An object's bounding box as fractions of the image width/height, in [0, 1]."""

    label: str
    x0: float
    y0: float
    x1: float
    y1: float


@dataclass(frozen=True)
class Record:
    """One image with its raw reference captions (and object boxes when the dataset has them)."""

    image_path: str
    image_id: int
    captions: tuple[str, ...]
    split: str
    boxes: tuple[Box, ...] = ()


def read_coco(
    captions_file: str | Path, image_dir: str | Path, split: str, instances_file: str | Path | None = None
) -> list[Record]:
    """Records of a COCO captions file (2014 or 2017 format), sorted by image id.

    Images without captions are left out (and captions without a word: ``_worded``). With ``instances_file``
    each record gets the boxes of its objects, labelled with the category name. Raises DataError for a missing
    or malformed file (an image id listed twice among them: pycocotools would give the id the last entry's file
    and the first's captions).
    """
    check_choice("split", split, SPLITS)
    captions = _coco_index(captions_file, "COCO captions file", _check_captions)
    boxes = _read_boxes(instances_file) if instances_file is not None else {}
    records = []
    for image_id in sorted(captions.imgs):
        anns = captions.imgToAnns.get(image_id, [])
        if anns:
            path = Path(image_dir) / captions.imgs[image_id]["file_name"]
            texts = tuple(ann["caption"].strip() for ann in anns)
            records.append(Record(str(path), image_id, texts, split, boxes.get(image_id, ())))
    return _worded(records, captions_file)


def read_image_info(info_file: str | Path, image_dir: str | Path) -> list[Record]:
    """Records without captions of every image a COCO image list names, sorted by image id.

    The file is an ``image_info`` file as COCO ships for its test images (``image_info_test2014.json``:
    ``images`` with ``id`` and ``file_name``, no annotations); a captions file also works (its captions are
    not read). Raises DataError for a missing or malformed file, or an image id listed twice.
    """
    data = _read_object(info_file, "COCO image list")
    _check_images(data, info_file, {"file_name": str})
    records: dict[int, Record] = {}
    for image in data["images"]:
        records[image["id"]] = Record(str(Path(image_dir) / image["file_name"]), image["id"], (), "test")
    return [record for _, record in sorted(records.items())]


def read_karpathy(
    split_file: str | Path, image_root: str | Path, splits: Sequence[str] = SPLITS, restval_as_train: bool = True
) -> list[Record]:
    """Records of a Karpathy split file (``dataset_coco.json``, ``dataset_flickr8k.json``, ...).

    The image id is ``cocoid`` when present, else ``imgid``; the path is
    ``image_root/filepath/filename`` (COCO) or ``image_root/filename`` (Flickr). ``restval`` images
    count as ``train`` unless ``restval_as_train`` is False, in which case they are left out.
    Records are sorted by image id; captions without a word are left out (``_worded``). Raises DataError for a
    missing or malformed file.
    """
    for split in splits:
        check_choice("splits", split, SPLITS)
    data = _read_object(split_file, "Karpathy split file")
    entries = _field(data, "images", list, "the file", split_file)
    records: dict[int, Record] = {}
    for index, entry in enumerate(entries):
        record = _karpathy_record(entry, f"image {index}", split_file, Path(image_root), restval_as_train)
        if record.image_id in records:
            _fail(split_file, f"image {index} repeats image id {record.image_id}")
        records[record.image_id] = record
    return _worded([r for _, r in sorted(records.items()) if r.split in splits], split_file)


def _worded(records: list[Record], file: str | Path) -> list[Record]:
    """``records`` without their captions that have no word (``has_words``: empty, or only punctuation or
    symbols), and without the images left with no caption; one warning counts what was left out."""
    kept, dropped, emptied = [], [], 0
    for record in records:
        worded = [has_words(caption) for caption in record.captions]
        captions = tuple(caption for caption, word in zip(record.captions, worded) if word)
        dropped += [(record.image_id, caption) for caption, word in zip(record.captions, worded) if not word]
        if captions:
            kept.append(record if len(captions) == len(record.captions) else replace(record, captions=captions))
        elif record.captions:
            emptied += 1
    if dropped:
        shown = ", ".join(f"image {image_id} {caption!r}" for image_id, caption in dropped[:5])
        more = f" and {len(dropped) - 5:,} more" if len(dropped) > 5 else ""
        images = f"; {_count(emptied, 'image')} left with none, left out too" if emptied else ""
        log.warning(
            "%s: %s without a word (empty, or only punctuation or symbols) left out: %s%s%s",
            file, _count(len(dropped), "caption"), shown, more, images,
        )  # fmt: skip
    return kept


def _karpathy_record(entry: Any, where: str, file: str | Path, image_root: Path, restval_as_train: bool) -> Record:
    """One Karpathy ``images[]`` entry as a Record (split ``restval`` when not merged into train)."""
    split = _field(entry, "split", str, where, file)
    if split not in KARPATHY_SPLITS:
        _fail(file, f"{where} has split {split!r}; expected one of {', '.join(KARPATHY_SPLITS)}")
    if split == "restval" and restval_as_train:
        split = "train"
    key = "cocoid" if "cocoid" in entry else "imgid"
    if key not in entry:
        _fail(file, f"{where} has neither 'cocoid' nor 'imgid'")
    image_id = _field(entry, key, int, where, file)
    folder = image_root / _field(entry, "filepath", str, where, file) if "filepath" in entry else image_root
    path = folder / _field(entry, "filename", str, where, file)
    sentences = _field(entry, "sentences", list, where, file)
    captions = tuple(_caption(sentence, f"{where} sentence {k}", file) for k, sentence in enumerate(sentences))
    return Record(str(path), image_id, captions, split)


def _caption(sentence: Any, where: str, file: str | Path) -> str:
    """The caption of a Karpathy ``sentences[]`` entry (its ``raw``); DataError showing the object it must be."""
    try:
        return _field(sentence, "raw", str, where, file).strip()
    except DataError as exc:
        raise DataError(f"{exc}: {SENTENCE_FORMAT}") from None


def _read_boxes(instances_file: str | Path) -> dict[int, tuple[Box, ...]]:
    """Boxes per image id from a COCO instances file, as fractions of the image size."""
    coco = _coco_index(instances_file, "COCO instances file", _check_instances)
    boxes = {}
    for image_id, anns in coco.imgToAnns.items():
        image = coco.imgs[image_id]
        boxes[image_id] = tuple(
            coco_box(ann["bbox"], coco.cats[ann["category_id"]]["name"], image["width"], image["height"])
            for ann in anns
        )
    return boxes


def coco_box(bbox: Sequence[float], label: str, width: float, height: float) -> Box:
    """A COCO ``[x, y, w, h]`` pixel box as a Box of fractions clamped to [0, 1]."""
    x, y, w, h = bbox

    def clamp(value: float) -> float:
        return min(1.0, max(0.0, value))

    return Box(label, clamp(x / width), clamp(y / height), clamp((x + w) / width), clamp((y + h) / height))


def _count(n: int, noun: str) -> str:
    """``1 caption``, ``3 captions``, ``1,200 captions``."""
    return f"{n:,} {noun}{'s' if n != 1 else ''}"


def _coco_index(path: str | Path, what: str, check: Callable[[dict, str | Path], None]) -> COCO:
    """A pycocotools index over a checked COCO file, without pycocotools' prints."""
    data = _read_object(path, what)
    check(data, path)
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def _check_captions(data: dict, path: str | Path) -> None:
    """Raise DataError unless ``data`` has the structure of a COCO captions file."""
    image_ids = _check_images(data, path, {"file_name": str})
    if "annotations" not in data:
        _fail(
            path,
            "the file has no 'annotations': it lists images without captions (an image_info file, "
            "as COCO ships for its test images), so there is nothing to score against; write its "
            "results file for the evaluation server with --image-info FILE --images DIR --out DIR",
        )
    for index, ann in enumerate(_field(data, "annotations", list, "the file", path)):
        where = f"annotation {index}"
        _field(ann, "id", int, where, path)
        _field(ann, "caption", str, where, path)
        _check_reference(ann, "image_id", image_ids, where, path)


def _check_instances(data: dict, path: str | Path) -> None:
    """Raise DataError unless ``data`` has the structure of a COCO instances file."""
    image_ids = _check_images(data, path, {"width": (int, float), "height": (int, float)})
    category_ids = set()
    for index, category in enumerate(_field(data, "categories", list, "the file", path)):
        category_ids.add(_field(category, "id", int, f"category {index}", path))
        _field(category, "name", str, f"category {index}", path)
    for index, ann in enumerate(_field(data, "annotations", list, "the file", path)):
        where = f"annotation {index}"
        _field(ann, "id", int, where, path)
        _check_reference(ann, "image_id", image_ids, where, path)
        _check_reference(ann, "category_id", category_ids, where, path)
        bbox = _field(ann, "bbox", list, where, path)
        if len(bbox) != 4 or not all(_is_number(v) for v in bbox) or bbox[2] < 0 or bbox[3] < 0:
            _fail(path, f"{where} has 'bbox' {bbox!r}; expected [x, y, width, height], sizes >= 0")


def _check_images(data: dict, path: str | Path, fields: dict[str, type | tuple[type, ...]]) -> set[int]:
    """Check ``images[]`` (an int ``id``, each once, and the typed ``fields``, numbers positive); return the ids."""
    ids = set()
    for index, image in enumerate(_field(data, "images", list, "the file", path)):
        where = f"image {index}"
        image_id = _field(image, "id", int, where, path)
        if image_id in ids:
            _fail(path, f"{where} repeats image id {image_id}")
        ids.add(image_id)
        for key, kind in fields.items():
            value = _field(image, key, kind, where, path)
            if _is_number(value) and value <= 0:
                _fail(path, f"{where} has {key!r} {value!r}; expected a positive number")
    return ids


def _check_reference(entry: dict, key: str, known: set[int], where: str, path: str | Path) -> None:
    """Raise DataError unless ``entry[key]`` is one of the ``known`` ids."""
    value = _field(entry, key, int, where, path)
    if value not in known:
        _fail(path, f"{where} has {key!r} {value}, which no entry of the file defines")


def _read_object(path: str | Path, what: str) -> dict:
    """Read a JSON file whose top level must be an object."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        _fail(path, f"the top level is a JSON {type(data).__name__}, expected an object")
    return data


def _field(entry: Any, key: str, kind: type | tuple[type, ...], where: str, path: str | Path) -> Any:
    """``entry[key]``, raising DataError naming the file when it is absent or of the wrong type."""
    if not isinstance(entry, dict):
        _fail(path, f"{where} is a JSON {type(entry).__name__}, expected an object")
    if key not in entry:
        _fail(path, f"{where} has no {key!r}")
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        _fail(path, f"{where} has {key!r} of type {type(value).__name__}, expected {names}")
    return value


def _is_number(value: Any) -> bool:
    """True for an int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(path: str | Path, problem: str) -> NoReturn:
    """Raise the one-line DataError ``<path>: <problem>``."""
    raise DataError(f"{path}: {problem}")
