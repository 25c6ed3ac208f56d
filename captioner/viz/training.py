"""Pictures of a training run: the sample sheet of a validation (a few images captioned and attended) and the
curves of the whole run.

The sheet stacks one picture per sample, each the sheet ``captioner attend`` draws of a caption
(``captioner.viz.sheet``): a heading with the caption and one reference, then the image and the panel of
every word on the caption's one brightness scale with its colour bar (the attended cell outlined for hard
attention), composed with Pillow in milliseconds, so that it can be drawn after every validation.
The curves picture (matplotlib, on an Agg canvas: no display) plots the training loss (mean per epoch),
validation BLEU-4, CIDEr-D and attention correctness per epoch, with the switch from cross-entropy to SCST,
the checkpoint the run picked and the validations without attention correctness marked: each epoch's
validation as the run logged it (``val/`` in metrics.csv and TensorBoard), never the run's final scores
(``final/``: another decoding of the picked checkpoint, not another epoch).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image, ImageOps
from torch import Tensor

from captioner.fileio import atomic_write
from captioner.viz.overlay import shade
from captioner.viz.sheet import PNG_LEVEL, SHEET, Layout, sheet_picture

GAP = 24  # white pixels between two samples on a sheet
# A sample as TensorBoard gets it: its images tab shows every picture 348 pixels wide, so this one is drawn 384
# wide (the sheet's 1000 and more came out at a third of its size, the text unreadable): three panels a row and
# no colour bar (the sheet in the run folder has it), the text at its size, shown at 0.9 of it.
TENSORBOARD = Layout(cell=112, columns=3, bar=False)
TRAIN_LOSS = "train_loss"  # a history row's key of the epoch's mean training loss
VALIDATED = "val/bleu4"  # a history row's key that every validation gives
CURVES = (  # (history key, panel title) of the curves picture, in reading order
    (TRAIN_LOSS, "training loss (mean per epoch)"),
    (VALIDATED, "validation BLEU-4"),
    ("val/cider", "validation CIDEr-D"),
    ("val/attention_correctness", "attention correctness"),
)
# Why a validation may have no value of a curve: attention correctness needs a decoded word that names a boxed
# object (a run's first epochs often decode none: "a yellow a yellow ..."). Such epochs are marked on the axis.
NOT_COMPUTED = {"val/attention_correctness": "no caption named a boxed object"}


@dataclass(frozen=True)
class Sample:
    """One validation image as a validation decoded it."""

    image_id: int
    image: Image.Image  # the image file as read (the overlay draws on it, not on the model's input)
    words: list[str]  # the decoded caption
    alphas: Tensor  # (T, H*W): the attention of each word, T >= len(words)
    grid: tuple[int, int]  # (H, W)
    references: tuple[str, ...]  # the image's reference captions (the sheet shows the first)
    locations: list[int] | None = None  # hard attention decoded by argmax: the cell each word read

    @property
    def caption(self) -> str:
        """The decoded caption as one string."""
        return " ".join(self.words)

    def title(self, epoch: int) -> str:
        """The heading of the sample's picture: image, epoch, caption and one reference."""
        reference = self.references[0] if self.references else "(none)"
        return f"image {self.image_id}, epoch {epoch}: {self.caption or '(empty caption)'}\nreference: {reference}"


def sample_picture(sample: Sample, epoch: int, layout: Layout = SHEET) -> Image.Image:
    """One sample drawn as ``captioner attend`` draws a caption (:func:`captioner.viz.sheet.sheet_picture`), laid
    out as ``layout`` says: the heading (image, epoch, caption, one reference), the image and each word's panel
    on the caption's one brightness scale with its colour bar (the attended cell outlined for hard attention)."""
    picture = ImageOps.contain(sample.image.convert("RGB"), (layout.cell, layout.cell))  # shaded at its size shown
    shading = shade(picture, sample.words, sample.alphas, sample.grid, sample.locations)
    return sheet_picture(shading, sample.words, sample.title(epoch), layout)


def draw_sample_sheet(samples: Sequence[Sample], epoch: int, out_path: str | os.PathLike) -> list[Image.Image]:
    """Draw the sheet of ``samples`` at ``epoch``: their pictures (:func:`sample_picture`) one under the other,
    into a PNG at ``out_path`` (written atomically); return each sample's picture, for the loggers that show
    them one by one."""
    pictures = [sample_picture(sample, epoch) for sample in samples]
    width = max(p.width for p in pictures)
    sheet = Image.new("RGB", (width, sum(p.height for p in pictures) + GAP * (len(pictures) - 1)), (255, 255, 255))
    top = 0
    for picture in pictures:
        sheet.paste(picture, (0, top))
        top += picture.height + GAP
    with atomic_write(out_path, "wb") as handle:
        sheet.save(handle, format="PNG", compress_level=PNG_LEVEL)
    return pictures


def curves_figure(history: Sequence[Mapping[str, object]], picked_epoch: int | None) -> Figure:
    """The curves of ``history`` (one row per validation or epoch: ``epoch``, ``scst``, and the keys of
    ``CURVES`` where known) as a 2 x 2 figure; the first SCST epoch, ``picked_epoch`` and the validations
    without a value that can be missing (``NOT_COMPUTED``) marked."""
    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    epochs = np.array([int(row["epoch"]) for row in history])
    scst = [int(row["epoch"]) for row in history if row.get("scst")]
    validated = np.array([row.get(VALIDATED) is not None for row in history], dtype=bool)
    for panel, (key, title) in enumerate(CURVES):
        ax = fig.add_subplot(2, 2, panel + 1)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        values = np.array([_number(row.get(key)) for row in history], dtype=float)
        known = ~np.isnan(values)
        if not known.any():
            ax.text(0.5, 0.5, "not computed", ha="center", va="center", transform=ax.transAxes, color="grey")
        else:
            ax.plot(epochs[known], values[known], marker="o", markersize=3, color="tab:blue")
        if scst:
            ax.axvline(min(scst) - 0.5, color="tab:orange", linestyle="--", label=f"SCST from epoch {min(scst)}")
        if picked_epoch is not None:
            picked = f"picked checkpoint (epoch {picked_epoch})"
            ax.axvline(picked_epoch, color="tab:green", linestyle=":", label=picked)
            chosen = known & (epochs == picked_epoch)
            if chosen.any():
                ax.plot(epochs[chosen], values[chosen], marker="*", markersize=14, color="tab:green", linestyle="none")
        gaps = validated & ~known if key in NOT_COMPUTED else np.zeros_like(known)
        if gaps.any():  # at the foot of the axis, whatever its values
            label = f"not computed: {NOT_COMPUTED[key]}"
            feet = np.full(int(gaps.sum()), 0.04)
            ax.plot(epochs[gaps], feet, "x", color="grey", transform=ax.get_xaxis_transform(), label=label)
        if len(epochs):
            ax.set_xlim(epochs.min() - 0.6, epochs.max() + 0.6)
            ax.xaxis.get_major_locator().set_params(integer=True)
        if scst or picked_epoch is not None or gaps.any():
            ax.legend(loc="best", fontsize=8)
    return fig


def draw_curves(history: Sequence[Mapping[str, object]], picked_epoch: int | None, out_path: str | os.PathLike) -> Path:
    """Draw :func:`curves_figure` into a PNG at ``out_path`` (written atomically); return the path."""
    fig = curves_figure(history, picked_epoch)
    with atomic_write(out_path, "wb") as handle:
        fig.savefig(handle, format="png")
    return Path(out_path)


def _number(value: object) -> float:
    """``value`` as a float, NaN for a missing or non-finite one."""
    if value is None:
        return math.nan
    number = float(value)
    return number if math.isfinite(number) else math.nan
