"""The image paths of the command line: files, folders (searched recursively), globs and standard input."""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import UnidentifiedImageError

from captioner.cli.parser import STDIN
from captioner.data.dataset import Skipped
from captioner.data.images import open_header
from captioner.errors import ConfigError

LeaveOut = Callable[[Path], bool]  # whether a folder's file or sub-folder is left out of the search
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")


@dataclass
class Inputs:
    """What the command line names: image paths in order, the inputs that named none, the files skipped."""

    paths: list[str] = field(default_factory=list)
    errors: list[Skipped] = field(default_factory=list)  # a folder without images, a glob without a match, ...
    skipped: list[str] = field(default_factory=list)  # files inside folders that are not images, in order


def _holds_an_image(path: Path) -> bool:
    """Whether PIL recognises the file's header as an image (reads only the header, whatever its size)."""
    try:
        with open_header(path):
            return True
    except (UnidentifiedImageError, OSError):
        return False


def _files(folder: Path, leave_out: LeaveOut) -> list[Path]:
    """The regular files under ``folder``, recursively, sorted; hidden files and folders (``.thumbs/``,
    ``._photo.jpg``) and those ``leave_out`` names left out."""
    files = []
    for top, folders, names in os.walk(folder):
        folders[:] = [name for name in folders if not name.startswith(".") and not leave_out(Path(top, name))]
        files += [
            Path(top, name)
            for name in names
            if not name.startswith(".") and Path(top, name).is_file() and not leave_out(Path(top, name))
        ]
    return sorted(files)


def _scan(folder: Path, found: Inputs, leave_out: LeaveOut) -> None:
    """A folder's image files (``_files``): files named like an image, and files without a suffix whose
    header is an image's (a download or a camera's file without one). Other files are skipped."""
    images = []
    for path in _files(folder, leave_out):
        suffix = path.suffix.lower()
        if suffix in IMAGE_SUFFIXES or (not suffix and _holds_an_image(path)):
            images.append(str(path))
        else:
            found.skipped.append(str(path))
    if not images:
        found.errors.append(Skipped(str(folder), "folder holds no image files"))
    found.paths.extend(images)


def _expand(item: str, found: Inputs, leave_out: LeaveOut, named: bool = True) -> None:
    """Add the image paths of one argument (file, folder or glob) to ``found``, or its error; what ``leave_out``
    names is left out of folders and globs (a file ``named`` by itself is kept)."""
    path = Path(item)
    if not named and leave_out(path):
        return
    if path.is_dir():
        _scan(path, found, leave_out)
    elif not path.exists() and glob.has_magic(item):
        matches = sorted(glob.glob(item, recursive=True))
        if not matches:
            found.errors.append(Skipped(item, "no file matches this pattern"))
        for match in matches:
            _expand(match, found, leave_out, named=False)
    else:
        found.paths.append(item)  # a file or a missing file: load_rgb says what is wrong with it


def _stdin_paths(nul: bool) -> list[str]:
    """The paths standard input names: one per line (blank lines ignored), or NUL-separated (``find -print0``)."""
    if nul:
        return [name for name in sys.stdin.buffer.read().decode(errors="surrogateescape").split("\0") if name]
    return [line for line in (line.rstrip("\r\n") for line in sys.stdin) if line.strip()]


def _nothing(path: Path) -> bool:
    return False


def expand_inputs(items: Sequence[str], nul: bool = False, leave_out: LeaveOut = _nothing) -> Inputs:
    """Files, folders and globs -> image paths, input errors and the files of folders that are not images.

    A file given by name is always kept, so that an unreadable one gets its own error; a file named more than
    once (directly, by its folder, by a glob) is kept once, where it is first named. ``-`` reads more inputs
    from standard input, one per line (blank lines ignored) or, with ``nul``, separated by NUL characters;
    standard input that names nothing is an input error, as an empty folder is. The files and folders for
    which ``leave_out`` is true (a gallery's own, inside an input folder) are not searched. ConfigError when
    ``-`` is given twice.
    """
    if list(items).count(STDIN) > 1:
        raise ConfigError(f"{STDIN} (standard input) is given more than once")
    found = Inputs()
    for item in items:
        named = _stdin_paths(nul) if item == STDIN else [item]
        if item == STDIN and not named:
            found.errors.append(Skipped(STDIN, "standard input named no image paths"))
        for name in named:
            _expand(name, found, leave_out)
    seen: set[str] = set()
    unique = []
    for path in found.paths:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    found.paths = unique
    return found
