"""What the ``captioner`` command's tests share: untrained bundles whose captions only name shapes (``bundles``),
a folder of images in every mode and format Pillow reads with bad files among them (``inputs``), a small shapes
dataset (``shapes``), and checks of the one-line errors and the closing summary on stderr. conftest.py registers
this module as a plugin, so its fixtures reach every test file of the command."""

from __future__ import annotations

import io
import re
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.config import ShapesSpec
from captioner.data.shapes import generate_shapes
from conftest import write_bundle

WORDS = ["a", "red", "blue", "green", "circle", "square", "triangle", "left", "of", "above"]
SHAPE_WORDS = ("circle", "square", "triangle")
MAX_LEN = "3"
QUICK = ["--max-len", MAX_LEN, "--workers", "0"]  # how the CLI tests decode: 3 words, in this process


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, str]:
    """Untrained bundles (soft and hard attention) whose captions never end and only name shapes: exactly
    --max-len words, and object words for attention correctness."""
    folder = tmp_path_factory.mktemp("bundles")
    return {
        mode: str(write_bundle(folder / f"{mode}.pt", WORDS, mode, favoured=SHAPE_WORDS)) for mode in ("soft", "hard")
    }


def noise(size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    """A noise image of ``size`` in ``mode``."""
    return Image.effect_noise(size, 60).convert(mode)


def _saver(size: tuple[int, int], mode: str = "RGB", **options) -> Callable[[Path], None]:
    return lambda path: noise(size, mode).save(path, **options)


def _array(values: np.ndarray) -> Callable[[Path], None]:
    return lambda path: Image.fromarray(values).save(path)


def _two_frames(path: Path) -> None:
    noise((30, 20)).save(path, save_all=True, append_images=[Image.new("RGB", (30, 20), (255, 0, 0))])


def _exif_rotated(path: Path) -> None:
    image = noise((40, 20))
    exif = image.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    image.save(path, exif=exif.tobytes())


def _transparent_palette(path: Path) -> None:
    noise((16, 16)).convert("P").save(path, transparency=0)


def _truncated_jpeg(path: Path) -> None:
    buffer = io.BytesIO()
    noise((64, 64)).save(buffer, "JPEG")
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])


def _bomb(path: Path) -> None:
    """A 60-byte PNG that claims 30000 x 30000 pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


# Every mode and format Pillow reads, odd sizes; bad files interleaved (name -> maker, or (maker, reason)).
GOOD: dict[str, Callable[[Path], None]] = {
    "01_grey.png": _saver((32, 24), "L"),
    "02_bilevel.png": _saver((32, 24), "1"),
    "04_grey_alpha.png": _saver((32, 24), "LA"),
    "05_palette.png": _saver((32, 24), "P"),
    "07_palette_transparent.png": _transparent_palette,
    "08_rgba.png": _saver((32, 24), "RGBA"),
    "10_cmyk.jpg": _saver((32, 24), "CMYK"),
    "11_16bit.png": _array(np.arange(600, dtype=np.uint16).reshape(20, 30) * 100),
    "13_int32.tif": _array(np.arange(600, dtype=np.int32).reshape(20, 30) * 1000),
    "14_float.tif": _array(np.linspace(0, 1, 600, dtype=np.float32).reshape(20, 30)),
    "16_progressive.jpg": _saver((64, 48), progressive=True, quality=80),
    "17_photo.webp": _saver((48, 32)),
    "18_animated.gif": _two_frames,
    "19_pages.tif": _two_frames,
    "20_exif_rotated.jpg": _exif_rotated,
    "21_one_pixel.png": _saver((1, 1)),
    "22_thin.png": _saver((3, 500)),
    "23_very_wide.jpg": _saver((2000, 6)),
    "24_wide.PNG": _saver((120, 40)),
    "25_bitmap.bmp": _saver((20, 20)),
}
BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "03_text.jpg": (lambda path: path.write_text("these are not the pixels you are looking for"), "not an image file"),
    "06_empty.png": (lambda path: path.write_bytes(b""), "file is empty"),
    "09_truncated.jpg": (_truncated_jpeg, "truncated or corrupt image data"),
    "15_bomb.png": (_bomb, "decompression bomb"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[str], dict[str, str]]:
    """A folder of good and bad images (and a text file a folder scan skips): (folder, good paths in
    order, bad path -> reason)."""
    folder = tmp_path_factory.mktemp("inputs") / "photos"
    folder.mkdir()
    for name, make in GOOD.items():
        make(folder / name)
    for name, (make, _) in BAD.items():
        make(folder / name)
    (folder / "notes.txt").write_text("not an image, and not named like one")
    return folder, [str(folder / name) for name in sorted(GOOD)], {str(folder / n): r for n, (_, r) in BAD.items()}


def before_summary(err: str, captioned: int, failed: int, skipped: int = 0) -> list[str]:
    """The lines of ``err`` before its closing summary line, which must give these counts."""
    *lines, last = err.splitlines()
    assert re.fullmatch(
        rf"summary: {captioned} captioned, {failed} failed, {skipped} skipped( \(.*\))?, \d+\.\d images/s", last
    ), last
    return lines


def one_error_line(err: str, path: object, reason: str) -> None:
    """``err`` is one line, no traceback: "error: ", naming ``path`` and saying ``reason``."""
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and str(path) in lines[0] and reason in lines[0], lines[0]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("data") / "shapes", ShapesSpec(n_train=20, n_val=6, n_test=6))
