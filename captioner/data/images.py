"""Decode any image file Pillow can read into an 8-bit RGB image, or fail with one clear line; bring an
image given in memory (a PIL image or an image tensor) to the same form."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.transforms.v2.functional import to_pil_image

from captioner.errors import DataError, first_line

_INTEGER_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_WHITE = (255, 255, 255, 255)


class ImageError(DataError):
    """An image file is missing, unreadable or corrupt; prints as ``<path>: <reason>``."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(str(path), reason)
        self.path = str(path)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def load_rgb(path: str | Path) -> Image.Image:
    """Decode ``path`` fully into an RGB image, upright according to its EXIF orientation.

    Every Pillow mode is handled: transparency is composited on white, 16-bit and 32-bit integer
    images are scaled (not clipped) to 8 bits, float images are mapped to [0, 255]. Multi-frame files
    (GIF, TIFF, WebP) give their first frame. Raises ImageError for a missing, empty, truncated or
    corrupt file, a directory, a file that is not an image, or one over Pillow's pixel limit.
    """
    path = Path(path)
    _check_file(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.load()
                return _to_rgb(ImageOps.exif_transpose(image))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        reason = f"image too large, refused as a possible decompression bomb ({first_line(exc)})"
        raise ImageError(path, reason) from None
    except UnidentifiedImageError:
        raise ImageError(path, "not an image file (Pillow cannot identify its format)") from None
    except PermissionError:
        raise ImageError(path, "permission denied") from None
    except Exception as exc:  # Pillow's decoders raise OSError, SyntaxError, ValueError, EOFError, ...
        raise ImageError(path, f"truncated or corrupt image data ({first_line(exc)})") from None


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
    tensor of another shape or range.
    """
    if isinstance(image, Image.Image):
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
        raise ImageError(path, "file not found")
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
