"""The image paths of the command line: files, folders (searched recursively), globs and standard input; what a
folder search leaves out (``LeftOut``): the files a gallery wrote, and the folder the command writes."""

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
from captioner.viz.layout import MANIFEST, GalleryFiles

# What a folder search takes as an image by its name: photos' and the web's formats (a browser saves JPEGs as .jfif;
# HEIC, an iPhone's, is named so that its error says what it is rather than that it is no image)
IMAGE_SUFFIXES = (
    *(".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"),
    *(".avif", ".heic", ".heif", ".ppm", ".pgm", ".pbm"),
)


@dataclass
class Inputs:
    """What the command line names: image paths in order, the inputs that named none, the files skipped."""

    paths: list[str] = field(default_factory=list)
    errors: list[Skipped] = field(default_factory=list)  # a folder without images, a glob without a match, ...
    skipped: list[str] = field(default_factory=list)  # files inside folders that are not images, in order
    left_out: str | None = None  # the line that says which files the search left out and why (LeftOut.line)


def _shown(folder: str) -> str:
    """``folder`` (absolute) as a message names it: relative to the working folder when inside it."""
    inside = os.path.relpath(folder)
    return folder if inside == ".." or inside.startswith(".." + os.sep) else inside


class LeftOut:
    """What a folder search and a glob leave out, counted by reason: every file that a gallery recorded
    (captioner.viz.layout: the ``.captioner-gallery`` of its folder or of a folder above it), wherever the
    gallery lies among the inputs, and the folder ``out`` that the command writes (attend's ``--out``), whole.

    One rule for ``caption`` and ``attend``: ``captioner attend photos --out photos/overlays`` then ``captioner
    caption photos`` captions the photos, not the gallery's sheets and copies. A user's own file inside a
    gallery's folder is not recorded there, so it is searched as any other.
    """

    def __init__(self, out: str | os.PathLike | None = None) -> None:
        self.out = None if out is None else os.path.realpath(out)
        self.shown_out = None if out is None else os.fspath(out)
        # a folder (absolute) -> the galleries (their folder, their record) in it and above it, nearest first
        self._above: dict[str, list[tuple[str, GalleryFiles]]] = {}
        self.files: dict[str, set[str]] = {}  # the files left out (absolute), by the folder that explains it

    def _galleries(self, folder: str) -> list[tuple[str, GalleryFiles]]:
        """The galleries (their folder, their record) in ``folder`` (absolute) and the folders above it; each
        folder looked at once."""
        if folder not in self._above:
            parent = os.path.dirname(folder)
            here = [(folder, GalleryFiles(folder))] if os.path.isfile(os.path.join(folder, MANIFEST)) else []
            self._above[folder] = here + (self._galleries(parent) if parent != folder else [])
        return self._above[folder]

    def __call__(self, path: Path) -> bool:
        """Whether ``path`` (a file or folder met in a search) is left out; counted when it is."""
        if self.out is not None and path.is_dir() and os.path.realpath(path) == self.out:
            inside = _files(path, lambda _: False)  # what a search of it would have met
            self.files.setdefault(self.out, set()).update(os.path.abspath(file) for file in inside)
            return True
        absolute = os.path.abspath(path)
        for folder, gallery in self._galleries(os.path.dirname(absolute)):
            if gallery.ours(absolute):
                self.files.setdefault(folder, set()).add(absolute)
                return True
        return False

    def line(self) -> str | None:
        """The line that says how many files were left out and why (None: none was)."""
        ours = {folder: os.path.realpath(folder) == self.out for folder in self.files}  # --out, or an earlier gallery
        in_out = {file for folder, files in self.files.items() if ours[folder] for file in files}
        galleries = {folder: len(files) for folder, files in self.files.items() if not ours[folder]}
        reasons = []
        if in_out:  # --out itself, or (--out an input folder) the files an earlier gallery recorded there
            reasons.append(f"{_files_count(len(in_out))} in --out {self.shown_out}, where this gallery goes")
        if galleries:
            kind = "gallery" if len(galleries) == 1 else "galleries"
            named = ", ".join(_shown(folder) for folder in galleries)
            reasons.append(f"{_files_count(sum(galleries.values()))} of captioner attend's {kind} in {named}")
        if not reasons:
            return None
        return f"left out: {'; '.join(reasons)} (a file named by itself is read all the same)"


def _files_count(files: int) -> str:
    return f"{files:,} file" + ("" if files == 1 else "s")


def _holds_an_image(path: Path) -> bool:
    """Whether PIL recognises the file's header as an image (reads only the header, whatever its size)."""
    try:
        with open_header(path):
            return True
    except (UnidentifiedImageError, OSError):
        return False


def _broken_link(path: Path) -> bool:
    """Whether ``path`` is a symbolic link whose target is gone."""
    return path.is_symlink() and not path.exists()


def _files(folder: Path, leave_out: Callable[[Path], bool], unread: list[Skipped] | None = None) -> list[Path]:
    """The files under ``folder``, recursively, sorted: regular files and links to them (a link whose target is
    gone too: loading it says so), and the special files (a pipe, a socket: ``_scan`` skips them); hidden files and
    folders (``.thumbs/``, ``._photo.jpg``) and those ``leave_out`` names left out. A link to a folder outside
    ``folder`` (``photos/nas -> /mnt/nas/photos``) is searched once; one to a folder inside it is not, since the
    search reaches that folder itself (a link up the tree: a loop). Each folder that cannot be listed (no
    permission) is added to ``unread``."""
    root = os.path.realpath(folder)
    linked: set[str] = set()  # the real folders of the links searched
    files = []

    def cannot_list(exc: OSError) -> None:
        if unread is not None:
            unread.append(Skipped(os.fspath(exc.filename), f"folder cannot be read ({exc.strerror or exc})"))

    for top, folders, names in os.walk(folder, onerror=cannot_list, followlinks=True):
        kept = []
        for name in sorted(folders):  # of two links to one folder, the first by name is searched
            path = Path(top, name)
            if name.startswith(".") or leave_out(path):
                continue
            if path.is_symlink():
                real = os.path.realpath(path)
                if real in linked or Path(real).is_relative_to(root):
                    continue
                linked.add(real)
            kept.append(name)
        folders[:] = kept
        files += [
            Path(top, name)
            for name in names
            if not name.startswith(".")
            and not Path(top, name).is_dir()  # a link to a folder os.walk did not follow
            and not leave_out(Path(top, name))
        ]
    return sorted(files)


def _scan(folder: Path, found: Inputs, leave_out: LeftOut) -> None:
    """A folder's image files (``_files``): files named like an image, and files without a suffix whose
    header is an image's (a download or a camera's file without one). Other files are skipped (counted), a pipe
    or a socket too, never opened; a folder that cannot be listed is an input error, as one without images is."""
    images = []
    unread: list[Skipped] = []
    for path in _files(folder, leave_out, unread):
        suffix = path.suffix.lower()
        if not (path.is_file() or _broken_link(path)):  # a pipe, even named x.jpg: opening it would wait forever
            found.skipped.append(str(path))
        elif suffix in IMAGE_SUFFIXES or (not suffix and _holds_an_image(path)):
            images.append(str(path))
        else:
            found.skipped.append(str(path))
    found.errors.extend(unread)
    if not images and not unread:
        found.errors.append(Skipped(str(folder), "folder holds no image files"))
    found.paths.extend(images)


def _expand(item: str, found: Inputs, leave_out: LeftOut, named: bool = True) -> None:
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


def expand_inputs(items: Sequence[str], nul: bool = False, leave_out: LeftOut | None = None) -> Inputs:
    """Files, folders and globs -> image paths, input errors, the files of folders that are not images, and the
    line that says what ``leave_out`` left out.

    A file given by name is always kept, so that an unreadable one gets its own error; a file named more than
    once (directly, by its folder, by a glob) is kept once, where it is first named. ``-`` reads more inputs
    from standard input, one per line (blank lines ignored) or, with ``nul``, separated by NUL characters;
    standard input that names nothing is an input error, as an empty folder is. The files and folders that
    ``leave_out`` names (None: a ``LeftOut()``, the files of galleries) are not searched. ConfigError when ``-``
    is given twice.
    """
    if list(items).count(STDIN) > 1:
        raise ConfigError(f"{STDIN} (standard input) is given more than once")
    leave_out = LeftOut() if leave_out is None else leave_out
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
    found.left_out = leave_out.line()
    return found
