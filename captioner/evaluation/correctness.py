"""Attention correctness on datasets with object boxes (the shapes set, COCO instances).

While the decoder emits an object's name (a word equal to a box label, or its plural), how much of
its attention falls inside that object's boxes? Each grid cell counts with the fraction of its area
that the boxes cover, so the mass of one step is ``sum_i alpha_i * coverage_i`` in [0, 1]. A
uniform attention map would get ``mean_i coverage_i``: the baseline that makes the number readable
(a model that ignores the image scores the baseline, a perfect one scores 1).

Cells are numbered row-major, ``index = row * W + col``, as the encoder flattens its (H, W) grid.
Labels are matched to single words, so a multi-word label (COCO's "traffic light") never matches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from captioner.data.readers import Box


def box_coverage(box: Box, grid: tuple[int, int]) -> Tensor:
    """Fraction of each grid cell's area covered by ``box``: a float64 tensor ``(H*W,)`` in [0, 1].

    ``box`` has ``x0, y0, x1, y1`` as fractions of the image width and height; coordinates outside
    [0, 1] are clipped and an empty box covers nothing.
    """
    height, width = grid
    if height < 1 or width < 1:
        raise ValueError(f"grid must be positive, got {grid}")

    def overlap(low: float, high: float, cells: int) -> Tensor:  # (cells,) covered fraction per cell
        edges = torch.linspace(0.0, 1.0, cells + 1, dtype=torch.float64)  # (cells + 1,)
        covered = edges[1:].clamp(max=high) - edges[:-1].clamp(min=low)
        return (covered * cells).clamp(0.0, 1.0)

    rows = overlap(box.y0, box.y1, height)  # (H,)
    cols = overlap(box.x0, box.x1, width)  # (W,)
    return torch.outer(rows, cols).flatten()  # (H*W,)


def matching_label(word: str, labels: Iterable[str]) -> str | None:
    """The label that ``word`` names ("circle" or "circles" -> "circle"), or None."""
    word = word.lower()
    for label in labels:
        label = label.lower()
        if word in (label, label + "s", label + "es"):
            return label
    return None


def label_coverage(label: str, boxes: Sequence[Box], grid: tuple[int, int]) -> Tensor:
    """Fraction of each grid cell's area covered by the union of the boxes labelled ``label``: ``(H*W,)``.

    Exact for overlapping boxes: the plane is cut along every box and cell edge into rectangles, each
    inside one cell and either inside some box or inside none, and the covered ones are summed per cell
    (two boxes covering the two halves of a cell give 1; two overlapping ones never count twice).
    """
    height, width = grid
    chosen = [box for box in boxes if box.label.lower() == label.lower()]
    if not chosen:
        return torch.zeros(height * width, dtype=torch.float64)
    if len(chosen) == 1:
        return box_coverage(chosen[0], grid)
    spans = torch.tensor([[b.x0, b.y0, b.x1, b.y1] for b in chosen], dtype=torch.float64).clamp(0.0, 1.0)  # (K, 4)

    def cuts(low: Tensor, high: Tensor, cells: int) -> tuple[Tensor, Tensor, Tensor]:
        edges = torch.cat([torch.linspace(0.0, 1.0, cells + 1, dtype=torch.float64), low, high]).unique()  # sorted
        centres = (edges[1:] + edges[:-1]) / 2  # (P,)
        cell = (centres * cells).long().clamp(max=cells - 1)  # (P,) the grid cell of each piece
        return edges[1:] - edges[:-1], centres, cell

    dx, cx, col = cuts(spans[:, 0], spans[:, 2], width)  # (P,)
    dy, cy, row = cuts(spans[:, 1], spans[:, 3], height)  # (Q,)
    inside_x = (cx.unsqueeze(0) > spans[:, 0:1]) & (cx.unsqueeze(0) < spans[:, 2:3])  # (K, P)
    inside_y = (cy.unsqueeze(0) > spans[:, 1:2]) & (cy.unsqueeze(0) < spans[:, 3:4])  # (K, Q)
    covered = (inside_y.unsqueeze(2) & inside_x.unsqueeze(1)).any(dim=0)  # (Q, P): inside some box
    area = torch.outer(dy, dx) * covered  # (Q, P)
    cells = (row.unsqueeze(1) * width + col.unsqueeze(0)).flatten()  # (Q*P,) row-major cell index
    per_cell = torch.zeros(height * width, dtype=torch.float64).index_add_(0, cells, area.flatten())
    return (per_cell * height * width).clamp(0.0, 1.0)  # (H*W,) as a fraction of the cell's area


def _object_words(words: Sequence[str], boxes: Sequence[Box], grid: tuple[int, int]) -> list[tuple[int, Tensor]]:
    """(step, coverage (H*W,)) for every word that names a box label."""
    labels = sorted({box.label.lower() for box in boxes})
    found = []
    for step, word in enumerate(words):
        label = matching_label(word, labels)
        if label is not None:
            found.append((step, label_coverage(label, boxes, grid)))
    return found


def attention_in_boxes(
    words: Sequence[str], alphas: Tensor | np.ndarray, grid: tuple[int, int], boxes: Sequence[Box]
) -> list[float]:
    """Attention mass inside the named object's boxes, one value per object word, in caption order.

    ``alphas`` is ``(T, L)`` with ``T >= len(words)`` (row t is the attention used to emit word t)
    and ``L = H*W``. Words that name no box label are skipped.
    """
    alphas = torch.as_tensor(alphas).detach().to("cpu", torch.float64)  # (T, L)
    height, width = grid
    if alphas.ndim != 2 or alphas.shape[1] != height * width:
        raise ValueError(f"alphas must be (T, {height * width}) for grid {grid}, got {tuple(alphas.shape)}")
    if alphas.shape[0] < len(words):
        raise ValueError(f"alphas has {alphas.shape[0]} steps for {len(words)} words")
    return [float(alphas[step] @ coverage) for step, coverage in _object_words(words, boxes, grid)]


def uniform_in_boxes(words: Sequence[str], grid: tuple[int, int], boxes: Sequence[Box]) -> list[float]:
    """The baseline of :func:`attention_in_boxes`: the mass a uniform attention map (1/L per cell)
    would put inside the named object's boxes, one value per object word."""
    return [float(coverage.mean()) for _, coverage in _object_words(words, boxes, grid)]


class AttentionCorrectness:
    """Accumulates attention correctness over images; ``compute()`` averages over object words.

    Results are kept per image id, so an image scored twice (a distributed sampler pads the last batch
    with repeats) counts once. ``state()`` and ``merge()`` carry it across processes as plain data
    (e.g. ``all_gather_object``).
    """

    def __init__(self) -> None:
        self.per_image: dict[int, tuple[list[float], list[float]]] = {}  # image id -> (masses, baselines)

    @property
    def words(self) -> int:
        """How many object words have been scored so far."""
        return sum(len(masses) for masses, _ in self.per_image.values())

    def state(self) -> dict[int, tuple[list[float], list[float]]]:
        """The accumulated values as plain data: image id -> (masses, baselines)."""
        return {image_id: (list(m), list(b)) for image_id, (m, b) in self.per_image.items()}

    @classmethod
    def merge(cls, states: Iterable[dict]) -> AttentionCorrectness:
        """One accumulator holding everything of several :meth:`state` dicts, each image once."""
        merged = cls()
        for state in states:
            merged.per_image.update(state)
        return merged

    def update(
        self,
        image_id: int,
        words: Sequence[str],
        alphas: Tensor | np.ndarray,
        grid: tuple[int, int],
        boxes: Sequence[Box],
    ) -> None:
        """Score one image: its generated ``words``, attention ``alphas`` (T, L), grid and boxes."""
        self.per_image[image_id] = (
            attention_in_boxes(words, alphas, grid, boxes),
            uniform_in_boxes(words, grid, boxes),
        )

    def compute(self) -> dict[str, float]:
        """``{"mean_mass", "uniform_mass", "words", "images"}``: the mean attention mass inside the
        named objects, the same for uniform attention, and the counts. Means are NaN with no words."""
        masses = [m for image_masses, _ in self.per_image.values() for m in image_masses]
        baselines = [b for _, image_baselines in self.per_image.values() for b in image_baselines]
        words = len(masses)
        return {
            "mean_mass": math.fsum(masses) / words if words else math.nan,
            "uniform_mass": math.fsum(baselines) / words if words else math.nan,
            "words": words,
            "images": len(self.per_image),
        }
