"""The image paths of the command line: files, folders (searched recursively), globs and standard input."""

from __future__ import annotations

import glob
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from captioner.cli.parser import STDIN
from captioner.data.dataset import Skipped
from captioner.errors import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")


@dataclass
class Inputs:
    """What the command line names: image paths in order, the inputs that named none, the files skipped."""

    paths: list[str] = field(default_factory=list)
    errors: list[Skipped] = field(default_factory=list)  # a folder without images, a glob without a match, ...
    skipped: list[str] = field(default_factory=list)  # files inside folders that are not images, in order


def _holds_an_image(path: Path) -> bool:
    """Whether PIL recognises the file's header as an image (reads only the header)."""
    try:
        with Image.open(path):
            return True
    except (UnidentifiedImageError, OSError):
        return False


def _scan(folder: Path, found: Inputs) -> None:
    """A folder's image files, recursively, sorted: files named like an image, and files without a suffix
    whose header is an image's (a download or a camera's file without one). Other files are skipped."""
    images = []
    for path in sorted(folder.rglob("*")):
        suffix = path.suffix.lower()
        if suffix in IMAGE_SUFFIXES or (not suffix and path.is_file() and _holds_an_image(path)):
            images.append(str(path))  # a folder named like an image too: loading it says what is wrong
        elif path.is_file():
            found.skipped.append(str(path))
    if not images:
        found.errors.append(Skipped(str(folder), "folder holds no image files"))
    found.paths.extend(images)


def _expand(item: str, found: Inputs) -> None:
    """Add the image paths of one argument (file, folder or glob) to ``found``, or its error."""
    path = Path(item)
    if path.is_dir() and path.suffix.lower() not in IMAGE_SUFFIXES:
        _scan(path, found)
    elif not path.exists() and glob.has_magic(item):
        matches = sorted(glob.glob(item, recursive=True))
        if not matches:
            found.errors.append(Skipped(item, "no file matches this pattern"))
        for match in matches:
            _expand(match, found)
    else:
        found.paths.append(item)  # a file, a missing file or a folder named like an image: load_rgb says which


def expand_inputs(items: Sequence[str]) -> Inputs:
    """Files, folders and globs -> image paths, input errors and the files of folders that are not images.

    A file given by name is always kept, so that an unreadable one gets its own error. ``-`` reads more
    inputs from standard input, one per line (blank lines ignored); standard input that names nothing is an
    input error, as an empty folder is. ConfigError when ``-`` is given twice.
    """
    if list(items).count(STDIN) > 1:
        raise ConfigError(f"{STDIN} (standard input) is given more than once")
    found = Inputs()
    for item in items:
        lines = [line.rstrip("\r\n") for line in sys.stdin] if item == STDIN else [item]
        named = [line for line in lines if line.strip()]
        if item == STDIN and not named:
            found.errors.append(Skipped(STDIN, "standard input named no image paths"))
        for line in named:
            _expand(line, found)
    return found
