"""Attention overlays in the style of Show, Attend and Tell's figures: one panel per generated word.

The first panel is the image; each following panel has the word as its title and shows the image
dimmed where the attention used to emit that word is low. The (H, W) attention grid is upsampled
smoothly (bicubic) to the image's own size and aspect ratio. All panels of a caption share one
brightness scale, from no attention (dimmed) to the caption's highest weight on a cell (as is), and a
colour bar gives that scale with uniform attention (1/L) marked: a flat map looks flat, a sharp one
bright on its spot. For hard attention the chosen cell is outlined.

Figures are built with matplotlib's object-oriented API on an Agg canvas: no display, and no
pyplot figure registry to leak from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

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

from captioner.fileio import atomic_write

MAX_COLUMNS = 5  # panels per row
MAX_SIDE = 448  # the image is shrunk to this longest side (pixels) before drawing
PANEL_INCHES = 2.4  # width of one panel
DIM_FLOOR = 0.15  # brightness left where a word puts no attention
DPI = 100
ASPECT_RANGE = (0.5, 2.0)  # a panel's height / width, whatever the image's


def upsample_attention(alpha: Tensor | np.ndarray, grid: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
    """Bicubically upsample one attention map ``alpha`` ``(H*W,)`` to ``size = (width, height)``.

    Returns a float32 array ``(height, width)`` of attention weight per cell (a uniform map stays 1/L
    everywhere), never negative, with cell (r, c) centred on its part of the image: no shift, whatever
    the grid or aspect ratio.
    """
    rows, cols = grid
    width, height = size
    grid_map = torch.as_tensor(alpha).detach().to("cpu", torch.float32).reshape(1, 1, rows, cols)
    smooth = F.interpolate(grid_map, size=(height, width), mode="bicubic", align_corners=False)
    return smooth[0, 0].clamp_min(0.0).numpy()  # (height, width); bicubic overshoots below zero


def _as_alphas(alphas: Tensor | np.ndarray, steps: int, grid: tuple[int, int]) -> np.ndarray:
    """Check and convert ``alphas`` to a float32 array ``(T, H*W)`` with ``T >= steps``."""
    array = torch.as_tensor(alphas).detach().to("cpu", torch.float32).numpy()
    cells = grid[0] * grid[1]
    if array.ndim != 2 or array.shape[1] != cells:
        raise ValueError(f"alphas must be (T, {cells}) for grid {tuple(grid)}, got {array.shape}")
    if array.shape[0] < steps:
        raise ValueError(f"alphas has {array.shape[0]} steps for {steps} words")
    return array


def overlay_figure(
    image: Image.Image,
    words: Sequence[str],
    alphas: Tensor | np.ndarray,
    grid: tuple[int, int],
    locations: Sequence[int] | None = None,
    title: str | None = None,
) -> Figure:
    """Build the overlay figure: ``1 + len(words)`` axes, the image first, then one per word.

    ``alphas`` is ``(T, H*W)`` (row t: the attention used for word t, ``T >= len(words)``);
    ``locations`` (hard attention) gives the attended cell index per word, outlined in its panel.
    """
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

    picture = image.convert("RGB")
    picture.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.LANCZOS)
    width, height = picture.size
    pixels = np.asarray(picture, dtype=np.float32) / 255.0  # (height, width, 3)

    heat = [upsample_attention(maps[step], grid, (width, height)) for step in range(len(words))]
    uniform = 1.0 / (rows * cols)
    scale = Normalize(0.0, max([uniform, *(float(h.max()) for h in heat)]))  # one scale for the caption

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
    for panel in range(panels):
        ax = fig.add_subplot(nrows, ncols, panel + 1)
        ax.set_axis_off()
        axes.append(ax)
        if panel == 0:
            ax.imshow(pixels)
            continue
        step = panel - 1
        weight = np.clip(scale(heat[step]), 0.0, 1.0)  # (height, width) in [0, 1] on the caption's scale
        ax.imshow(pixels * (DIM_FLOOR + (1.0 - DIM_FLOOR) * weight[..., None]))
        ax.set_title(words[step], parse_math=False)
        if locations is not None:
            row, col = divmod(int(locations[step]), cols)
            cell_w, cell_h = width / cols, height / rows
            ax.add_patch(
                Rectangle(
                    (col * cell_w - 0.5, row * cell_h - 0.5), cell_w, cell_h, fill=False, edgecolor="red", linewidth=1.5
                )
            )
    if words:
        _colour_bar(fig, axes, scale, uniform)
    return fig


def _colour_bar(fig: Figure, axes: list, scale: Normalize, uniform: float) -> None:
    """The caption's brightness scale beside the panels: attention weight per cell, 1/L marked."""
    shades = LinearSegmentedColormap.from_list("dimming", [(DIM_FLOOR,) * 3, (1.0, 1.0, 1.0)])
    bar = fig.colorbar(ScalarMappable(scale, shades), ax=axes, shrink=0.8, aspect=30)
    bar.set_label("attention weight per cell")
    bar.ax.axhline(uniform, color="tab:orange", linewidth=1.5)
    bar.ax.text(
        1.05, uniform, "1/L", transform=bar.ax.get_yaxis_transform(), va="center", color="tab:orange", fontsize=8
    )


def draw_overlay(
    image: Image.Image,
    words: Sequence[str],
    alphas: Tensor | np.ndarray,
    grid: tuple[int, int],
    out_path: str | os.PathLike,
    locations: Sequence[int] | None = None,
    title: str | None = None,
) -> Path:
    """Draw :func:`overlay_figure` into a PNG at ``out_path`` (written atomically); return the path."""
    fig = overlay_figure(image, words, alphas, grid, locations=locations, title=title)
    with atomic_write(out_path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=DPI)
    return Path(out_path)


def word_panels(
    image: Image.Image,
    words: Sequence[str],
    alphas: Tensor | np.ndarray,
    grid: tuple[int, int],
    locations: Sequence[int] | None = None,
) -> list[Image.Image]:
    """One image per word, as the panels of :func:`overlay_figure` draw it (the image dimmed where the word's
    attention is low, one scale for the caption, the attended cell outlined for hard attention), without
    titles or axes: a page shows the word beside it at its own size."""
    rows, cols = grid
    maps = _as_alphas(alphas, len(words), grid)
    picture = image.convert("RGB")
    picture.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.LANCZOS)
    width, height = picture.size
    pixels = np.asarray(picture, dtype=np.float32) / 255.0
    heat = [upsample_attention(maps[step], grid, (width, height)) for step in range(len(words))]
    scale = Normalize(0.0, max([1.0 / (rows * cols), *(float(h.max()) for h in heat)]))
    panels = []
    for step in range(len(words)):
        weight = np.clip(scale(heat[step]), 0.0, 1.0)[..., None]
        panel = Image.fromarray((pixels * (DIM_FLOOR + (1.0 - DIM_FLOOR) * weight) * 255).round().astype(np.uint8))
        if locations is not None:
            row, col = divmod(int(locations[step]), cols)
            box = (col * width / cols, row * height / rows, (col + 1) * width / cols - 1, (row + 1) * height / rows - 1)
            ImageDraw.Draw(panel).rectangle(box, outline=(255, 0, 0), width=max(1, min(width, height) // 100))
        panels.append(panel)
    return panels
