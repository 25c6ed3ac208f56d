"""Dataset sources: where each split's records come from (COCO files, a Karpathy split file, built-in shapes).

A source is a small object with ``check_files()`` (before any work: is every file it was configured with
there?), ``prepare()`` (make sure the files exist) and ``records(split)``. The configs in ``conf/data``
pick one with ``_target_`` under ``data.source``; nothing else in the project needs to know which.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from captioner.config import ShapesSpec
from captioner.data.readers import SPLITS, Record, read_coco, read_karpathy
from captioner.data.shapes import generate_shapes, shapes_records
from captioner.errors import ConfigError, DataError, check_choice

CONFIG_KEY = "data.source"  # where the training config holds the source: check_files names keys under it
DATASET_HELP = "see data/README.md for where dataset files go"


class Source(Protocol):
    """What training needs from a dataset."""

    def check_files(self) -> None:
        """Raise ConfigError naming the config key of a configured file or folder that is missing or is not
        one (``data.source.split_file='...': file not found (...)``); check nothing that is created later."""

    def prepare(self) -> None:
        """Check (or create) the files; raise DataError naming what is missing."""

    def records(self, split: str) -> list[Record]:
        """The records of ``split`` (one of ``SPLITS``)."""


def _require(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{what} not found: {path} ({DATASET_HELP})")
    return path


def _check_config_path(key: str, path: str | Path | None, kind: str) -> None:
    """Raise ConfigError naming ``data.source.<key>`` unless ``path`` is an existing ``kind`` ("file" or "folder")."""
    if path is None:
        raise ConfigError(f"{CONFIG_KEY}.{key} is null; give the {kind}'s path")
    target = Path(path)
    if not target.exists():
        raise ConfigError(f"{CONFIG_KEY}.{key}={str(path)!r}: {kind} not found ({DATASET_HELP})")
    if (kind == "file") != target.is_file():
        raise ConfigError(f"{CONFIG_KEY}.{key}={str(path)!r} is not a {kind}")


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

    def check_files(self) -> None:
        """Check each split's captions file, image folder and instances file (when given), in that order."""
        for split, entry in self.splits.items():
            _check_config_path(f"splits.{split}.captions", entry["captions"], "file")
            _check_config_path(f"splits.{split}.images", entry["images"], "folder")
            if entry.get("instances"):
                _check_config_path(f"splits.{split}.instances", entry["instances"], "file")

    def prepare(self) -> None:
        """Check every configured annotation file and image folder exists."""
        for split, entry in self.splits.items():
            _require(entry["captions"], f"COCO captions file for '{split}'")
            _require(entry["images"], f"COCO image folder for '{split}'")
            if entry.get("instances"):
                _require(entry["instances"], f"COCO instances file for '{split}'")

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

    def check_files(self) -> None:
        """Check that the split file is a file and the image root a folder."""
        _check_config_path("split_file", self.split_file, "file")
        _check_config_path("image_root", self.image_root, "folder")

    def prepare(self) -> None:
        """Check the split file and the image root exist."""
        _require(self.split_file, "Karpathy split file")
        _require(self.image_root, "image root")

    def records(self, split: str) -> list[Record]:
        """Read ``split`` (restval joins train unless ``restval_as_train`` is off)."""
        check_choice("split", split, SPLITS)
        return read_karpathy(self.split_file, self.image_root, splits=(split,), restval_as_train=self.restval_as_train)


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

    Built from ``data.source`` (``conf/data/shapes.yaml``, ``conf/data/scenes.yaml``): ``root`` and the fields
    of ``ShapesSpec``, whose defaults are the built-in dataset's.
    """

    root: str
    spec: ShapesSpec

    def __init__(
        self,
        root: str,
        n_train: int = ShapesSpec.n_train,
        n_val: int = ShapesSpec.n_val,
        n_test: int = ShapesSpec.n_test,
        image_size: int = ShapesSpec.image_size,
        seed: int = ShapesSpec.seed,
        scenes: str = ShapesSpec.scenes,
        width: int = ShapesSpec.width,
        height: int = ShapesSpec.height,
    ) -> None:
        self.root = root
        self.spec = ShapesSpec(n_train, n_val, n_test, image_size, seed, scenes, width, height)

    def check_files(self) -> None:
        """``root`` may be missing (the dataset is generated there on first use) but must not be a file."""
        if Path(self.root).exists() and not Path(self.root).is_dir():
            raise ConfigError(f"{CONFIG_KEY}.root={str(self.root)!r} is a file, not a folder")

    def prepare(self) -> None:
        """Generate the dataset if it is not there yet (a no-op when it is)."""
        generate_shapes(self.root, self.spec)

    def records(self, split: str) -> list[Record]:
        """Read ``split`` of the generated COCO-format files (with boxes)."""
        check_choice("split", split, SPLITS)
        return shapes_records(self.root, split)
