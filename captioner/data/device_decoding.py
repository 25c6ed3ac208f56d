"""JPEGs decoded on the device the model runs on (``data.decode``, ``captioner caption --decode``).

A DataLoader worker only reads an image file's bytes and checks its header (``read_for_device``); the model's
device decodes a batch's JPEGs in one call (``decode_jpegs``: ``torchvision.io.decode_jpeg``, nvjpeg on CUDA,
libjpeg-turbo on a CPU) and turns them upright by their EXIF orientation; the caller preprocesses them with the
transform the loader applies to a picture Pillow decoded (``dataset.build_transform``: resize, normalise), so a
batch has the shapes it has today and, on a CPU, values within one grey level of them (``docs/datasets.md#gpu``).

What the device might not decode as Pillow does is left to Pillow, image by image: in the worker an image whose
header says so (PNG and every other format; CMYK, progressive, 12-bit and RGB-coded JPEGs; a JPEG over
``max_pixels``, which Pillow reads at a reduced scale; one whose bytes do not end with its end marker), in the
calling process one the device refuses (corrupt data). An image Pillow cannot read either is the ImageError
``load_rgb`` raises, so an unreadable image is skipped and counted as before. ``DecodeTally`` counts where each
image was decoded, and why Pillow decoded it.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import ExifTags, Image, ImageFile
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2.functional import pil_to_tensor

from captioner.config import ImageDecoding
from captioner.data.images import ImageError, load_rgb, open_header, read_bytes
from captioner.errors import check_range

# torchvision 0.29 deprecates its image decoders for TorchCodec's, which the project's stack does not hold; the
# warning comes with every call
warnings.filterwarnings(
    "ignore", message="The image decoding and encoding capabilities of TorchVision", category=DeprecationWarning
)

END_OF_IMAGE = b"\xff\xd9"  # the marker a whole JPEG file ends with
DEVICE_MODES = ("L", "RGB")  # the JPEG colour modes the device decodes: grey and YCbCr
REFUSED = "JPEG the device could not decode"  # why Pillow decoded a JPEG after the device failed on it


def on_device(decode: ImageDecoding, device: torch.device) -> bool:
    """Whether the setting ``decode`` has the model's ``device`` decode JPEGs: ``device`` always, ``auto`` on CUDA."""
    return decode == ImageDecoding.device or (decode == ImageDecoding.auto and device.type == "cuda")


@dataclass(frozen=True)
class Encoded:
    """A JPEG's bytes, read by a loader worker for the device to decode (``decode_jpegs``)."""

    path: str  # the file (or a shard's member) as errors name it
    data: torch.Tensor  # (N,) uint8: the file's bytes
    orientation: int  # its EXIF orientation: 1 upright as stored, 2 to 8 mirrored or turned (``upright``)
    max_pixels: int | None  # the pixel limit Pillow reads it with should the device refuse it (``load_rgb``)


@dataclass(frozen=True)
class Pillowed:
    """An image Pillow decoded in the worker, and why not the device (its format, ``read_for_device``)."""

    image: Any  # the RGB picture ``load_rgb`` gave, or what the worker made of it (its preprocessed pixels)
    reason: str  # "PNG", "progressive JPEG", ...


def read_for_device(
    path: str | Path, max_pixels: int | None = None, size: int | None = None, data: bytes | None = None
) -> Encoded | Pillowed:
    """The image file ``path`` (or its bytes ``data``, read elsewhere) as ``Encoded`` bytes for the device when it is
    a JPEG the device decodes as Pillow does, else decoded by Pillow now (``load_rgb`` with ``max_pixels`` and
    ``size``) with the reason. Raises ImageError where ``load_rgb`` does: a missing, empty or unreadable file, one
    that is not an image, one over the pixel limit (a JPEG over it read at a reduced scale instead, as there)."""
    name = os.fspath(path)  # as given: a dataset's Skipped names it so
    if data is None:
        path = Path(path)
        data = read_bytes(path)
    elif not data:
        raise ImageError(path, "file is empty")
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    check_range("max_pixels", limit, 1, kind=int)
    reason, orientation = _header(path, data, limit)
    if reason is None:
        return Encoded(name, torch.frombuffer(bytearray(data), dtype=torch.uint8), orientation, max_pixels)
    return Pillowed(load_rgb(path, max_pixels, size, data=data), reason)


def _header(path: str | Path, data: bytes, limit: int) -> tuple[str | None, int]:
    """Why the device may not decode ``data`` as Pillow does (None: it may), and its EXIF orientation (1 when
    none, or when Pillow decodes it)."""
    try:
        with open_header(path, data) as image:
            reason = _refusal(image, limit)
            orientation = image.getexif().get(ExifTags.Base.Orientation, 1) if reason is None else 1
    except Exception:  # Pillow's header readers raise many kinds; load_rgb says what is wrong with the file
        return "not identified by its header", 1
    if reason is None and not data.endswith(END_OF_IMAGE):
        reason = "JPEG whose bytes do not end with its end marker"
    return reason, orientation if isinstance(orientation, int) else 1


def _refusal(image: ImageFile.ImageFile, limit: int) -> str | None:
    """Why the device may not decode the opened ``image`` as Pillow does, by its header; None when it may."""
    if image.format != "JPEG":
        return image.format or "not a JPEG"
    if image.mode not in DEVICE_MODES:
        return f"{image.mode} JPEG"
    if image.info.get("progressive"):
        return "progressive JPEG"
    if getattr(image, "bits", 8) != 8:
        return f"{image.bits}-bit JPEG"
    if image.info.get("adobe_transform") == 0 and image.mode == "RGB":
        return "RGB-coded JPEG"  # Adobe's marker: its channels are R, G, B, not Y, Cb, Cr
    width, height = image.size
    if width * height > limit:
        return "JPEG over max_pixels"  # Pillow reads it at a reduced scale (load_rgb)
    return None


def decode_jpegs(
    encoded: Sequence[Encoded], device: torch.device, tally: DecodeTally
) -> list[torch.Tensor | ImageError]:
    """Each of ``encoded`` as the uint8 RGB image (3, H, W) ``load_rgb`` gives, on ``device``, upright: the device
    decodes them all in one call; one it refuses is decoded by Pillow, one Pillow refuses too is its ImageError
    (in its place in the list). Counted in ``tally``."""
    if not encoded:
        return []
    try:
        images: list[torch.Tensor | None] = decode_jpeg(
            [item.data for item in encoded], mode=ImageReadMode.RGB, device=device
        )
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:  # one bad file fails the whole call, which returns nothing: each on its own
        images = [_alone(item, device) for item in encoded]
    decoded: list[torch.Tensor | ImageError] = []
    for item, image in zip(encoded, images):
        if image is None:
            decoded.append(_by_pillow(item, device, tally))
        else:
            tally.add(None)
            decoded.append(upright(image, item.orientation))
    return decoded


def _alone(item: Encoded, device: torch.device) -> torch.Tensor | None:
    """``item`` decoded on ``device`` (3, H, W), or None when the device refuses it."""
    try:
        return decode_jpeg(item.data, mode=ImageReadMode.RGB, device=device)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        return None


def _by_pillow(item: Encoded, device: torch.device, tally: DecodeTally) -> torch.Tensor | ImageError:
    """``item`` decoded by Pillow (``load_rgb``) as a uint8 (3, H, W) on ``device``, or its ImageError."""
    try:
        picture = load_rgb(item.path, item.max_pixels, data=item.data.numpy().tobytes())
    except ImageError as exc:
        return exc
    tally.add(REFUSED)
    return pil_to_tensor(picture).to(device)


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """``image`` (C, H, W) as stored turned as its EXIF ``orientation`` says, as ``PIL.ImageOps.exif_transpose``
    turns it: 2 mirrored, 3 turned half round, 4 flipped, 5 transposed, 6 turned a quarter clockwise, 7
    transversed, 8 a quarter anticlockwise; 1 and any other value as it is."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-2, -1)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-2, -1)
    if orientation == 6:
        return torch.rot90(image, -1, (-2, -1))
    if orientation == 7:
        return image.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:
        return torch.rot90(image, 1, (-2, -1))
    return image


@dataclass
class DecodeTally:
    """Where images were decoded: on the device, or by Pillow (and why), for one line of report."""

    on_device: int = 0
    by_pillow: Counter[str] = field(default_factory=Counter)  # reason -> images

    def add(self, reason: str | None) -> None:
        """One image: decoded on the device (``reason`` None), or by Pillow for ``reason``."""
        if reason is None:
            self.on_device += 1
        else:
            self.by_pillow[reason] += 1

    def report(self, device: torch.device | str) -> str:
        """``"images decoded on cuda:0: 1,250 JPEGs; by Pillow: 12 (10 PNG, 2 progressive JPEG)"``; "" for none."""
        if not self.on_device and not self.by_pillow:
            return ""
        reasons = ", ".join(f"{count:,} {reason}" for reason, count in self.by_pillow.most_common())
        pillow = f"; by Pillow: {self.by_pillow.total():,} ({reasons})" if self.by_pillow else ""
        plural = "" if self.on_device == 1 else "s"
        return f"images decoded on {device}: {self.on_device:,} JPEG{plural}{pillow}"
