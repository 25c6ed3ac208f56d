"""Attention overlays in the style of Show, Attend and Tell's figures: one panel per generated word.

The first panel is the image; each following panel has the word as its title and shows the image
dimmed where the attention used to emit that word is low. The (H, W) attention grid is upsampled
smoothly (bicubic) to the image's own size and aspect ratio (up to MAX_ASPECT: a panorama is stretched to
it; a tiny image is enlarged, CELL_PIXELS). All panels of a caption share one brightness scale, from no
attention (dimmed) to the caption's highest weight on a cell (as is), and a colour bar gives that scale with
uniform attention (1/L) marked: a flat map looks flat, a sharp one bright on its spot. For hard attention the
chosen cell is outlined.

:func:`shade` computes the panels once (one image per word, without titles or axes); :func:`overlay_figure` lays
them out as a matplotlib figure (for notebooks; the object-oriented API on an Agg canvas: no display, and no pyplot
figure registry to leak from); captioner.viz.sheet draws them as one PNG sheet with Pillow (a figure per image
costs seconds), importing this module's Shading and constants (this module imports nothing of it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from PIL import Image, ImageDraw
from torch import Tensor

MAX_COLUMNS = 5  # panels per row
MAX_SIDE = 448  # the image is shrunk to this longest side (pixels) before drawing
PANEL_INCHES = 2.4  # width of one panel
DIM_FLOOR = 0.15  # brightness left where a word puts no attention
DPI = 100
ASPECT_RANGE = (0.5, 2.0)  # a panel's height / width, whatever the image's
MAX_ASPECT = 8  # a picture at most this many times wider than high (or higher than wide); one beyond is stretched
# across to it: a 20000 x 20 panorama's panels are a band its attention shows in, not a line 1 pixel high
CELL_PIXELS = 2  # a smaller picture is enlarged by a whole factor (each pixel a block) until a grid cell covers this
# many pixels each way: a 1 x 1 image's panels show where each word looked, not one pixel of the mean


@functools.lru_cache(maxsize=64)
def _bicubic_weights(cells: int, pixels: int) -> np.ndarray:
    """The ``(pixels, cells)`` matrix that resamples ``cells`` values to ``pixels`` along one axis as torch's
    bicubic interpolation does (``align_corners=False``, edges clamped): 2-D bicubic is this along each axis."""
    basis = torch.eye(cells).reshape(cells, 1, cells, 1)  # unit impulses, one per cell, along the height
    rows = F.interpolate(basis, size=(pixels, 1), mode="bicubic", align_corners=False)  # (cells, 1, pixels, 1)
    return np.ascontiguousarray(rows[:, 0, :, 0].numpy().T)


def upsample_attention(alpha: Tensor | np.ndarray, grid: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
    """Bicubically upsample attention maps ``alpha`` ``(H*W,)`` or ``(T, H*W)`` to ``size = (width, height)``.

    Returns a float32 array ``(height, width)`` (or ``(T, height, width)``) of attention weight per cell (a
    uniform map stays 1/L everywhere), never negative, with cell (r, c) centred on its part of the image: no
    shift, whatever the grid or aspect ratio. Torch's bicubic, as two matrix products per map: a few small
    products in one thread, where ``F.interpolate`` waits on a pool of threads (ms on a busy machine).
    """
    rows, cols = grid
    width, height = size
    maps = torch.as_tensor(alpha).detach().to("cpu", torch.float32).numpy()
    grid_maps = maps.reshape(-1, rows, cols)  # (T, H, W)
    smooth = _bicubic_weights(rows, height) @ grid_maps @ _bicubic_weights(cols, width).T  # (T, height, width)
    np.maximum(smooth, 0.0, out=smooth)  # bicubic overshoots below zero
    return smooth if maps.ndim == 2 else smooth[0]


def _as_alphas(alphas: Tensor | np.ndarray, steps: int, grid: tuple[int, int]) -> np.ndarray:
    """Check and convert ``alphas`` to a float32 array ``(T, H*W)`` with ``T >= steps``."""
    array = torch.as_tensor(alphas).detach().to("cpu", torch.float32).numpy()
    cells = grid[0] * grid[1]
    if array.ndim != 2 or array.shape[1] != cells:
        raise ValueError(f"alphas must be (T, {cells}) for grid {tuple(grid)}, got {array.shape}")
    if array.shape[0] < steps:
        raise ValueError(f"alphas has {array.shape[0]} steps for {steps} words")
    return array


@dataclass(frozen=True)
class Shading:
    """The panels of one caption: the image, and per word the image dimmed where the word's attention is low,
    on the caption's one brightness scale from 0 (dimmed to DIM_FLOOR) to ``top`` (as is)."""

    picture: Image.Image  # the image, RGB, shrunk to at most MAX_SIDE pixels (``_drawn``)
    panels: tuple[Image.Image, ...]  # one per word, the picture's size; hard attention: the chosen cell outlined
    top: float  # the scale's top: the caption's highest upsampled weight per cell (at least 1/L)
    uniform: float  # 1/L: the weight of every cell under uniform attention
    cells: tuple[tuple[float, float, float, float], ...] | None  # hard attention: the outlined box per word


def _drawn(image: Image.Image, grid: tuple[int, int]) -> Image.Image:
    """``image`` as the panels of attention on ``grid`` draw it: RGB, shrunk to at most MAX_SIDE pixels, its aspect
    ratio kept up to MAX_ASPECT and its short side stretched to that ratio beyond it, and a small one enlarged by a
    whole factor (CELL_PIXELS)."""
    picture = image.convert("RGB")
    picture.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.LANCZOS)
    width, height = picture.size
    size = (max(width, math.ceil(height / MAX_ASPECT)), max(height, math.ceil(width / MAX_ASPECT)))
    if size != picture.size:
        picture = picture.resize(size, Image.Resampling.BILINEAR)
    rows, cols = grid
    factor = max(math.ceil(CELL_PIXELS * cols / size[0]), math.ceil(CELL_PIXELS * rows / size[1]))
    factor = min(factor, max(1, MAX_SIDE // max(size)))
    if factor < 2:
        return picture
    return picture.resize((size[0] * factor, size[1] * factor), Image.Resampling.NEAREST)


def shade(
    image: Image.Image,
    words: Sequence[str],
    alphas: Tensor | np.ndarray,
    grid: tuple[int, int],
    locations: Sequence[int] | None = None,
    outline: bool = True,
) -> Shading:
    """The panels of ``words``: ``alphas`` is ``(T, H*W)`` (row t: the attention used for word t, ``T >=
    len(words)``); ``locations`` (hard attention) gives the attended cell index per word, outlined in its panel
    unless ``outline`` is false (a figure draws its own). ValueError for shapes that do not match."""
    rows, cols = grid
    if rows < 1 or cols < 1:
        raise ValueError(f"grid must be positive, got {grid}")
    maps = _as_alphas(alphas, len(words), grid)
    if locations is not None:
        if len(locations) < len(words):
            raise ValueError(f"locations has {len(locations)} entries for {len(words)} words")
        bad = [loc for loc in locations[: len(words)] if not 0 <= int(loc) < rows * cols]
        if bad:
            raise ValueError(f"locations {bad} are outside the {rows}x{cols} grid")
    picture = _drawn(image, grid)
    width, height = picture.size
    pixels = np.asarray(picture, dtype=np.float32)  # (height, width, 3)
    uniform = 1.0 / (rows * cols)
    if not words:
        return Shading(picture, (), uniform, uniform, None if locations is None else ())
    heat = upsample_attention(maps[: len(words)], grid, (width, height))  # (T, height, width)
    top = max(uniform, float(heat.max()))
    brightness = DIM_FLOOR + (1.0 - DIM_FLOOR) * np.clip(heat / top, 0.0, 1.0)  # (T, height, width)
    panels = [Image.fromarray((pixels * level[..., None]).round().astype(np.uint8)) for level in brightness]
    cells = None
    if locations is not None:
        cells = []
        for step, panel in enumerate(panels):
            row, col = divmod(int(locations[step]), cols)
            box = (col * width / cols, row * height / rows, (col + 1) * width / cols - 1, (row + 1) * height / rows - 1)
            if outline:
                ImageDraw.Draw(panel).rectangle(box, outline=(255, 0, 0), width=max(1, min(width, height) // 100))
            cells.append(box)
        cells = tuple(cells)
    return Shading(picture, tuple(panels), top, uniform, cells)


def overlay_figure(
    image: Image.Image,
    words: Sequence[str],
    alphas: Tensor | np.ndarray,
    grid: tuple[int, int],
    locations: Sequence[int] | None = None,
    title: str | None = None,
) -> Figure:
    """The panels of :func:`shade` as a matplotlib figure: ``1 + len(words)`` axes, the image first, then one
    per word with the word as its title, and the colour bar of the caption's scale (1/L marked)."""
    shading = shade(image, words, alphas, grid, locations, outline=False)
    width, height = shading.picture.size
    panels = 1 + len(words)
    ncols = min(MAX_COLUMNS, panels)
    nrows = math.ceil(panels / ncols)
    # room for the word above; a very wide or tall image is drawn inside a panel of at most ASPECT_RANGE's
    # proportions, so that the words and the colour bar keep a readable size
    panel_height = PANEL_INCHES * min(max(height / width, ASPECT_RANGE[0]), ASPECT_RANGE[1]) + 0.35
    fig = Figure(
        figsize=(PANEL_INCHES * ncols + (0.9 if words else 0.0), panel_height * nrows + (0.4 if title else 0.0)),
        dpi=DPI,
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    if title:
        fig.suptitle(title, parse_math=False)
    axes = []
    for panel, picture in enumerate([shading.picture, *shading.panels]):
        ax = fig.add_subplot(nrows, ncols, panel + 1)
        ax.set_axis_off()
        ax.imshow(np.asarray(picture, dtype=np.float32) / 255.0)
        axes.append(ax)
        if panel > 0:
            ax.set_title(words[panel - 1], parse_math=False)
        if panel > 0 and shading.cells is not None:
            left, top, right, bottom = shading.cells[panel - 1]
            outline = Rectangle(
                (left - 0.5, top - 0.5), right + 1 - left, bottom + 1 - top, fill=False, edgecolor="red"
            )
            ax.add_patch(outline)
    if words:
        _colour_bar(fig, axes, Normalize(0.0, shading.top), shading.uniform)
    return fig


def _colour_bar(fig: Figure, axes: list, scale: Normalize, uniform: float) -> None:
    """The caption's brightness scale beside the panels: attention weight per cell, 1/L marked."""
    shades = LinearSegmentedColormap.from_list("dimming", [(DIM_FLOOR,) * 3, (1.0, 1.0, 1.0)])
    bar = fig.colorbar(ScalarMappable(scale, shades), ax=axes, shrink=0.8, aspect=30)
    bar.set_label("attention weight per cell (0 to this caption's highest)")
    bar.ax.axhline(uniform, color="tab:orange", linewidth=2)
    bar.ax.text(
        -0.15, uniform, "1/L", transform=bar.ax.get_yaxis_transform(), ha="right", va="center", color="tab:orange",
        fontsize=10, fontweight="bold",
    )  # fmt: skip
