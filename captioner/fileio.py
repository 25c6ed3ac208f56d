"""Atomic writes and safe loads: the only way the project writes or reads its own files.

Every file is written to a temporary sibling and renamed into place, so an interrupted write never
leaves a truncated file where a good one was. Torch files load with ``weights_only=True`` only.
A run folder is always a new one (``new_folder``): an earlier run's folder is never written into.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from captioner.errors import BundleError, DataError, first_line

_UMASK = os.umask(0o022)  # read once, while importing (os.umask can only be read by setting it)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", durable: bool = True) -> Iterator[IO]:
    """Open a temporary file next to ``path``; on success fsync it (``durable``) and rename it over ``path``.

    On any exception the temporary file is removed and ``path`` is left untouched. The file gets the
    permissions a plain ``open`` would give it (``mkstemp`` alone makes it private to its owner).
    ``durable=False`` skips the fsync, for many small files that are cheap to make again (a gallery's panels:
    an fsync each cost more than drawing them): never half-written in place, but a power cut may lose them.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the temporary name takes at most 48 characters (192 bytes) of the file's: one of up to 255 bytes can be written
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:48]}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def new_folder(path: str | os.PathLike) -> Path:
    """Create and return a new folder at ``path``, or at ``path_1``, ``path_2``, ... when it exists.

    A folder is claimed only by creating it (``mkdir`` is atomic), so two processes that ask for the same
    path at once (two runs started in the same second) get different folders, and an existing folder,
    even an empty one, is never reused.
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = path, 0
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1
            candidate = path.with_name(f"{path.name}_{n}")


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON atomically."""
    with atomic_write(path, "w") as handle:
        json.dump(obj, handle, indent=indent)


def read_record(path: str | os.PathLike) -> list[str]:
    """The names a record of written files lists (``append_record``'s: a JSON string per line), in order; a line
    cut short (by a run stopped as it wrote it) or holding no string is left out, and no record lists none."""
    path = Path(path)
    if not path.is_file():
        return []
    names = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            name = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(name, str):
            names.append(name)
    return names


def append_record(path: str | os.PathLike, names: list[str]) -> None:
    """Add ``names`` to the record of written files at ``path`` (``read_record``), one write for them all."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(name) + "\n" for name in names))


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read JSON (UTF-8; a byte-order mark, which Windows editors write, is dropped), raising DataError that names
    the file for a missing or malformed one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8-sig") as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{what} {path} is not valid JSON: {exc}") from None


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` atomically (temporary file, fsync, rename)."""
    import torch  # here, not at the top: the run folder's helpers are used before a run imports torch

    with atomic_write(path, "wb") as handle:
        torch.save(obj, handle)


def _missing_device(map_location: Any) -> str | None:
    """Why this machine cannot hold tensors on the device ``map_location`` names; None when it can (or when
    ``map_location`` is a mapping or a function, which torch applies itself)."""
    import torch

    if not isinstance(map_location, (str, torch.device)):
        return None
    try:
        device = torch.device(map_location)
    except RuntimeError as exc:
        return f"map_location={str(map_location)!r} is not a torch device ({first_line(exc, first_sentence=True)})"
    if device.type in ("cpu", "meta"):
        return None
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps, ...
    count = backend.device_count() if hasattr(backend, "device_count") else 0
    if count > (device.index or 0):
        return None
    return (
        f"this machine has only {count} {device.type} device(s)"
        if count
        else f"this machine has no {device.type} device"
    )


def _check_archive(path: Path, what: str, max_bytes: int | None) -> None:
    """BundleError unless the zip archive at ``path`` (what torch.save writes) keeps its members stored, as
    torch.save does, within the file's own bytes, and at most ``max_bytes`` of them (None: no bound): its
    directory is read before torch is, so a crafted file cannot make loading allocate more than its own size (a
    compressed member of zeros: a thousand times it)."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as exc:
        raise BundleError(f"{what} {path} is truncated or corrupt (its zip directory: {first_line(exc)})") from None
    compressed = [member.filename for member in members if member.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise BundleError(
            f"{what} {path} was refused: its member {compressed[0]} is compressed, which torch.save never writes "
            "(a compressed file can unpack to far more memory than its size)"
        )
    held, size = sum(member.file_size for member in members), path.stat().st_size
    if held > size or any(member.file_size != member.compress_size for member in members):
        raise BundleError(f"{what} {path} is corrupt: its zip directory claims {held:,} bytes in a file of {size:,}")
    if max_bytes is not None and held > max_bytes:
        raise BundleError(
            f"{what} {path} was refused: it holds {held / 1e6:,.1f} MB, more than any model file may "
            f"({max_bytes / 1e6:,.0f} MB)"
        )


def load_torch(
    path: str | os.PathLike,
    what: str = "file",
    map_location: Any = "cpu",
    max_bytes: int | None = None,
    mmap: bool = False,
) -> Any:
    """``torch.load(weights_only=True)`` with one clear BundleError for every way it can fail.

    A file that carries pickled code (classes, functions) is refused, never executed. A ``map_location``
    naming a device this machine lacks is reported as such (torch's own error would read as a broken file).
    A zip archive (every file torch.save writes) is refused, before torch reads it, when a member is compressed
    or its members hold more than the file's size or ``max_bytes`` (None: no bound), so loading allocates no
    more than the file's size.
    """
    import torch

    path = Path(path)
    if not path.exists():
        raise BundleError(f"{what} not found: {path}")
    if not path.is_file():
        raise BundleError(f"{what} {path} is not a file")
    if path.stat().st_size == 0:
        raise BundleError(f"{what} {path} is empty")
    with open(path, "rb") as handle:
        head = handle.read(2)
    if head != b"PK" and head[:1] != b"\x80":  # torch.save writes a zip archive (a pickle before torch 1.6)
        raise BundleError(
            f"{what} {path} is not a model file (torch.save did not write it); give a training run's folder, "
            "its bundle.pt or a checkpoint"
        )
    if head == b"PK":
        _check_archive(path, what, max_bytes)
    missing = _missing_device(map_location)
    if missing:
        raise BundleError(
            f"cannot load {what} {path} onto {str(map_location)!r}: {missing}; "
            'load it with map_location="cpu" (and move the model to a device this machine has)'
        )
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of files it then refuses
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and head == b"PK")
    except pickle.UnpicklingError as exc:
        code = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if code:
            raise BundleError(
                f"{what} {path} was refused: it contains pickled Python objects ({code.group(1)}) that could "
                "run code when loaded; only weights-only files (tensors and plain data) are loaded"
            ) from None
        raise BundleError(f"{what} {path} is truncated or corrupt, or not a weights-only torch file") from None
    except Exception as exc:  # torch raises many types (RuntimeError, EOFError, KeyError, ...)
        reason = first_line(exc, first_sentence=True, with_type=True)
        raise BundleError(f"{what} {path} is truncated or corrupt ({reason})") from None
