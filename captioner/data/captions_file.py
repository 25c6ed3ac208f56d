"""A user's captions file: CSV, TSV or JSON Lines of images and their captions, read into ``Record``s.

The layouts people have (Flickr8k's token file turned into a table, Kaggle's sets, in-house sets):

- CSV or TSV with a header, one row per caption: ``image,caption`` (and an optional ``split`` column of train,
  val, test). Read with the ``csv`` module: quoted fields (a caption holding a comma or a line break), a BOM,
  CRLF line ends and blank lines read as a spreadsheet would. The delimiter comes from the suffix (``.csv``,
  ``.tsv``), else from the header (a tab in it and no comma: TSV).
- JSON Lines (``.jsonl``, ``.ndjson``, or a first line that starts with ``{``), one object per line:
  ``{"image": ..., "caption": ...}`` or ``{"image": ..., "captions": [...]}`` (both keys may be given).

Image paths are relative to ``CaptionsSpec.images`` (else the file's folder); an absolute path stays as it is.
An image's captions are all its rows' (it may have one or dozens); its id is its order of first appearance in
the file, from 0. A caption given twice for the same image is a duplicate row: kept once and counted. Every other
problem (a missing column, an image not found, an empty caption or one without words, a bad split value, a
malformed line) is collected with its line number, and all of them are raised at once (``DataProblems``).

Without a split column the images are split by a seeded hash of their path (``assign_splits``): the same
file and seed give the same split whatever the rows' order, and an image never has captions in two splits. A
training run writes the split it used (``split_document``) into its folder; ``captioner evaluate`` reads it
back (``read_split``) and so scores exactly the run's test images, with the run's image ids.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from captioner.config import CaptionsSpec
from captioner.data.readers import Record
from captioner.data.splits import SPLITS
from captioner.data.vocab import has_words
from captioner.errors import DataError, DataProblems
from captioner.fileio import read_json

SPLIT_FILE = "captions_split.json"  # in a training run's folder: the images' ids and splits (split_document)
SPLIT_FORMAT = "captioner captions split"  # what a split file says it is (its "format")
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")
DELIMITERS = {".csv": ",", ".tsv": "\t", ".tab": "\t"}  # by the file's suffix (``_delimiter``); others: the header
REMEDY = "fix the captions file"  # of each problem (training's preflight adds the guide's section)
GUIDE = "docs/datasets.md#your-own-images"
LINES_SHOWN = 5  # line numbers given for an image that several rows name
# A byte-order mark names the file's encoding, whatever CaptionsSpec.encoding says (UTF-32's before UTF-16's: its
# little-endian mark starts with UTF-16's).
BOMS = (
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
URL = re.compile(r"^[a-z][a-z0-9+.-]+:/", re.IGNORECASE)  # an image path that is a URL (a drive letter's is not)
WINDOWS = "cp1252"  # what a spreadsheet's plain 'CSV' is on Windows in the West: named when a file is not UTF-8


@dataclass
class Row:
    """One row of the file (a JSON line may give several captions): where it is and what it says."""

    line: int  # the file's line number (a quoted caption over several lines: its first)
    image: str  # the image's path as the file writes it, normalised (``./a.jpg`` is ``a.jpg``)
    captions: list[str]  # whitespace collapsed, none empty
    split: str | None  # from the split column, when the file has one


@dataclass
class Problems:
    """The problems found so far, each with its line (0: the file as a whole)."""

    file: str
    found: list[tuple[int, str]] = field(default_factory=list)

    def add(self, line: int, problem: str) -> None:
        """Keep ``problem`` of ``line``."""
        self.found.append((line, problem))

    def lines(self) -> list[str]:
        """One line each, in the file's order: ``photos/captions.csv line 4: empty caption``."""
        where = {0: self.file}
        return [
            f"{where.get(line, f'{self.file} line {line}')}: {text}"
            for line, text in sorted(self.found, key=lambda item: item[0])
        ]

    def raise_any(self) -> None:
        """Raise every problem at once as one DataProblems, if there is any."""
        if self.found:
            count = len(self.found)
            heading = f"{self.file}: {count} problem{'s' if count > 1 else ''}, listed below by line ({GUIDE})"
            raise DataProblems(heading, self.lines(), REMEDY)


@dataclass
class CaptionsSet:
    """A captions file read and split: the records of every split and what was left out or merged."""

    records: list[Record]  # every image with captions, in id order
    names: dict[int, str]  # image id -> the image's path as the file names it
    duplicates: list[int]  # the line numbers of duplicate rows (a caption its image already had)
    left_out: list[str]  # images a reused split does not list (a file changed since): in no split
    split_column: bool = False  # whether the file's own split column gave the splits (not a run's, not the hash)

    def split(self, name: str) -> list[Record]:
        """The records of split ``name``."""
        return [record for record in self.records if record.split == name]


def _words(text: str) -> str:
    """A caption with its whitespace (line breaks of a quoted field too) collapsed to single spaces."""
    return " ".join(text.split())


def _caption_problem(caption: str) -> str | None:
    """What is wrong with a caption (whitespace collapsed): empty, or no word the tokenizer reads (only
    punctuation, symbols or emoji, which would train an empty sentence); None when nothing is."""
    if not caption:
        return "empty caption"
    if not has_words(caption):
        return f"caption {caption!r} has no words (only punctuation, symbols or emoji)"
    return None


def _is_json_lines(path: Path, first: str) -> bool:
    """Whether the file is JSON Lines: by its suffix, else by its ``first`` line (an object's ``{``)."""
    return path.suffix.lower() in JSON_LINES_SUFFIXES or first.lstrip().startswith("{")


def _first_line(text: str) -> str:
    """The text's first non-blank line; empty for an empty file."""
    return next((line for line in io.StringIO(text) if line.strip()), "")


def _text(path: Path, spec: CaptionsSpec, problems: Problems) -> str | None:
    """The file's text without its BOM: in the encoding its BOM names (UTF-8, UTF-16 or UTF-32), else in
    ``spec.encoding``; None and a problem on the first line that is not in that encoding."""
    raw = path.read_bytes()
    encoding = next((name for bom, name in BOMS if raw.startswith(bom)), spec.encoding)
    try:
        return raw.decode(encoding).removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        problems.add(raw[: exc.start].decode(encoding, errors="replace").count("\n") + 1, _not_encoded(raw, exc))
        return None


def _not_encoded(raw: bytes, exc: UnicodeDecodeError) -> str:
    """The problem of a file ``raw`` that is not in the encoding it was read in (``exc``): the byte, and how to
    read the file. A UTF-8 reading that Windows-1252 (a spreadsheet's plain 'CSV' on Windows) would take shows the
    line as that encoding reads it, so that the user sees whether it is the one."""
    byte = f"byte 0x{raw[exc.start]:02x}"
    if codecs.lookup(exc.encoding).name not in ("utf-8", "utf-8-sig"):
        return f"not {exc.encoding} text ({byte}): give the file's encoding with data.source.encoding"
    try:
        raw.decode(WINDOWS)
    except UnicodeDecodeError:
        return f"not UTF-8 text ({byte}): save the file as UTF-8, or give its encoding with data.source.encoding"
    end = raw.find(b"\n", exc.start)
    line = raw[raw.rfind(b"\n", 0, exc.start) + 1 : end if end >= 0 else len(raw)].decode(WINDOWS).strip()
    return (
        f"not UTF-8 text ({byte}; as {WINDOWS} the line reads {line!r}): save the file as UTF-8 (a spreadsheet's "
        f"'CSV UTF-8'), or read it as it is with data.source.encoding={WINDOWS}"
    )


# The other names of the splits that split columns use (Hugging Face's "validation"), read as SPLITS'.
SPLIT_NAMES = {"training": "train", "validation": "val", "valid": "val", "testing": "test"}


def _split_value(value: str, line: int, problems: Problems) -> str | None:
    """A split column's value as a split name (any case; ``SPLIT_NAMES``' too), or None (a problem) when it is none
    of SPLITS."""
    name = value.strip().lower()
    name = SPLIT_NAMES.get(name, name)
    if name not in SPLITS:
        problems.add(line, f"split {value.strip()!r} is not one of {', '.join(SPLITS)}")
        return None
    return name


def _columns(header: list[str], spec: CaptionsSpec) -> dict[str, int]:
    """Each column's index by its name in ``header``; a column ``spec`` names (image, caption, split) that the
    header spells in another case (``Image``, ``CAPTION``), and no other column does, under ``spec``'s name too."""
    columns = {name: index for index, name in reversed(list(enumerate(header)))}
    for name in (spec.image_column, spec.caption_column, spec.split_column):
        folded = [
            index for index, given in enumerate(header) if name is not None and given.casefold() == name.casefold()
        ]
        if name not in columns and len(folded) == 1:
            columns[name] = folded[0]
    return columns


def _delimiter(path: Path, first: str) -> str:
    """The delimiter of a table whose first line is ``first``: its suffix's (``DELIMITERS``) when that line holds
    it; else the one of comma, tab and ``;`` that the line holds, when it holds only one (a spreadsheet where the
    decimal mark is a comma saves its 'CSV' with ``;``); else the suffix's, or a comma."""
    given = DELIMITERS.get(path.suffix.lower())
    if given is not None and given in first:
        return given
    found = [delimiter for delimiter in (",", "\t", ";") if delimiter in first]
    return found[0] if len(found) == 1 else given or ","


def _records(reader: Any, problems: Problems) -> Iterator[tuple[int, list[str]]]:
    """Each record of the CSV ``reader`` with the line it starts on. A record it cannot read (a quote left open, or
    closed before the field ends: ``strict``, where a lenient reader would take the lines after it into one
    caption) is a problem of the line it starts on, and the reading stops: what follows cannot be told apart."""
    start = 1
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            to = f" from here to line {reader.line_num}" if reader.line_num > start else ""
            problems.add(
                start,
                f"not CSV{to} ({exc}): a quote is left open or closed before its field ends; a caption that holds a "
                'quote is quoted whole, its quotes doubled: "a ""big"" dog"',
            )
            return
        line, start = start, reader.line_num + 1
        yield line, fields


def _table_rows(text: str, delimiter: str, spec: CaptionsSpec, problems: Problems) -> Iterator[Row]:
    """The rows of a CSV or TSV file's ``text`` with a header; a problem for each row that cannot be read."""
    with io.StringIO(text, newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter, strict=True)
        header: list[str] | None = None
        rows = 0
        for line, fields in _records(reader, problems):
            if not any(value.strip() for value in fields):
                continue  # a blank line
            if header is None:
                header = [name.strip() for name in fields]
                columns = _columns(header, spec)
                missing = [
                    (key, name)
                    for key, name in (("image_column", spec.image_column), ("caption_column", spec.caption_column))
                    if name not in columns
                ]
                for key, name in missing:
                    problems.add(
                        line,
                        f"the header has no {name!r} column (it has {', '.join(map(repr, header))}); name the "
                        f"file's column with data.source.{key}",
                    )
                if missing:
                    return
                continue
            if len(fields) != len(header):
                hint = "; a caption that holds the delimiter must be quoted" if len(fields) > len(header) else ""
                problems.add(line, f"{len(fields)} fields, the header has {len(header)}{hint}")
                continue
            rows += 1
            yield from _row(line, fields, columns, spec, problems)
        if header is None:
            problems.add(0, "the file is empty: it needs a header (image,caption) and a row per caption")
        elif not rows and not problems.found:  # rows that are problems say so themselves
            problems.add(0, "the file has a header and no row: it needs a row per caption")


def _row(
    line: int, fields: list[str], columns: dict[str, int], spec: CaptionsSpec, problems: Problems
) -> Iterator[Row]:
    """The Row of a table's line, or nothing and its problems."""
    image = fields[columns[spec.image_column]].strip()
    caption = _words(fields[columns[spec.caption_column]])
    split = None
    if spec.split_column in columns:
        split = _split_value(fields[columns[spec.split_column]], line, problems)
        if split is None:
            return
    if not image:
        problems.add(line, "no image path")
    if (problem := _caption_problem(caption)) is not None:
        problems.add(line, problem)
    if image and problem is None:
        yield Row(line, os.path.normpath(image), [caption], split)


def _json_rows(content: str, spec: CaptionsSpec, problems: Problems) -> Iterator[Row]:
    """The rows of a JSON Lines file's ``content``; a problem for each line that cannot be read."""
    keys = f"{spec.caption_column!r} (a string) or {spec.captions_column!r} (a list of strings)"
    with io.StringIO(content, newline=None) as handle:
        for line, text in enumerate(handle, 1):
            if not text.strip():
                continue
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as exc:
                problems.add(line, f"not valid JSON ({exc.msg}, column {exc.colno})")
                continue
            if not isinstance(entry, dict):
                problems.add(line, f"a JSON {type(entry).__name__}, expected an object")
                continue
            image = entry.get(spec.image_column)
            if not isinstance(image, str) or not image.strip():
                problems.add(line, f"no {spec.image_column!r} (the image's path, a string)")
            given = [entry[spec.caption_column]] if spec.caption_column in entry else []
            listed = entry.get(spec.captions_column, [])
            if not isinstance(listed, list):
                problems.add(line, f"{spec.captions_column!r} is a JSON {type(listed).__name__}, expected a list")
                listed = []
            if spec.caption_column not in entry and spec.captions_column not in entry:
                problems.add(line, f"no caption: give {keys}")
            captions = []
            for caption in [*given, *listed]:
                if not isinstance(caption, str):
                    problems.add(line, f"a caption of type {type(caption).__name__}, expected a string")
                elif (problem := _caption_problem(_words(caption))) is not None:
                    problems.add(line, problem)
                else:
                    captions.append(_words(caption))
            split = None
            if spec.split_column is not None and entry.get(spec.split_column) is not None:  # null: none given
                split = _split_value(str(entry[spec.split_column]), line, problems)
                if split is None:
                    continue
            if isinstance(image, str) and image.strip() and captions:
                yield Row(line, os.path.normpath(image.strip()), captions, split)


def read_rows(path: str | Path, spec: CaptionsSpec, problems: Problems) -> list[Row]:
    """The rows of a captions file in its layout (module docstring); its problems go to ``problems``."""
    path = Path(path)
    text = _text(path, spec, problems)
    if text is None:
        return []
    first = _first_line(text)
    if _is_json_lines(path, first):
        return list(_json_rows(text, spec, problems))
    return list(_table_rows(text, _delimiter(path, first), spec, problems))


def assign_splits(images: list[str], spec: CaptionsSpec) -> dict[str, str]:
    """Image -> split: ``spec.test`` images to test and ``spec.val`` to val, the first ones in the order of a
    seeded hash of their paths, the rest to train. DataError when no image is left to train on."""
    test, val = spec.held_out("test", len(images)), spec.held_out("val", len(images))
    if test + val >= len(images):
        raise DataError(
            f"data.source.val and data.source.test hold out {val} + {test} of the file's {len(images)} images, "
            "leaving none to train on; hold out fewer, or give the file a split column"
        )
    order = sorted(images, key=lambda image: hashlib.sha256(f"{spec.seed}\0{image}".encode()).hexdigest())
    return {image: "test" if k < test else "val" if k < test + val else "train" for k, image in enumerate(order)}


def read_split(path: str | Path) -> dict[str, tuple[int, str]]:
    """Image -> (id, split) of a split file a run wrote (``split_document``); DataError for a malformed one."""
    data = read_json(path, "captions split file")
    images = data.get("images") if isinstance(data, dict) and data.get("format") == SPLIT_FORMAT else None
    if not isinstance(images, list):
        raise DataError(f"{path}: not a split file written by a training run on a captions file ({SPLIT_FILE})")
    split = {}
    for index, entry in enumerate(images):
        valid = isinstance(entry, dict) and isinstance(entry.get("image"), str) and entry.get("split") in SPLITS
        if not valid or not isinstance(entry.get("id"), int) or isinstance(entry.get("id"), bool):
            raise DataError(f"{path}: image {index} is not {{'id': int, 'image': str, 'split': train/val/test}}")
        split[entry["image"]] = (entry["id"], entry["split"])
    return split


def _merge(rows: list[Row], problems: Problems) -> tuple[dict[str, list[str]], dict[str, list[int]], list[int]]:
    """The captions of each image (in order of first appearance), the lines that name it, and the lines of
    duplicate rows; an image given two splits is a problem."""
    captions: dict[str, list[str]] = {}
    lines: dict[str, list[int]] = {}
    split_of: dict[str, tuple[str | None, int]] = {}
    duplicates = []
    for row in rows:
        own = captions.setdefault(row.image, [])
        lines.setdefault(row.image, []).append(row.line)
        earlier, where = split_of.setdefault(row.image, (row.split, row.line))
        if None not in (earlier, row.split) and earlier != row.split:  # a row without one: a problem of its own
            problems.add(row.line, f"{row.image} is in split {row.split}, but in {earlier} on line {where}")
        for caption in row.captions:
            if caption in own:
                duplicates.append(row.line)
            else:
                own.append(caption)
    return captions, lines, duplicates


def _same_files(
    paths: Mapping[str, str], present: set[str], lines: Mapping[str, list[int]], problems: Problems
) -> None:
    """A problem for each image named in two ways that are the same file (``a.jpg`` and its absolute path, or a
    link to it): taken as two images, it could be in two splits, trained on and scored as unseen."""
    first: dict[str, str] = {}
    for image, path in paths.items():
        if path in present:
            same = first.setdefault(os.path.realpath(path), image)
            if same != image:
                problems.add(
                    lines[image][0],
                    f"{image} is the file {same} names (line {lines[same][0]}): name each image one way",
                )


def _url(image: str) -> str:
    """A hint for an image whose path is a URL (``https://...``, read as a path: ``https:/...``), else ""."""
    if not URL.match(image):
        return ""
    return (
        "; it is a URL: the images are read from files, so download them first (img2dataset writes them as "
        "WebDataset shards, which data=webdataset reads)"
    )


def _found_as(image: str, root: Path, listed: dict[str, dict[str, list[str]]]) -> str:
    """A hint for an image not found that is there once its backslashes are slashes or its file name is spelt in
    the disk's case (a file written on Windows, whose paths take backslashes and ignore case): here a backslash is
    part of a file's name and case counts, so neither is guessed. ``listed``: each folder's names by their
    case-folded spelling, filled as folders are looked at."""
    slashed = image.replace("\\", "/")
    folder, name = os.path.split(slashed)
    if slashed != image and os.path.isfile(os.path.join(root, slashed)):
        found = slashed
    else:
        where = os.path.join(root, folder)
        if where not in listed:
            names = os.listdir(where) if os.path.isdir(where) else []
            listed[where] = {}
            for entry in names:
                listed[where].setdefault(entry.casefold(), []).append(entry)
        same = listed[where].get(name.casefold(), [])
        if len(same) != 1 or not os.path.isfile(os.path.join(where, same[0])):
            return ""
        found = os.path.join(folder, same[0])
    return (
        f"; {found} is there: write the file's paths as they are on disk (here case counts and a backslash is part "
        "of a file's name)"
    )


def shown_lines(lines: list[int]) -> str:
    """``(lines 4, 9)`` or ``(lines 4, 9, 11, 20, 31 and 3 more)``: the rows that name an image."""
    shown = ", ".join(str(line) for line in lines[:LINES_SHOWN])
    more = f" and {len(lines) - LINES_SHOWN} more" if len(lines) > LINES_SHOWN else ""
    return f"line{'s' if len(lines) > 1 else ''} {shown}{more}"


def read_captions(
    file: str | Path, spec: CaptionsSpec, reused: Mapping[str, tuple[int, str]] | None = None
) -> CaptionsSet:
    """Every image of the captions ``file`` with its captions, id and split (the module docstring says how);
    with ``reused`` (``read_split`` of a run's split file) the ids and splits are that run's. Raises DataProblems
    with every problem of the file at once."""
    from captioner.data.images import images_present, none_found  # imports torch: not when train.py checks its config

    problems = Problems(str(file))
    rows = read_rows(file, spec, problems)
    captions, lines, duplicates = _merge(rows, problems)
    root = Path(spec.images) if spec.images is not None else Path(file).parent
    paths = {image: os.path.join(root, image) for image in captions}  # "./a.jpg" for a file in the working folder
    present = set(images_present(list(paths.values())))
    _same_files(paths, present, lines, problems)
    listed: dict[str, dict[str, list[str]]] = {}
    if paths and not present:  # the images are elsewhere: one line, not one per image
        where = f"data.source.images={root}" if spec.images is not None else f"the file's folder, {root}"
        folder = (
            f": the paths are relative to {where}; give the folder they are relative to with data.source.images=DIR"
        )
        problems.add(0, none_found("its images", list(paths.values())) + (_url(next(iter(paths))) or folder))
    for image, path in paths.items() if present else ():
        if path not in present:
            also = f" (named on {shown_lines(lines[image])})" if len(lines[image]) > 1 else ""
            hint = _url(image) or _found_as(image, root, listed)
            problems.add(lines[image][0], f"image not found: {path}{also}{hint}")
    left_out, given = [], []
    if reused is not None:
        absent = [image for image in reused if image not in captions]
        if absent:
            problems.add(
                0,
                f"{len(absent):,} images of the run's split are not in the file (e.g. {absent[0]}): give the "
                "captions file that run read",
            )
        left_out = [image for image in captions if image not in reused]
        assigned = {image: reused[image] for image in captions if image in reused}
    else:
        splits = {row.image: row.split for row in rows}
        given = [row.line for row in rows if row.split is not None]
        for row in rows if given else []:
            if row.split is None:
                problems.add(row.line, f"no {spec.split_column!r}, which line {given[0]} gives")
        if captions and not given:
            try:
                splits = assign_splits(list(captions), spec)
            except DataError as exc:
                problems.add(0, str(exc))
        assigned = {image: (index, splits.get(image, "train")) for index, image in enumerate(captions)}
    problems.raise_any()
    records = [
        Record(paths[image], image_id, tuple(captions[image]), split)
        for image, (image_id, split) in sorted(assigned.items(), key=lambda item: item[1][0])
    ]
    names = {image_id: image for image, (image_id, _) in assigned.items()}
    return CaptionsSet(records, names, duplicates, left_out, split_column=reused is None and bool(given))


def split_document(file: str | Path, spec: CaptionsSpec, found: CaptionsSet) -> dict[str, Any]:
    """What a training run writes as its ``SPLIT_FILE``: every image's id and split (the image as the file names
    it), and the file and settings they came from."""
    images = [
        {"id": record.image_id, "image": found.names[record.image_id], "split": record.split}
        for record in found.records
    ]
    sizes = {split: len(found.split(split)) for split in SPLITS}
    return {
        "format": SPLIT_FORMAT,
        "captions": str(Path(file).absolute()),
        "settings": asdict(spec),
        "sizes": sizes,
        "duplicate_rows": len(found.duplicates),
        "images": images,
    }
