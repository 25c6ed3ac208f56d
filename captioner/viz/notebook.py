"""The attention overlay of a captioned image as a matplotlib figure, for notebooks (Jupyter shows it inline)."""

from __future__ import annotations

import os

import torch
from matplotlib.figure import Figure
from PIL import Image

from captioner.data.images import load_rgb, to_rgb
from captioner.inference import Captioned
from captioner.viz.overlay import overlay_figure


def show_attention(result: Captioned, image: str | os.PathLike | Image.Image | torch.Tensor | None = None) -> Figure:
    """The per-word attention overlay of ``result`` (from ``model.caption``): the image, then one panel per word.

    The image is ``image`` when given, else the one captioned: the image given in memory, or the file read
    again from ``result.path``. For hard attention decoded by argmax the attended cell is outlined. Returns
    the figure (``captioner.viz.overlay.overlay_figure``): the last expression of a notebook cell shows it
    inline; ``fig.savefig(...)`` writes it. Raises ValueError when there is no image to draw on.
    """
    source = image if image is not None else (result.image if result.image is not None else result.path)
    if source is None:
        raise ValueError("the result has neither an image nor a path: pass image=")
    picture = load_rgb(source) if isinstance(source, (str, os.PathLike)) else to_rgb(source)
    return overlay_figure(
        picture, result.words, result.alphas, result.grid, locations=result.locations, title=result.caption
    )
