"""The files of a gallery folder: every name a gallery gives (one numbering for all of them), and the record of
what it wrote there, so that a later ``--force`` removes exactly those files and nothing of the user's.

Entry ``n`` of image ``photos/cat.png`` is ``0007_cat``: its sheet ``0007_cat.jpg``, the strip of its panels
``0007_cat.panels.jpg`` (captioner.viz.sheet), and copies of files from elsewhere under ``images/``:
``0007_cat.jpg`` for the image, ``0007_cat.sheet.jpg`` and ``0007_cat.panels.jpg`` for a sheet or a strip (each
copy its own name). The pages are ``index.html``, ``page002.html``, .... The record, ``.captioner-gallery``, lists
one written file per line (a JSON string, relative to the folder), each added before the file is written: a run
that stops halfway still leaves a record of all it wrote. Hidden, it is never listed as an input either.

A gallery that replaces an earlier one is written into a stage, a hidden folder beside its own, and moved in only
once every file of it is written (``GalleryFiles.move_in``): a run that fails leaves the earlier gallery whole.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from captioner.fileio import append_record, read_record

MANIFEST = ".captioner-gallery"  # the record of the files a gallery wrote into its folder
# At most this many bytes of an image's name go into its entry's: a file's name holds 255 bytes (NAME_MAX), and the
# longest of an entry's files with its temporary name while it is written (".0007_NAME.panels.jpg.abcd1234.tmp") adds
# 31 to it; the number keeps the cut names apart
NAME_BYTES = 200
COPIES = "images"  # the folder, inside the gallery's, that holds the copies of files from elsewhere


class GalleryFiles:
    """The names of a gallery's files in ``root``, and the record of those a gallery wrote there.

    ``stage``: where this gallery's files are written until ``move_in`` moves them into ``root`` (None: into
    ``root`` itself); their names, the record's and the pages' links, are those they will have in ``root``.
    """

    def __init__(self, root: str | os.PathLike, stage: str | os.PathLike | None = None) -> None:
        self.root = Path(root)
        self.stage = self.root if stage is None else Path(stage)
        self.earlier = self._read()  # what an earlier gallery recorded (paths relative to root, POSIX)
        self.written: set[str] = set()  # what this one recorded

    def _read(self) -> set[str]:
        """The names the record in root lists that lie inside root (none absolute, none with ``..``)."""
        names = read_record(self.root / MANIFEST)
        return {name for name in names if not Path(name).is_absolute() and ".." not in Path(name).parts}

    # ----------------------------------------------------------------------------------------- names
    @staticmethod
    def entry(number: int, image: str | os.PathLike) -> str:
        """The name of entry ``number`` (its position in the gallery, from 0) of ``image``: ``0007_cat``, the name cut
        to NAME_BYTES (a long download's name: whole characters)."""
        stem = Path(image).stem
        while len(os.fsencode(stem)) > NAME_BYTES:
            stem = stem[:-1]
        return f"{number:04d}_{stem}"

    def sheet(self, number: int, image: str | os.PathLike) -> Path:
        """The sheet of every word (captioner.viz.sheet) of entry ``number``."""
        return self.stage / f"{self.entry(number, image)}.jpg"

    def strip(self, number: int, image: str | os.PathLike) -> Path:
        """The strip of entry ``number``'s panels, one per word (captioner.viz.sheet.Strip)."""
        return self.stage / f"{self.entry(number, image)}.panels.jpg"

    def copy(self, number: int, image: str | os.PathLike, role: str, suffix: str) -> Path:
        """The copy of a file from elsewhere shown by entry ``number``: ``role`` is "" for the image itself,
        ``sheet`` or ``panels`` (a strip); ``suffix`` the copy's format (``.jpg``, ``.png``)."""
        return self.stage / COPIES / f"{self.entry(number, image)}{'.' + role if role else ''}{suffix}"

    def page(self, index: int) -> Path:
        """Page ``index`` (from 0) of the gallery: ``index.html``, then ``page002.html``, ..."""
        return self.stage / ("index.html" if index == 0 else f"page{index + 1:03d}.html")

    def planned(self, number: int, image: str | os.PathLike) -> list[Path]:
        """What entry ``number`` of ``image`` may write: its sheet, its strip and its copies."""
        copies = (self.root / COPIES).glob(f"{glob.escape(self.entry(number, image))}.*")
        return [self.sheet(number, image), self.strip(number, image), *copies]

    # ------------------------------------------------------------------------------------- the record
    def relative(self, path: str | os.PathLike) -> str:
        """``path`` (inside root, or a file this gallery writes in its stage) relative to root, as the record
        writes it: symbolic links resolved, so one file has one name. A path spelled under root with no link
        below root costs a few ``lstat`` calls."""
        path = Path(path)
        for base in dict.fromkeys((self.stage, self.root)):
            if path.is_relative_to(base) and ".." not in path.parts:
                inner = path.relative_to(base)
                below = [base.joinpath(*inner.parts[: k + 1]) for k in range(len(inner.parts))]
                if not any(step.is_symlink() for step in below):
                    return inner.as_posix()
        real, stage = os.path.realpath(path), os.path.realpath(self.stage)
        base = stage if self.stage != self.root and Path(real).is_relative_to(stage) else os.path.realpath(self.root)
        return Path(os.path.relpath(real, base)).as_posix()

    def current(self, name: str) -> Path:
        """Where the file of ``name`` (relative to root) is now: in the stage when this gallery wrote it."""
        return (self.stage if name in self.written else self.root) / name

    def ours(self, path: str | os.PathLike) -> bool:
        """Whether a gallery (an earlier one, or this one) recorded ``path``."""
        name = self.relative(path)
        return name in self.earlier or name in self.written

    def conflicts(self, paths: Iterable[Path]) -> list[Path]:
        """Those of ``paths`` (files or folders a gallery would write) that exist and that no gallery wrote: a
        file not recorded, a folder that holds one."""
        found = []
        for path in paths:
            if path.is_dir() and not path.is_symlink():
                if any(not self.ours(inner) for inner in path.rglob("*") if not inner.is_dir()):
                    found.append(path)
            elif (path.exists() or path.is_symlink()) and not self.ours(path):
                found.append(path)
        return found

    def record(self, path: str | os.PathLike) -> Path:
        """Add ``path`` to the record before it is written; return it. FileExistsError when it exists and no
        gallery wrote it: a user's file is never overwritten."""
        return self.record_all([path])[0]

    def record_all(self, paths: Iterable[str | os.PathLike]) -> list[Path]:
        """:meth:`record` for each of ``paths``, with one write to the record for them all (an image's sheet and
        strip); FileExistsError, with none of them recorded, when one exists and no gallery wrote it."""
        paths = [Path(path) for path in paths]
        names = [self.relative(path) for path in paths]
        kept = self.written if self.stage != self.root else self.earlier | self.written  # what the record holds
        new = [name for name in dict.fromkeys(names) if name not in kept]
        for path, name in zip(paths, names):
            if name in new and (path.exists() or path.is_symlink()):
                raise FileExistsError(f"{path} exists and no gallery wrote it; it is left as it is")
        if new:
            self.stage.mkdir(parents=True, exist_ok=True)
            append_record(self.stage / MANIFEST, new)
            self.written.update(new)
        return paths

    def clear(self) -> None:
        """Remove every file an earlier gallery recorded, then its folders left empty, and start a new record.
        Files that are gone already are skipped; nothing unrecorded is touched."""
        folders = set()
        for name in sorted(self.earlier):
            path = self.root / name
            if path.is_dir():
                continue
            if path.exists() or path.is_symlink():
                path.unlink()
            folders.update(
                parent for parent in path.parents if parent.is_relative_to(self.root) and parent != self.root
            )
        for folder in sorted(folders, key=lambda item: len(item.parts), reverse=True):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        (self.root / MANIFEST).unlink(missing_ok=True)
        self.earlier = set()

    def move_in(self) -> None:
        """Move this gallery's files from its stage into root, in place of the earlier gallery's (``clear``), and
        remove the stage; FileExistsError, with nothing moved or removed, when a file that no gallery wrote has
        one of their names in root."""
        if self.stage == self.root:
            return
        for name in sorted(self.written - self.earlier):
            if (self.root / name).exists() or (self.root / name).is_symlink():
                raise FileExistsError(f"{self.root / name} exists and no gallery wrote it; it is left as it is")
        self.clear()
        for name in sorted(self.written):
            (self.root / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.stage / name, self.root / name)
        if (self.stage / MANIFEST).is_file():
            os.replace(self.stage / MANIFEST, self.root / MANIFEST)
        shutil.rmtree(self.stage)
        self.stage, self.earlier, self.written = self.root, self.written, set()
