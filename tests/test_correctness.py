"""Attention correctness: box coverage of grid cells, attention mass in named objects, baseline."""

import math

import numpy as np
import pytest
import torch

from captioner.data.readers import Box
from captioner.evaluation.correctness import (
    AttentionCorrectness,
    attention_in_boxes,
    box_coverage,
    label_coverage,
    matching_label,
    uniform_in_boxes,
)

THIRD = 1 / 3
CENTRE = Box("circle", THIRD, THIRD, 2 * THIRD, 2 * THIRD)  # exactly cell (1, 1) of a 3x3 grid
TOP_LEFT = Box("square", 0.0, 0.0, THIRD, THIRD)  # exactly cell (0, 0)


def one_hot(*cells, length=9):
    alpha = torch.zeros(length, dtype=torch.float64)
    for cell in cells:
        alpha[cell] = 1.0 / len(cells)
    return alpha


def test_box_covering_exactly_one_cell():
    expected = torch.zeros(9, dtype=torch.float64)
    expected[4] = 1.0
    torch.testing.assert_close(box_coverage(CENTRE, (3, 3)), expected)


def test_half_and_quarter_cells():
    half = box_coverage(Box("square", 0.0, 0.0, 0.5, THIRD), (3, 3))
    torch.testing.assert_close(half, torch.tensor([1.0, 0.5, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64))
    # a box of one cell's size, shifted by half a cell: a quarter of four cells
    quarter = box_coverage(Box("square", 1 / 6, 1 / 6, 0.5, 0.5), (3, 3))
    torch.testing.assert_close(quarter, torch.tensor([0.25, 0.25, 0, 0.25, 0.25, 0, 0, 0, 0], dtype=torch.float64))


def test_coverage_is_row_major_on_a_non_square_grid_and_clipped():
    # grid (H=2, W=4): the top-right quarter of the image is cells 2 and 3 of row 0
    coverage = box_coverage(Box("circle", 0.5, -0.3, 1.4, 0.5), (2, 4))
    torch.testing.assert_close(coverage, torch.tensor([0, 0, 1.0, 1.0, 0, 0, 0, 0], dtype=torch.float64))
    assert box_coverage(Box("circle", 0.6, 0.6, 0.6, 0.9), (2, 4)).sum() == 0.0  # empty box


def test_union_of_a_labels_boxes_counts_overlaps_once():
    boxes = [CENTRE, Box("circle", THIRD, THIRD, 0.5, 2 * THIRD), TOP_LEFT]
    union = label_coverage("circle", boxes, (3, 3))
    assert union[4] == pytest.approx(1.0)  # overlapping circles: 1, not 1.5
    assert union.sum() == pytest.approx(1.0)  # the square is not a circle
    assert label_coverage("triangle", boxes, (3, 3)).sum() == 0.0


def test_union_of_boxes_covering_two_halves_of_a_cell_is_the_whole_cell():
    left = Box("circle", THIRD, THIRD, 0.5, 2 * THIRD)
    right = Box("circle", 0.5, THIRD, 2 * THIRD, 2 * THIRD)
    assert label_coverage("circle", [left, right], (3, 3))[4] == pytest.approx(1.0)  # a per-cell max says 0.5


def test_union_coverage_is_exact_for_partly_overlapping_boxes():
    # on a 2x2 grid: two 0.5 x 0.5 boxes overlapping by 0.25 x 0.25, straddling all four cells
    boxes = [Box("dog", 0.0, 0.0, 0.5, 0.5), Box("dog", 0.25, 0.25, 0.75, 0.75)]
    union = label_coverage("dog", boxes, (2, 2))
    # cell 0 (top left) is covered whole; cells 1 and 2 by a quarter; cell 3 by a quarter
    torch.testing.assert_close(union, torch.tensor([1.0, 0.25, 0.25, 0.25], dtype=torch.float64))
    # a random check against a fine pixel count
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand(5, 4, generator=generator, dtype=torch.float64)
    many = []
    for c in corners.tolist():
        (x0, x1), (y0, y1) = sorted(c[:2]), sorted(c[2:])
        many.append(Box("cat", x0, y0, x1, y1))
    pixels = (torch.arange(600, dtype=torch.float64) + 0.5) / 600
    inside = torch.zeros(600, 600, dtype=torch.bool)  # (y, x)
    for b in many:
        inside |= ((pixels >= b.y0) & (pixels < b.y1)).unsqueeze(1) & ((pixels >= b.x0) & (pixels < b.x1)).unsqueeze(0)
    counted = inside.view(3, 200, 3, 200).double().mean(dim=(1, 3)).flatten()
    torch.testing.assert_close(label_coverage("cat", many, (3, 3)), counted, atol=0.01, rtol=0)


def test_all_attention_inside_gives_mass_one():
    alphas = torch.stack([one_hot(0), one_hot(4)])  # (T=2, L=9)
    assert attention_in_boxes(["a", "circle"], alphas, (3, 3), [CENTRE]) == [pytest.approx(1.0)]


def test_partial_attention_counts_covered_fraction():
    half_box = Box("circle", 0.0, 0.0, 0.5, THIRD)  # covers cell 0 fully, cell 1 by half
    alphas = one_hot(1, 8).unsqueeze(0)  # 0.5 on the half-covered cell, 0.5 outside
    assert attention_in_boxes(["circle"], alphas, (3, 3), [half_box]) == [pytest.approx(0.25)]


def test_plurals_match_and_other_words_are_ignored():
    assert matching_label("circles", ["circle", "square"]) == "circle"
    assert matching_label("Boxes", ["box"]) == "box"
    assert matching_label("red", ["circle"]) is None
    boxes = [CENTRE, Box("circle", 0.0, 2 * THIRD, THIRD, 1.0), TOP_LEFT]  # circles at cells 4 and 6
    words = ["two", "circles", "right", "of", "a", "square", "<end>"]
    alphas = torch.stack(
        [one_hot(1), one_hot(4, 6), one_hot(2), one_hot(2), one_hot(2), one_hot(0, 8), one_hot(3)]
    )  # (T=7, L=9)
    assert attention_in_boxes(words, alphas.numpy(), (3, 3), boxes) == [pytest.approx(1.0), pytest.approx(0.5)]


def test_more_steps_than_words_and_shape_errors():
    alphas = torch.stack([one_hot(4), one_hot(0), one_hot(0)])
    assert attention_in_boxes(["circle"], alphas, (3, 3), [CENTRE]) == [pytest.approx(1.0)]
    with pytest.raises(ValueError, match=r"alphas must be \(T, 4\)"):
        attention_in_boxes(["circle"], alphas, (2, 2), [CENTRE])
    with pytest.raises(ValueError, match="3 steps for 4 words"):
        attention_in_boxes(["a", "b", "c", "circle"], alphas, (3, 3), [CENTRE])


def test_uniform_baseline_is_the_covered_share_of_the_image():
    assert uniform_in_boxes(["a", "circle", "and", "square"], (3, 3), [CENTRE, TOP_LEFT]) == [
        pytest.approx(1 / 9),
        pytest.approx(1 / 9),
    ]
    half = Box("circle", 0.0, 0.0, 0.5, 1.0)
    assert uniform_in_boxes(["circle"], (2, 7), [half]) == [pytest.approx(0.5)]
    uniform = np.full((1, 14), 1 / 14)
    assert attention_in_boxes(["circle"], uniform, (2, 7), [half]) == [pytest.approx(0.5)]


def test_accumulator_averages_over_object_words():
    metric = AttentionCorrectness()
    assert all(math.isnan(metric.compute()[key]) for key in ("mean_mass", "uniform_mass"))
    metric.update(1, ["a", "circle"], torch.stack([one_hot(0), one_hot(4)]), (3, 3), [CENTRE])  # mass 1
    metric.update(
        2,
        ["a", "square", "and", "circle"],
        torch.stack([one_hot(0), one_hot(8), one_hot(0), one_hot(4)]),
        (3, 3),
        [CENTRE, TOP_LEFT],
    )  # masses 0 and 1
    metric.update(3, ["nothing", "here"], torch.stack([one_hot(0), one_hot(0)]), (3, 3), [CENTRE])
    result = metric.compute()
    assert result == {"mean_mass": pytest.approx(2 / 3), "uniform_mass": pytest.approx(1 / 9), "words": 3, "images": 3}


def test_state_and_merge_carry_the_accumulator_across_processes():
    parts = [AttentionCorrectness(), AttentionCorrectness()]
    parts[0].update(1, ["circle"], one_hot(4).unsqueeze(0), (3, 3), [CENTRE])  # mass 1
    parts[1].update(2, ["circle"], one_hot(0).unsqueeze(0), (3, 3), [CENTRE])  # mass 0
    parts[1].update(3, ["red"], one_hot(0).unsqueeze(0), (3, 3), [CENTRE])
    merged = AttentionCorrectness.merge(part.state() for part in parts)
    assert (merged.words, parts[0].words, parts[1].words) == (2, 1, 1)
    assert merged.compute() == {
        "mean_mass": pytest.approx(0.5),
        "uniform_mass": pytest.approx(1 / 9),
        "words": 2,
        "images": 3,
    }


def test_an_image_padded_in_twice_by_a_distributed_sampler_counts_once():
    ranks = [AttentionCorrectness(), AttentionCorrectness()]
    ranks[0].update(1, ["circle"], one_hot(4).unsqueeze(0), (3, 3), [CENTRE])  # mass 1
    ranks[1].update(2, ["circle"], one_hot(0).unsqueeze(0), (3, 3), [CENTRE])  # mass 0
    ranks[1].update(1, ["circle"], one_hot(4).unsqueeze(0), (3, 3), [CENTRE])  # image 1 again, as padding
    merged = AttentionCorrectness.merge(rank.state() for rank in ranks)
    assert merged.compute() == {
        "mean_mass": pytest.approx(0.5),
        "uniform_mass": pytest.approx(1 / 9),
        "words": 2,
        "images": 2,
    }
