"""The pictures of a caption's attention that ``captioner attend`` writes. The sheet (its overlay): the caption,
the image, then each word's panel under its word, and the colour bar of the caption's brightness scale with
uniform attention (1/L) marked, the same scale the gallery's legend gives. The strip (a gallery's): every
panel at its own size in one picture, which the gallery's pages crop to one word at a time: one file an image
instead of one a word (creating a file costs about as much as encoding a panel).

Drawn with Pillow on a white canvas in a few milliseconds (a matplotlib figure of 20 panels took seconds);
the text is matplotlib's DejaVu Sans, so that no font has to be installed.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from matplotlib import font_manager
from PIL import Image, ImageDraw, ImageFont, ImageOps
from torch import Tensor

from captioner.fileio import atomic_write
from captioner.viz.overlay import ASPECT_RANGE, DIM_FLOOR, MAX_COLUMNS, Shading, shade

CELL = 200  # a panel's width on the sheet (pixels); its height follows the image's, within ASPECT_RANGE
GAP = 12  # pixels between panels and round the edges
TEXT = 16  # the words' and the caption's font size (pixels)
SMALL = 14  # the colour bar's labels
BAR = (18, 110)  # the colour bar's width, and the room beside it for its labels (pixels)
PNG_LEVEL = 1  # zlib level: 1 writes several times faster than Pillow's default 6, for slightly larger files
JPEG_QUALITY = 90  # a gallery's sheets and panels are JPEG (4:4:4, so that thin red outlines stay red): ~10x
# faster to write than PNG, and a tenth of the size for photos
INK, MARK = (34, 34, 34), (230, 120, 0)  # the text's colour; the 1/L mark's (orange)
BLOCK = 8  # a strip's panels start on JPEG's 8 x 8 blocks (4:4:4), so that no block mixes two panels
JPEG_SIDE = 65_535  # JPEG's longest side (pixels)


@dataclass(frozen=True)
class Strip:
    """Where the panels of a strip lie: ``count`` panels of ``size``, in rows of ``columns``, panel k at column
    k % columns and row k // columns, each ``stride`` from the last (its size rounded up to whole blocks)."""

    size: tuple[int, int]  # one panel's (width, height), pixels
    count: int  # panels, one per word

    @property
    def stride(self) -> tuple[int, int]:
        """The distance from one panel's corner to the next one's, across and down (pixels)."""
        return (-(-self.size[0] // BLOCK) * BLOCK, -(-self.size[1] // BLOCK) * BLOCK)

    @property
    def columns(self) -> int:
        """Panels per row: MAX_COLUMNS, or more where that many rows would pass JPEG's limit."""
        return max(1, min(self.count, max(MAX_COLUMNS, math.ceil(self.count / (JPEG_SIDE // self.stride[1])))))

    @property
    def rows(self) -> int:
        """Rows of panels, the last one perhaps short."""
        return math.ceil(self.count / self.columns)

    @property
    def picture_size(self) -> tuple[int, int]:
        """The strip's (width, height) in pixels."""
        return (self.columns * self.stride[0], self.rows * self.stride[1])

    def corner(self, step: int) -> tuple[int, int]:
        """The top-left pixel of panel ``step`` (from 0)."""
        row, column = divmod(step, self.columns)
        return (column * self.stride[0], row * self.stride[1])


@dataclass(frozen=True)
class Layout:
    """How a sheet is laid out: its panels' width, how many a row (the image counts as one), and whether the colour
    bar is drawn beside them. The text keeps its size (TEXT), so a narrower sheet shown smaller stays legible."""

    cell: int = CELL  # a panel's width (pixels)
    columns: int = MAX_COLUMNS  # panels a row
    bar: bool = True  # the colour bar of the caption's brightness scale


SHEET = Layout()  # the sheet `captioner attend` writes


@functools.lru_cache(maxsize=4)
def font(size: int) -> ImageFont.FreeTypeFont:
    """DejaVu Sans (matplotlib's own copy) at ``size`` pixels."""
    return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)


def _fit(text: str, width: int, face: ImageFont.FreeTypeFont) -> str:
    """``text``, cut with an ellipsis where it is wider than ``width`` pixels."""
    if face.getlength(text) <= width:
        return text
    while text and face.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


@functools.lru_cache(maxsize=4096)
def _label(text: str, width: int, height: int, size: int) -> tuple[Image.Image, tuple[int, int]]:
    """``text`` (cut to ``width`` pixels) centred in a ``width`` x ``height`` box, as a mask (mode L) to paste
    ink through, cropped to the text, and the crop's corner in the box: a caption's words come back in every
    sheet, drawn once each."""
    mask = Image.new("L", (width, height), 0)
    face = font(size)
    ImageDraw.Draw(mask).text((width // 2, height // 2), _fit(text, width, face), fill=255, font=face, anchor="mm")
    box = mask.getbbox() or (0, 0, 1, 1)
    return mask.crop(box), box[:2]


def _ink(canvas: Image.Image, colour: tuple[int, int, int], corner: tuple[int, int], label: tuple) -> None:
    """Paste ``colour`` through the mask of ``label`` (:func:`_label`) into ``canvas``, its box at ``corner``."""
    mask, (left, top) = label
    canvas.paste(
        colour, (corner[0] + left, corner[1] + top, corner[0] + left + mask.width, corner[1] + top + mask.height), mask
    )


def _lines(text: str, width: int, face: ImageFont.FreeTypeFont) -> list[str]:
    """``text`` wrapped at spaces into lines of at most ``width`` pixels (a longer word is cut)."""
    joined = " ".join(text.split())
    if face.getlength(joined) <= width:  # one line: measured once, not word by word
        return [joined] if joined else []
    lines: list[str] = []
    for word in text.split():
        if lines and face.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(_fit(word, width, face))
    return lines


def _colour_bar(canvas: Image.Image, left: int, top: int, height: int, shading: Shading) -> None:
    """The brightness scale from 0 (bottom, dimmed) to the caption's highest weight per cell (top, as is),
    with uniform attention (1/L) marked by an orange line and its value."""
    draw = ImageDraw.Draw(canvas)
    width = BAR[0]
    level = np.linspace(1.0, DIM_FLOOR, height, dtype=np.float32)  # top row: as is; bottom: DIM_FLOOR
    strip = np.repeat((level * 255).round().astype(np.uint8)[:, None], width, axis=1)
    canvas.paste(Image.fromarray(strip).convert("RGB"), (left, top))
    draw.rectangle((left - 1, top - 1, left + width, top + height), outline=(120, 120, 120))
    face = font(SMALL)
    draw.text((left + width + 6, top), f"{shading.top:.3g}", fill=INK, font=face, anchor="lm")
    draw.text((left + width + 6, top + height), "0", fill=INK, font=face, anchor="lm")
    mark = top + round((1.0 - shading.uniform / shading.top) * (height - 1))
    draw.line((left - 5, mark, left + width + 4, mark), fill=MARK, width=3)
    shift = SMALL if mark - top < SMALL else -SMALL if top + height - mark < SMALL else 0  # clear of 0 and the top
    label = f"1/L = {shading.uniform:.3g}"
    draw.text((left + width + 6, mark + shift), label, fill=MARK, font=face, anchor="lm")
    mask, (along, across) = _label("attention weight per cell", height, SMALL + 4, SMALL)
    _ink(canvas, INK, (left - SMALL - 12, top), (mask.rotate(90, expand=True), (across, height - along - mask.width)))


def _enlarged(picture: Image.Image, box: tuple[int, int]) -> Image.Image:
    """``picture`` fitted in ``box``: a small one enlarged by the largest whole factor that fits, each pixel a
    square block (sharp, as the gallery's pages show it, and a twelfth of a bilinear resize's time), any other
    resized bilinearly (ImageOps.contain)."""
    factor = min(box[0] // picture.width, box[1] // picture.height)
    if factor >= 2:
        return picture.resize((picture.width * factor, picture.height * factor), Image.Resampling.NEAREST)
    return ImageOps.contain(picture, box, Image.Resampling.BILINEAR)


def draw_overlay(
    image: Image.Image,
    words: Sequence[str],
    alphas: Tensor | np.ndarray,
    grid: tuple[int, int],
    out_path: str | os.PathLike,
    locations: Sequence[int] | None = None,
    title: str | None = None,
) -> Shading:
    """Write the panels of :func:`captioner.viz.overlay.shade` as one sheet at ``out_path`` (:func:`write_sheet`):
    the image, then one panel per word under its word, the colour bar of the caption's scale; return the
    shading, whose panels a gallery shows one at a time."""
    shading = shade(image, words, alphas, grid, locations)
    write_sheet(shading, words, out_path, title)
    return shading


def write_sheet(shading: Shading, words: Sequence[str], out_path: str | os.PathLike, title: str | None) -> Path:
    """Write the sheet of ``shading`` (:func:`sheet_picture`) at ``out_path`` (``save_picture``: PNG or JPEG by its
    suffix); return the path."""
    return save_picture(sheet_picture(shading, words, title), out_path)


def sheet_picture(shading: Shading, words: Sequence[str], title: str | None, layout: Layout = SHEET) -> Image.Image:
    """The sheet of ``shading``: ``title`` (each of its lines wrapped to the sheet's width), the image, one panel
    per word of ``words`` under its word, and the colour bar of the caption's brightness scale, as ``layout``
    lays them out."""
    width, height = shading.picture.size
    cell = layout.cell
    cell_height = round(cell * min(max(height / width, ASPECT_RANGE[0]), ASPECT_RANGE[1]))
    label = TEXT + 8
    pictures = [shading.picture, *shading.panels]
    columns = min(layout.columns, len(pictures))
    rows = math.ceil(len(pictures) / columns)
    text = font(TEXT)
    panels_width = columns * cell + (columns + 1) * GAP
    bar_room = BAR[0] + BAR[1] + SMALL + 12 if words and layout.bar else 0
    paragraphs = title.splitlines() if title else []
    title_lines = [line for part in paragraphs for line in _lines(part, panels_width + bar_room - 2 * GAP, text)]
    head = len(title_lines) * (TEXT + 6) + (GAP if title_lines else 0)
    grid_height = rows * (label + cell_height + GAP)
    canvas = Image.new("RGB", (panels_width + bar_room, head + grid_height + GAP), "white")
    draw = ImageDraw.Draw(canvas)
    for line, content in enumerate(title_lines):
        draw.text((GAP, GAP + line * (TEXT + 6)), content, fill=INK, font=text)
    for index, picture in enumerate(pictures):
        row, column = divmod(index, columns)
        left = GAP + column * (cell + GAP)
        top = head + GAP + row * (label + cell_height + GAP)
        name = "image" if index == 0 else words[index - 1]
        _ink(canvas, (120, 120, 120) if index == 0 else INK, (left, top), _label(name, cell, label, TEXT))
        shown = _enlarged(picture, (cell, cell_height))
        canvas.paste(shown, (left + (cell - shown.width) // 2, top + label + (cell_height - shown.height) // 2))
    if bar_room:
        bar_height = max(3 * SMALL, round(0.8 * (grid_height - GAP)))
        bar_top = head + GAP + (grid_height - GAP - bar_height) // 2
        _colour_bar(canvas, panels_width + SMALL + 12, bar_top, bar_height, shading)
    return canvas


def strip_picture(shading: Shading) -> Image.Image:
    """The panels of ``shading`` in one picture, where :class:`Strip` says (white between them)."""
    strip = Strip(shading.picture.size, len(shading.panels))
    canvas = Image.new("RGB", strip.picture_size, "white")
    for step, panel in enumerate(shading.panels):
        canvas.paste(panel, strip.corner(step))
    return canvas


def save_picture(picture: Image.Image, path: str | os.PathLike) -> Path:
    """Write ``picture`` atomically (not fsynced: a gallery writes many) as a PNG (a ``.png`` path) or else a
    JPEG of JPEG_QUALITY; return the path."""
    path = Path(path)
    with atomic_write(path, "wb", durable=False) as handle:
        if path.suffix.lower() == ".png":
            picture.save(handle, format="PNG", compress_level=PNG_LEVEL)
        else:
            write_jpeg(picture, handle)
    return path


def write_jpeg(picture: Image.Image, handle: BinaryIO) -> None:
    """``picture`` into ``handle`` as a gallery's JPEG: JPEG_QUALITY, no chroma subsampling."""
    picture.save(handle, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
