"""Split files in Karpathy's format, written from files users can still download.

Karpathy's ``caption_datasets.zip`` is no longer served. Its COCO split is rebuilt exactly from the official
COCO 2014 caption files and the ids of its 5,000 validation and 5,000 test images (all from val2014, shipped
in ``captioner/data/karpathy_coco/``): train is every train2014 image plus the val2014 images in neither list
(``restval``), 113,287 images. Flickr8k's split comes from its official lists (``Flickr8k_text.zip``).
Sentences are tokenised as Karpathy's files are: lower case, punctuation dropped. The files these functions
write are read by ``readers.read_karpathy`` (``conf/data/coco_karpathy.yaml``, ``conf/data/flickr8k.yaml``).
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from captioner.data.readers import read_coco
from captioner.errors import DataError
from captioner.fileio import write_json

COCO_FOLDERS = ("train2014", "val2014")  # the image folders under the image root, as the split file's filepath
COCO_CAPTIONS = {folder: f"captions_{folder}.json" for folder in COCO_FOLDERS}  # the official caption files
KARPATHY_COCO_SIZES = {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000}  # images per split
FLICKR8K_CAPTIONS = "Flickr8k.token.txt"  # in Flickr8k_text.zip: "<file>#<n>\t<caption>" per line
FLICKR8K_LISTS = {
    "train": "Flickr_8k.trainImages.txt",
    "val": "Flickr_8k.devImages.txt",
    "test": "Flickr_8k.testImages.txt",
}
_PUNCTUATION = str.maketrans(string.punctuation, " " * len(string.punctuation))


def tokenize(sentence: str) -> list[str]:
    """Karpathy's tokens of a caption: lower case, punctuation dropped (``"A man's hat."`` -> a, man, s, hat)."""
    return sentence.lower().translate(_PUNCTUATION).split()


def karpathy_coco_ids(split: str) -> list[int]:
    """The COCO image ids of Karpathy's ``val`` or ``test`` split (5,000 each, all in val2014)."""
    text = resources.files("captioner.data").joinpath("karpathy_coco", f"{split}_ids.txt").read_text()
    return [int(line) for line in text.split()]


def _entry(image_id: int, folder: str, file_name: str, split: str, captions: Iterable[str], ids: dict) -> dict:
    """One ``images[]`` entry of a Karpathy split file; ``ids`` counts images and sentences so far."""
    sentences = []
    for raw in captions:
        sentences.append({"tokens": tokenize(raw), "raw": raw, "imgid": ids["image"], "sentid": ids["sentence"]})
        ids["sentence"] += 1
    entry = {
        "filepath": folder,
        "filename": file_name,
        "imgid": ids["image"],
        "split": split,
        "sentids": [s["sentid"] for s in sentences],
        "sentences": sentences,
        "cocoid": image_id,
    }
    ids["image"] += 1
    return entry


def coco_split(captions_dir: str | Path, partial: bool = False) -> dict[str, Any]:
    """Karpathy's COCO split file (as a dict) from ``captions_train2014.json`` and ``captions_val2014.json``.

    val and test are the listed val2014 images, restval the rest of val2014, train every train2014 image,
    each sorted by image id. DataError for a missing or malformed file, and, unless ``partial`` (a subset of
    COCO), for listed ids that the val2014 file lacks or that train2014 holds (the files swapped).
    """
    captions_dir = Path(captions_dir)
    records = {}
    for folder in COCO_FOLDERS:
        path = captions_dir / COCO_CAPTIONS[folder]
        if not path.is_file():
            raise DataError(f"{path}: file not found (from annotations_trainval2014.zip; see docs/datasets.md)")
        records[folder] = read_coco(path, captions_dir, "train" if folder == "train2014" else "val")
    listed = {split: karpathy_coco_ids(split) for split in ("val", "test")}
    in_train = {r.image_id for r in records["train2014"]} & {i for ids in listed.values() for i in ids}
    if in_train:
        raise DataError(
            f"{captions_dir / COCO_CAPTIONS['train2014']} holds {len(in_train)} images of Karpathy's val/test "
            f"split (e.g. id {min(in_train)}), which all come from val2014: are the two files swapped?"
        )
    available = {r.image_id for r in records["val2014"]}
    for split, ids in listed.items():
        missing = [i for i in ids if i not in available]
        if missing and not partial:
            raise DataError(
                f"{captions_dir / COCO_CAPTIONS['val2014']}: {len(missing):,} of the {len(ids):,} images of "
                f"Karpathy's {split} split are not in it (e.g. id {missing[0]}); give the official COCO 2014 "
                "caption files, or --partial to write the split of the images present"
            )
    split_of = {image_id: split for split, ids in listed.items() for image_id in ids}
    ids = {"image": 0, "sentence": 0}
    images = []
    for folder in ("val2014", "train2014"):
        for record in records[folder]:
            split = "train" if folder == "train2014" else split_of.get(record.image_id, "restval")
            images.append(_entry(record.image_id, folder, Path(record.image_path).name, split, record.captions, ids))
    return {"images": images, "dataset": "coco"}


def _read_lines(path: Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file (a byte-order mark dropped), stripped; DataError when it is missing
    or not UTF-8."""
    if not path.is_file():
        raise DataError(f"{path}: file not found (from Flickr8k_text.zip; see docs/datasets.md)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(
            f"{path} line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}): save it as UTF-8, as "
            "Flickr8k_text.zip has it"
        ) from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def flickr8k_split(text_dir: str | Path) -> dict[str, Any]:
    """Flickr8k's official split (``Flickr_8k.{train,dev,test}Images.txt``, dev as ``val``) with the captions of
    ``Flickr8k.token.txt``, in Karpathy's format; images in list order, train then val then test.

    DataError for a missing file, a malformed caption line, an image listed twice or one without captions.
    """
    text_dir = Path(text_dir)
    captions: dict[str, list[str]] = {}
    token_file = text_dir / FLICKR8K_CAPTIONS
    for number, line in enumerate(_read_lines(token_file), 1):
        key, tab, raw = line.partition("\t")
        if not tab or "#" not in key:
            raise DataError(f"{token_file}: line {number} is not '<image>#<n><TAB><caption>'")
        captions.setdefault(key.rsplit("#", 1)[0], []).append(raw.strip())
    ids = {"image": 0, "sentence": 0}
    images, seen = [], set()
    for split, name in FLICKR8K_LISTS.items():
        for file_name in _read_lines(text_dir / name):
            if file_name in seen:
                raise DataError(f"{text_dir / name}: {file_name} is listed twice")
            if file_name not in captions:
                raise DataError(f"{text_dir / name}: {file_name} has no caption in {FLICKR8K_CAPTIONS}")
            seen.add(file_name)
            entry = _entry(ids["image"], "", file_name, split, captions[file_name], ids)
            del entry["filepath"], entry["cocoid"]
            images.append(entry)
    return {"images": images, "dataset": "flickr8k"}


def split_sizes(split_file: Mapping[str, Any]) -> dict[str, int]:
    """Images per split of a Karpathy split file (as a dict), in the order train, restval, val, test."""
    sizes = dict.fromkeys(KARPATHY_COCO_SIZES, 0)
    for image in split_file["images"]:
        sizes[image["split"]] += 1
    return {split: count for split, count in sizes.items() if count or split != "restval"}


def write_split(split_file: Mapping[str, Any], out: str | Path) -> None:
    """Write a split file atomically, as compact JSON (the COCO one holds 616,767 sentences)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json(out, split_file, indent=None)
