"""The attention overlay of a captioned image as a matplotlib figure, for notebooks (Jupyter shows it inline)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.figure import Figure
from PIL import Image

from captioner.inference import Captioned, to_picture
from captioner.viz.overlay import overlay_figure


def show_attention(
    result: Captioned | Sequence[Captioned],
    image: str | os.PathLike | Image.Image | torch.Tensor | np.ndarray | None = None,
    max_pixels: int | None = None,
) -> Figure | list[Figure]:
    """The per-word attention overlay of ``result`` (from ``model.caption``): the image, then one panel per word.

    The image is ``image`` when given, else the one captioned: the image given in memory, or the file read
    again from ``result.path``. For hard attention decoded by argmax the attended cell is outlined. Returns
    the figure (``captioner.viz.overlay.overlay_figure``): the last expression of a notebook cell shows it
    inline; ``fig.savefig(...)`` writes it. A list of results (``model.caption([...])``) gives a list of
    figures, one per captioned result in order (``for fig in show_attention(results): display(fig)`` shows each
    in a notebook); the results that hold an error (inputs that could not be captioned) are left out, named in
    one UserWarning. Raises ValueError when there is no image to draw on, or for one result that holds an error;
    ``max_pixels``: the pixel limit of a file read again, as ``model.caption``'s.
    """
    if isinstance(result, (list, tuple)):
        if image is not None:
            raise ValueError("image= goes with one result; a list of results draws each result's own image")
        failed = [item for item in result if item.error is not None]
        if failed:
            named = "; ".join(f"{_name(item)} ({item.error})" for item in failed)
            warnings.warn(f"{len(failed)} of {len(result)} results not drawn (not captioned): {named}", stacklevel=2)
        return [show_attention(item, max_pixels=max_pixels) for item in result if item.error is None]
    if result.error is not None:
        raise ValueError(f"{_name(result)} was not captioned ({result.error}): nothing to draw")
    source = image if image is not None else (result.image if result.image is not None else result.path)
    if source is None:
        raise ValueError("the result has neither an image nor a path: pass image=")
    picture = to_picture(source, max_pixels)
    return overlay_figure(
        picture, result.words, result.alphas, result.grid, locations=result.locations, title=result.caption
    )


def _name(result: Captioned) -> str:
    """The result's file, or what kind of image it was given as."""
    return result.path if result.path is not None else f"the {type(result.image).__name__} image"
