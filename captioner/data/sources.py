"""Dataset sources: where each split's records come from (COCO files, a Karpathy split file, built-in shapes, a
user's captions file).

A source is a small object with ``paths()`` (every file and folder its config names, each described once:
``check_paths`` checks them before any work, and so does the training preflight), ``prepare()`` (make sure the
files exist) and ``records(split)``. The configs in ``conf/data``
pick one with ``_target_`` under ``data.source``; nothing else in the project needs to know which.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from captioner.config import CaptionsSpec, ShapesSpec
from captioner.data import captions_file
from captioner.data.readers import SPLITS, Record, read_coco, read_karpathy
from captioner.data.shapes import generate_shapes, shapes_records
from captioner.errors import CaptionerError, ConfigError, DataError, check_choice
from captioner.fileio import write_json

CONFIG_KEY = "data.source"  # where the training config holds the source: a SourcePath's key is under it
DATASET_HELP = "see data/README.md for where dataset files go"
# What writes a missing Karpathy split file (``captioner splits <dataset> --captions-dir <data>/<folder>``), by name.
SPLIT_COMMANDS = {
    "dataset_coco.json": ("coco", "coco/annotations"),
    "dataset_flickr8k.json": ("flickr8k", "flickr8k/text"),
}

log = logging.getLogger(__name__)


class Holds(enum.StrEnum):
    """What a configured file or folder holds (preflight links each to its section of docs/datasets.md)."""

    annotations = "annotations"  # a dataset's own captions and boxes, downloaded with its images (COCO's)
    split_file = "split file"  # which images are in each split, with their captions (Karpathy's; captioner splits)
    captions = "captions"  # a user's own captions file (data=captions)
    images = "images"


@dataclass(frozen=True)
class SourcePath:
    """A file or folder that a source's config names: its one description, which ``check_paths``, ``prepare``
    and the training preflight all read."""

    key: str  # under ``data.source``: "split_file", "splits.train.captions"
    path: str | None  # None: the config holds null where the path goes
    kind: str  # "file" or "folder"
    holds: Holds
    remedy: str = "see the dataset's config in conf/data"  # how to get it when it is missing or wrong
    generated: bool = False  # may be missing: the source makes it on first use

    def fix(self) -> str:
        """How to put it right: its remedy, or for a null path, to give one."""
        return f"give the {self.kind}'s path" if self.path is None else self.remedy

    def problem(self) -> str | None:
        """What is wrong with it (``data.source.split_file='...': file not found``), or None."""
        if self.path is None:
            return f"{CONFIG_KEY}.{self.key} is null"
        if self.generated and not Path(self.path).exists():
            return None
        return path_problem(f"{CONFIG_KEY}.{self.key}={self.path!r}", self.path, self.kind)


def path_problem(name: str, path: str | Path, kind: str) -> str | None:
    """What is wrong with ``path``, which should be an existing ``kind`` ("file" or "folder"), said of ``name``
    (a config key or a command-line flag with its value): ``<name>: file not found``, ``<name> is not a folder``;
    None when nothing is."""
    target = Path(path)
    if not target.exists():
        return f"{name}: {kind} not found"
    if (kind == "file") != target.is_file():
        return f"{name} is not a {kind}"
    return None


def check_paths(paths: Iterable[SourcePath], error: type[CaptionerError] = ConfigError) -> None:
    """Raise ``error`` for the first of ``paths`` that is missing (with where dataset files go) or of the
    wrong kind."""
    for path in paths:
        problem = path.problem()
        if problem:
            if path.path is None:
                raise error(f"{problem}; {path.fix()}")
            raise error(f"{problem} ({DATASET_HELP})" if problem.endswith("not found") else problem)


class Source(Protocol):
    """What training needs from a dataset."""

    def paths(self) -> list[SourcePath]:
        """Every file and folder its config names, in the order they are checked (``check_paths``, preflight)."""

    def prepare(self) -> None:
        """Check (or create) the files; raise DataError naming what is missing."""

    def records(self, split: str) -> list[Record]:
        """The records of ``split`` (one of ``SPLITS``)."""


def split_file_remedy(split_file: str) -> str:
    """How to get a missing Karpathy split file."""
    path = Path(split_file)
    if path.name in SPLIT_COMMANDS:
        dataset, sources = SPLIT_COMMANDS[path.name]
        return f"write it with: captioner splits {dataset} --captions-dir {path.parent.parent / sources} --out {path}"
    return "see the guide for where this split file comes from"


@dataclass
class CocoSource:
    """COCO caption annotations (2014 or 2017), one captions file and image folder per split.

    ``splits`` maps a split name to ``{"captions": ..., "images": ..., "instances": ... (optional)}``.
    A split that is absent (COCO has no public test captions) falls back to ``fallback[split]``.
    """

    splits: Mapping[str, Mapping[str, str | None]]
    fallback: Mapping[str, str] = field(default_factory=lambda: {"test": "val"})

    def _entry(self, split: str) -> Mapping[str, str | None]:
        check_choice("split", split, SPLITS)
        if split in self.splits:
            return self.splits[split]
        if split in self.fallback and self.fallback[split] in self.splits:
            return self.splits[self.fallback[split]]
        raise ConfigError(f"{CONFIG_KEY}.splits has no '{split}' entry; give one of: {', '.join(SPLITS)}")

    def paths(self) -> list[SourcePath]:
        """Each split's captions file, image folder and instances file (when given)."""
        found = []
        for split, entry in self.splits.items():
            where = Path(entry["captions"]).parent.parent if entry["captions"] else "the dataset's folder"
            unzip = f"unzip annotations_trainval2014.zip into {where}"
            found.append(SourcePath(f"splits.{split}.captions", entry["captions"], "file", Holds.annotations, unzip))
            images = "unzip the split's images there"
            found.append(SourcePath(f"splits.{split}.images", entry["images"], "folder", Holds.images, images))
            if entry.get("instances"):
                instances = entry["instances"]
                found.append(SourcePath(f"splits.{split}.instances", instances, "file", Holds.annotations, unzip))
        return found

    def prepare(self) -> None:
        """Check every configured annotation file and image folder exists."""
        check_paths(self.paths(), DataError)

    def records(self, split: str) -> list[Record]:
        """Read ``split`` through pycocotools."""
        entry = self._entry(split)
        return read_coco(entry["captions"], entry["images"], split, instances_file=entry.get("instances"))


@dataclass
class KarpathySource:
    """Karpathy's split file (``dataset_coco.json``, ``dataset_flickr8k.json``, ``dataset_flickr30k.json``)."""

    split_file: str
    image_root: str
    restval_as_train: bool = True

    def paths(self) -> list[SourcePath]:
        """The split file and the image root."""
        return [
            SourcePath("split_file", self.split_file, "file", Holds.split_file, split_file_remedy(self.split_file)),
            SourcePath("image_root", self.image_root, "folder", Holds.images, "unzip the dataset's images there"),
        ]

    def prepare(self) -> None:
        """Check the split file and the image root exist."""
        check_paths(self.paths(), DataError)

    def records(self, split: str) -> list[Record]:
        """Read ``split`` (restval joins train unless ``restval_as_train`` is off)."""
        check_choice("split", split, SPLITS)
        return read_karpathy(self.split_file, self.image_root, splits=(split,), restval_as_train=self.restval_as_train)


def _spec(cls: type, spec: Mapping[str, Any], own: str) -> Any:
    """``cls`` (a frozen spec dataclass) of a source's other keys ``spec``; ConfigError naming an unknown key (the
    source's ``own`` keys listed first among the valid ones)."""
    names = [item.name for item in fields(cls)]
    unknown = [key for key in spec if key not in names]
    if unknown:
        raise ConfigError(f"{CONFIG_KEY}.{unknown[0]} is not a known key; valid keys: {own}, {', '.join(names)}")
    return cls(**spec)


@dataclass(init=False)
class CaptionsSource:
    """A user's folder of images and captions file: CSV/TSV (``image,caption``, one row per caption, an optional
    ``split`` column) or JSON Lines (``captioner.data.captions_file`` reads them).

    Built from ``data.source`` (``conf/data/captions.yaml``): ``captions`` (the file), ``split_from`` (the split
    file an earlier run wrote, whose ids and splits to reuse), ``write_split`` (where this run writes its own:
    the run's folder) and any fields of ``CaptionsSpec`` (its images folder, columns, split sizes and seed).
    ConfigError names another key. Every problem of the file is raised at once (``DataProblems``).
    """

    captions: str | None
    spec: CaptionsSpec
    split_from: str | None
    write_split: str | None

    def __init__(
        self, captions: str | None, split_from: str | None = None, write_split: str | None = None, **spec: Any
    ) -> None:
        self.captions = captions
        self.spec = _spec(CaptionsSpec, spec, "captions, split_from, write_split")
        self.split_from = split_from
        self.write_split = write_split
        self._found: captions_file.CaptionsSet | None = None
        self._prepared = False

    def paths(self) -> list[SourcePath]:
        """The captions file, the images folder when given (else the file's own) and a reused split file."""
        remedy = "give the captions file: CSV or TSV with an image,caption header, or JSON Lines"
        found = [SourcePath("captions", self.captions, "file", Holds.captions, remedy)]
        if self.spec.images is not None:
            found.append(SourcePath("images", self.spec.images, "folder", Holds.images, "give the images' folder"))
        if self.split_from is not None:
            remedy = f"give the {captions_file.SPLIT_FILE} of the run whose split to reuse"
            found.append(SourcePath("split_from", self.split_from, "file", Holds.captions, remedy))
        return found

    def read(self) -> captions_file.CaptionsSet:
        """The file's images, ids and splits (read once); DataProblems with every problem of the file."""
        if self._found is None:
            check_paths(self.paths(), DataError)
            reused = captions_file.read_split(self.split_from) if self.split_from is not None else None
            self._found = captions_file.read_captions(self.captions, self.spec, reused)
        return self._found

    def prepare(self) -> None:
        """Read the file, report its duplicate rows and the images a reused split leaves out, and write the split
        into ``write_split`` (when given)."""
        if self._prepared:
            return
        found = self.read()
        if found.duplicates:
            shown = captions_file.shown_lines(found.duplicates)
            log.warning("%s: %d duplicate rows (a caption its image already has) kept once: %s", self.captions,
                        len(found.duplicates), shown)  # fmt: skip
        if found.left_out:
            log.warning("%s: %d images are not in the split of %s (e.g. %s): in no split", self.captions,
                        len(found.left_out), self.split_from, found.left_out[0])  # fmt: skip
        if self.write_split is not None:
            write_json(self.write_split, captions_file.split_document(self.captions, self.spec, found))
        self._prepared = True

    def records(self, split: str) -> list[Record]:
        """The records of ``split``."""
        check_choice("split", split, SPLITS)
        return self.read().split(split)


def shapes_folder(base: str, params: Mapping[str, Any], given: Collection[str]) -> str:
    """Where a built-in set goes when ``data.source.root`` is not given: ``base`` (its dataset config's folder,
    ``data/shapes``) holds the set the config describes; a set with any of its parameters ``given`` (the names
    of ``ShapesSpec`` fields set on the command line, ``params`` their values) goes to a folder of its own, named
    from them, so that a trial of another size never takes the place of the config's set:
    ``<base>_<n_train>_<n_val>_<n_test>``, then ``_<name>-<value>`` for each other parameter given
    (``data/shapes_64_16_16``, ``data/shapes_3000_250_250_seed-3``)."""
    names = [item.name for item in fields(ShapesSpec) if item.name in given]
    if not names:
        return base
    sizes = [str(params[f"n_{split}"]) for split in SPLITS]
    others = [f"{name}-{params[name]}" for name in names if name.removeprefix("n_") not in SPLITS]
    return "_".join([base, *sizes, *others])


@dataclass(init=False)
class ShapesSource:
    """The built-in synthetic dataset ``spec``, generated under ``root`` on first use (never overwritten).

    Built from ``data.source`` (``conf/data/shapes.yaml``, ``conf/data/scenes.yaml``): ``root`` and any fields
    of ``ShapesSpec`` (its defaults are the built-in dataset's); ConfigError names another key.
    """

    root: str
    spec: ShapesSpec

    def __init__(self, root: str, **spec: Any) -> None:
        self.root = root
        self.spec = _spec(ShapesSpec, spec, "root")

    def paths(self) -> list[SourcePath]:
        """``root``, which may be missing (the dataset is generated there on first use) but must be a folder."""
        remedy = "give a folder: the built-in dataset is generated there on first use"
        return [SourcePath("root", self.root, "folder", Holds.images, remedy, generated=True)]

    def prepare(self) -> None:
        """Generate the dataset if it is not there yet (a no-op when it is)."""
        generate_shapes(self.root, self.spec)

    def records(self, split: str) -> list[Record]:
        """Read ``split`` of the generated COCO-format files (with boxes)."""
        check_choice("split", split, SPLITS)
        return shapes_records(self.root, split)
