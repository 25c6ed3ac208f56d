"""Decode any image file Pillow can read into an 8-bit RGB image, or fail with one clear line; bring an
image given in memory (a PIL image or an image tensor) to the same form."""

from __future__ import annotations

import io
import os
import struct
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError
from torchvision.transforms.v2.functional import to_pil_image

from captioner.errors import DataError, check_range, first_line

_INTEGER_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
# The brands of an ISO media file (bytes 8-12, after "ftyp") that say HEIF: an iPhone's HEIC photos, which Pillow reads
# only with the pillow-heif plugin (AVIF, HEIF's AV1 kind, it reads itself)
HEIF_BRANDS = (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1", b"msf1")
_WHITE = (255, 255, 255, 255)
# Decodes past Pillow's own limit take turns: silencing its warning changes the process's warning filters.
_PAST_PILLOW_S_LIMIT = threading.Lock()


class ImageError(DataError):
    """An image file is missing, unreadable or corrupt; prints as ``<path>: <reason>``."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(str(path), reason)
        self.path = str(path)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def load_rgb(
    path: str | Path, max_pixels: int | None = None, size: int | None = None, data: bytes | None = None
) -> Image.Image:
    """Decode ``path`` fully into an RGB image, upright according to its EXIF orientation.

    ``data``: the file's bytes, read elsewhere (a member of a tar shard); ``path`` then only names it in errors.

    Every Pillow mode is handled: transparency is composited on white, 16-bit and 32-bit integer
    images are scaled (not clipped) to 8 bits, float images are mapped to [0, 255]. Multi-frame files
    (GIF, TIFF, WebP) give their first frame. Raises ImageError for a missing, empty, truncated or
    corrupt file, a directory, a file that is not an image, or one over the pixel limit.

    The limit guards against decompression bombs (a small file that claims a huge image): ``max_pixels``
    pixels decoded at most (None: Pillow's ``Image.MAX_IMAGE_PIXELS``, 89,478,485). A JPEG over it is decoded
    at a reduced scale by libjpeg (1/2, 1/4 or 1/8: Pillow's ``draft``): with ``size`` (the model's input side)
    the smallest that keeps each side at least ``size`` (a 12000x9000 photo is read as 1500x1125 for 224), else
    the largest that brings it under the limit (6000x4500). Another format over the limit is refused.
    Pillow's own limit is never changed (it is the process's, and threads decode at once); its TIFF, WebP and
    GIF decoders check it as well, so a ``max_pixels`` above it lets such a file through only up to twice it,
    without Pillow's ``DecompressionBombWarning`` (``max_pixels`` allowed it: the warning would tell the user
    nothing but print a source line).
    """
    if data is None:
        path = Path(path)
        _check_file(path)
    elif not data:
        raise ImageError(path, "file is empty")
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    check_range("max_pixels", limit, 1, kind=int)
    try:
        with open_header(path, data) as image:  # the header read: the limit is checked below, on what is decoded
            full = image.size
            if full[0] * full[1] > limit:
                image.draft("RGB", _draft_size(full, limit, size))  # JPEG only; other formats decode whole
            _check_pixels(image.size, full, limit)
            with _allowed_past_pillow_s_limit(image.size):
                image.load()
            return _to_rgb(ImageOps.exif_transpose(image))
    except ImageTooLarge as exc:
        raise ImageError(path, str(exc)) from None
    except Image.DecompressionBombError as exc:  # over Pillow's own limit, which some of its decoders check
        raise ImageError(
            path,
            f"image too large: {first_line(exc)} (Pillow's own limit, PIL.Image.MAX_IMAGE_PIXELS, which its "
            "TIFF, WebP and GIF decoders check whatever max_pixels says)",
        ) from None
    except UnidentifiedImageError:
        raise ImageError(path, _unidentified(path, data)) from None
    except PermissionError:
        raise ImageError(path, "permission denied") from None
    except Exception as exc:  # Pillow's decoders raise OSError, SyntaxError, ValueError, EOFError, ...
        raise ImageError(path, f"truncated or corrupt image data ({first_line(exc)})") from None


@contextmanager
def _allowed_past_pillow_s_limit(decoded: tuple[int, int]) -> Iterator[None]:
    """Decode an image of ``decoded`` (width, height), which ``max_pixels`` allowed, without Pillow's
    DecompressionBombWarning when it is past Pillow's own limit (some of its decoders, TIFF's, check that limit
    themselves). ``warnings.catch_warnings`` sets the process's filters: such decodes take turns, and another
    thread's DecompressionBombWarning meanwhile is not shown; a decode within Pillow's limit never waits."""
    if Image.MAX_IMAGE_PIXELS is None or decoded[0] * decoded[1] <= Image.MAX_IMAGE_PIXELS:
        yield
        return
    with _PAST_PILLOW_S_LIMIT, warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def read_bytes(path: str | Path) -> bytes:
    """The bytes of the image file ``path``, unread by any decoder; ImageError as ``load_rgb`` raises it for a missing,
    empty or unreadable file, a directory or another thing that is not a regular file."""
    path = Path(path)
    _check_file(path)
    try:
        return path.read_bytes()
    except PermissionError:
        raise ImageError(path, "permission denied") from None
    except OSError as exc:
        raise ImageError(path, f"cannot read the file ({first_line(exc)})") from None


class ImageTooLarge(Exception):
    """An image over the pixel limit (inside ``load_rgb``, which names the file)."""


def open_header(path: str | Path, data: bytes | None = None) -> ImageFile.ImageFile:
    """``path`` (or its bytes ``data``, read elsewhere) opened as ``Image.open`` opens a file (its format found, its
    header read, nothing decoded) but
    without ``Image.open``'s check of its size against Pillow's process-wide ``Image.MAX_IMAGE_PIXELS``:
    ``load_rgb`` checks its own limit, before decoding, and setting Pillow's for one call would race with other
    threads' calls (and change it for all the process's code meanwhile), and a gallery's or a folder listing's look
    at a very large photo would warn or raise. UnidentifiedImageError for no format, OSError for no file."""
    path = Path(path)
    Image.init()  # every format's opener registered
    if data is None:
        with path.open("rb") as file:
            prefix = file.read(16)
    else:
        prefix = data[:16]
    for name in Image.ID:
        opener, accept = Image.OPEN[name]
        claimed = accept is None or accept(prefix)
        if not claimed or isinstance(claimed, str):  # a string: why it may not be this format
            continue
        try:
            return opener(os.fspath(path) if data is None else io.BytesIO(data), os.fspath(path))
        except (SyntaxError, IndexError, TypeError, struct.error):  # not this format after all, as Image.open has it
            continue
    raise UnidentifiedImageError(f"cannot identify image file {os.fspath(path)!r}")


def _unidentified(path: Path, data: bytes | None) -> str:
    """Why Pillow found no format for the file ``path`` (or its bytes ``data``): a HEIF photo's, or no image's."""
    if data is None:
        with path.open("rb") as file:
            data = file.read(12)
    if data[4:8] == b"ftyp" and data[8:12] in HEIF_BRANDS:
        return "a HEIF/HEIC photo, which Pillow decodes only with the pillow-heif plugin: convert it to JPEG first"
    return "not an image file (Pillow cannot identify its format)"


def _draft_size(full: tuple[int, int], limit: int, size: int | None) -> tuple[int, int]:
    """The (width, height) to ask libjpeg for, which decodes at the largest of 1/2, 1/4, 1/8 that keeps both
    sides at least this: ``size`` by ``size`` when given, else the image at the least of those scales that
    brings it under ``limit`` pixels (1/8 when none does). At 1/s libjpeg decodes ceil(W / s) x ceil(H / s), so
    that is what the limit is held against; asking for floor(W / s) x floor(H / s) gets scale s."""
    if size is not None:
        return size, size
    scale = next((s for s in (2, 4, 8) if -(-full[0] // s) * -(-full[1] // s) <= limit), 8)
    return max(1, full[0] // scale), max(1, full[1] // scale)


def _check_pixels(decoded: tuple[int, int], full: tuple[int, int], limit: int) -> None:
    """ImageTooLarge when the ``decoded`` (width, height) of an image of ``full`` size is over ``limit`` pixels."""
    pixels = decoded[0] * decoded[1]
    if pixels <= limit:
        return
    scale = f" (at 1/{round(full[0] / decoded[0])} scale: {decoded[0]}x{decoded[1]})" if decoded != full else ""
    raise ImageTooLarge(
        f"image too large: {full[0]}x{full[1]}{scale} is {pixels:,} pixels, over the limit of {limit:,}, refused as "
        "a possible decompression bomb; for a file you trust raise the limit with --max-pixels N "
        "(max_pixels=N in Python)"
    )


def images_present(paths: Sequence[str]) -> list[str]:
    """The paths of ``paths`` that are files, in order; each folder listed once (fast for a split of 100,000)."""
    listed: dict[str, set[str]] = {}
    found = []
    for path in paths:
        folder, name = os.path.split(path)
        if folder not in listed:
            listed[folder] = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        if name in listed[folder] and os.path.isfile(path):
            found.append(path)
    return found


def none_found(label: str, paths: Sequence[str]) -> str:
    """The line for a dataset none of whose images ``paths`` is there (``images_present`` found none), saying so
    rather than that they do not decode: ``"val: 0 of 5,000 images found under data/coco/val2014 (e.g.
    data/coco/val2014/COCO_val2014_000000000042.jpg)"``. Training's preflight and ``captioner evaluate`` say it."""
    under = os.path.commonpath([os.path.dirname(path) for path in paths])
    return f"{label}: 0 of {len(paths):,} images found under {under} (e.g. {paths[0]})"


def to_rgb(image: Image.Image | torch.Tensor) -> Image.Image:
    """An image given in memory as the 8-bit RGB image ``load_rgb`` would give for its file.

    A PIL image of any mode is converted as ``load_rgb`` converts a decoded file (upright by its EXIF
    orientation). A tensor is a torchvision image, not normalised: (3, H, W) or (1, H, W), uint8 in
    [0, 255] or floating point in [0, 1]. Raises TypeError for another kind of object and ValueError for a
    tensor of another shape or range, or an image without pixels (0 wide or high: nothing to caption).
    """
    if isinstance(image, Image.Image):
        if 0 in image.size:
            raise ValueError(f"the image is {image.width}x{image.height} pixels: it has none to caption")
        return _to_rgb(ImageOps.exif_transpose(image))
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"an image is a file path, a PIL image or a tensor, not a {type(image).__name__}")
    if image.dim() != 3 or image.size(0) not in (1, 3) or image.size(1) == 0 or image.size(2) == 0:
        raise ValueError(f"an image tensor is (3, H, W) or (1, H, W), got {tuple(image.shape)}")
    image = image.detach().cpu()
    if image.is_floating_point():
        low, high = float(image.min()), float(image.max())
        if not (low >= 0.0 and high <= 1.0):
            raise ValueError(
                f"a floating-point image tensor holds values in [0, 1] (not normalised), got [{low:.3g}, {high:.3g}]"
            )
        image = (image.double() * 255.0).round().to(torch.uint8)  # the nearest level, as for 16-bit files
    elif image.dtype != torch.uint8:
        raise ValueError(f"an image tensor is uint8 or floating point, got {image.dtype}")
    return to_pil_image(image.expand(3, -1, -1))


def _check_file(path: Path) -> None:
    """Raise ImageError unless ``path`` is a non-empty regular file."""
    if not path.exists():
        gone = f"broken symbolic link: its target {os.readlink(path)} is not found" if path.is_symlink() else ""
        raise ImageError(path, gone or "file not found")
    if path.is_dir():
        raise ImageError(path, "is a directory, not an image file")
    if not path.is_file():
        raise ImageError(path, "is not a regular file")
    if path.stat().st_size == 0:
        raise ImageError(path, "file is empty")


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert a decoded image of any mode to RGB."""
    if image.mode in _INTEGER_MODES:
        return _grey(_scale_integer(np.asarray(image)))
    if image.mode == "F":
        return _grey(_scale_float(np.asarray(image)))
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    return image.convert("RGB")


def _grey(values: np.ndarray) -> Image.Image:
    """An RGB image from grey levels in [0, 255] (float array, rounded to the nearest level)."""
    return Image.fromarray(np.rint(values).astype(np.uint8), "L").convert("RGB")


def _scale_integer(values: np.ndarray) -> np.ndarray:
    """16-bit levels scaled by 255/65535; values outside [0, 65535] stretched from their own range."""
    values = values.astype(np.float64)
    if values.min() >= 0 and values.max() <= 65535:
        return values / 257.0
    return _stretch(values)


def _scale_float(values: np.ndarray) -> np.ndarray:
    """Floats in [0, 1] scaled by 255, in [0, 255] kept, anything else stretched from its range."""
    values = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if values.min() < 0 or values.max() > 255:
        return _stretch(values)
    return values * 255.0 if values.max() <= 1 else values


def _stretch(values: np.ndarray) -> np.ndarray:
    """Map the array's own [min, max] to [0, 255] (a constant array maps to 0)."""
    low, high = values.min(), values.max()
    return (values - low) * (255.0 / (high - low)) if high > low else np.zeros_like(values)
