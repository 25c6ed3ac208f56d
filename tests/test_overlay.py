"""Attention overlays: valid PNGs, one titled panel per word, smooth aligned maps, hard locations."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from PIL import Image  # noqa: E402

from captioner.viz import overlay  # noqa: E402
from captioner.viz.overlay import DIM_FLOOR, MAX_SIDE, overlay_figure, upsample_attention  # noqa: E402
from captioner.viz.sheet import BAR, MARK, draw_overlay  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def gradient_image(width, height):
    x = np.linspace(0, 255, width, dtype=np.uint8)
    pixels = np.stack([np.tile(x, (height, 1))] * 3, axis=-1)
    pixels[..., 2] = 200
    return Image.fromarray(pixels)


def test_png_is_valid_and_written_atomically(tmp_path):
    out = tmp_path / "nested" / "overlay.png"
    before = plt.get_fignums()
    alphas = torch.softmax(torch.randn(4, 9, requires_grad=True), dim=1)  # (T=4, L=9), extra <end> step
    shading = draw_overlay(gradient_image(64, 48), ["a", "red", "$5"], alphas, (3, 3), out, title="soft")
    assert len(shading.panels) == 3 and shading.uniform == pytest.approx(1 / 9)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(out) as png:
        png.load()
        assert png.format == "PNG" and png.width > png.height > 50
    assert [p.name for p in out.parent.iterdir()] == ["overlay.png"]  # no temporary left behind
    assert plt.get_fignums() == before  # no figure left open


def test_one_titled_panel_per_word_wrapping_in_rows():
    words = "a red circle left of a blue square".split()
    fig = overlay_figure(gradient_image(40, 40), words, np.full((8, 4), 0.25), (2, 2))
    assert len(fig.axes) == 1 + len(words) + 1  # the image, a panel per word, the colour bar
    assert [ax.get_title() for ax in fig.axes[:-1]] == [""] + words
    assert fig.axes[0].get_subplotspec().get_gridspec().get_geometry() == (2, 5)
    assert len(overlay_figure(gradient_image(40, 40), [], np.zeros((0, 4)), (2, 2)).axes) == 1


def test_wide_image_with_non_square_grid_keeps_aspect_and_dims_unattended_parts(tmp_path):
    image = gradient_image(500, 120)
    alphas = np.zeros((2, 14))
    alphas[0, 6] = 1.0  # row 0, col 6: top-right cell
    alphas[1] = 1 / 14  # uniform
    fig = overlay_figure(image, ["orange", "circle"], alphas, (2, 7))
    original = fig.axes[0].images[0].get_array()
    height, width = round(120 * MAX_SIDE / 500), MAX_SIDE
    assert original.shape == (height, width, 3)
    peaked = fig.axes[1].images[0].get_array()
    assert peaked.shape == original.shape
    np.testing.assert_allclose(peaked[5, -5], original[5, -5], atol=0.02)  # attended: as is
    np.testing.assert_allclose(peaked[-5, 5], DIM_FLOOR * original[-5, 5], atol=0.02)  # dimmed
    # the uniform map on the caption's shared scale: 1/14 of the peak everywhere, so nearly as dim
    peak = upsample_attention(alphas[0], (2, 7), (width, height)).max()
    flat = DIM_FLOOR + (1 - DIM_FLOOR) * (1 / 14) / peak
    np.testing.assert_allclose(fig.axes[2].images[0].get_array(), flat * original, atol=1 / 255)  # 8-bit panels
    draw_overlay(image, ["orange", "circle"], alphas, (2, 7), tmp_path / "wide.png")
    with Image.open(tmp_path / "wide.png") as png:
        assert png.width > 2 * png.height


def test_upsampling_is_smooth_and_aligned_with_the_cell():
    alpha = np.zeros(14)
    alpha[1 * 7 + 2] = 1.0  # cell (1, 2) of a 2x7 grid
    heat = upsample_attention(alpha, (2, 7), (500, 120))
    assert heat.shape == (120, 500)
    assert 1.0 <= heat.max() < 1.2 and heat.min() >= 0.0  # weight per cell (bicubic overshoots a little)
    row, col = np.unravel_index(heat.argmax(), heat.shape)
    assert 60 <= row < 120 and 2 * 500 / 7 <= col < 3 * 500 / 7
    assert len(np.unique(heat.round(4))) > 100  # smooth, not 14 blocks
    assert np.abs(np.diff(heat, axis=1)).max() < 0.05
    assert np.abs(np.diff(heat, axis=0)).max() < 0.1
    np.testing.assert_allclose(upsample_attention(np.full(4, 0.25), (2, 2), (8, 8)), np.full((8, 8), 0.25))


@pytest.mark.parametrize(
    "grid, size", [((6, 6), (96, 96)), ((2, 7), (500, 120)), ((14, 14), (448, 300)), ((1, 3), (5, 2))]
)
def test_upsampling_is_torch_bicubic_for_every_map(grid, size):
    alphas = torch.rand(4, grid[0] * grid[1], generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.interpolate(
        alphas.reshape(-1, 1, *grid), size=size[::-1], mode="bicubic", align_corners=False
    )[:, 0].clamp_min(0.0)
    heat = upsample_attention(alphas, grid, size)
    assert heat.shape == (4, size[1], size[0]) and heat.dtype == np.float32
    np.testing.assert_allclose(heat, expected.numpy(), atol=1e-5)
    np.testing.assert_allclose(upsample_attention(alphas[1].numpy(), grid, size), expected[1].numpy(), atol=1e-5)


def test_panels_of_a_caption_share_one_scale_with_a_colour_bar_marking_uniform():
    sharp, flat = np.zeros(9), np.full(9, 1 / 9)
    sharp[4] = 1.0
    white = Image.new("RGB", (60, 60), (255, 255, 255))
    fig = overlay_figure(white, ["sharp", "flat"], np.stack([sharp, flat]), (3, 3))
    sharp_panel, flat_panel = (ax.images[0].get_array() for ax in fig.axes[1:3])
    assert sharp_panel.max() == pytest.approx(1.0, abs=0.01)
    assert flat_panel.max() < 0.3  # a flat map no longer looks as bright as a sharp one's spot
    bar = fig.axes[-1]
    low, high = bar.get_ylim()
    assert low == 0.0 and high == pytest.approx(upsample_attention(sharp, (3, 3), (60, 60)).max())
    assert any(line.get_ydata()[0] == pytest.approx(1 / 9) for line in bar.lines)  # 1/L marked


def test_hard_attention_outlines_the_chosen_cell():
    alphas = np.full((2, 14), 1 / 14)
    fig = overlay_figure(gradient_image(500, 120), ["a", "cat"], alphas, (2, 7), locations=[13, 0])
    height, width = fig.axes[0].images[0].get_array().shape[:2]
    rects = [[p for p in ax.patches if isinstance(p, Rectangle)] for ax in fig.axes[1:-1]]  # not the colour bar
    assert [len(r) for r in rects] == [1, 1]
    assert rects[0][0].get_xy() == pytest.approx((6 * width / 7 - 0.5, height / 2 - 0.5))
    assert (rects[0][0].get_width(), rects[0][0].get_height()) == pytest.approx((width / 7, height / 2))
    assert rects[1][0].get_xy() == pytest.approx((-0.5, -0.5))
    assert len(fig.axes[0].patches) == 0


def test_the_sheet_and_panels_outline_the_chosen_cell_in_red():
    alphas = np.full((2, 14), 1 / 14)
    shading = overlay.shade(gradient_image(500, 120), ["a", "cat"], alphas, (2, 7), locations=[13, 0])
    height, width = np.asarray(shading.picture).shape[:2]
    red = [np.all(np.asarray(panel) == (255, 0, 0), axis=-1) for panel in shading.panels]
    assert red[0][height // 2 + 1, -1] and red[0][-1, 6 * width // 7 + 1] and not red[0][: height // 2 - 1].any()
    assert red[1][0, 0] and not red[1][:, width // 7 + 1 :].any()
    assert shading.cells[0] == (6 * width / 7, height / 2, width - 1, height - 1)


def mark_and_bar(sheet: np.ndarray) -> tuple[int, int, float]:
    """The top row of the sheet's orange 1/L line across the colour bar, the bar's middle column, and the bar's
    grey just above the line (0..1)."""
    orange = np.all(np.abs(sheet.astype(int) - MARK) < 30, axis=-1)
    line = [
        row
        for row in range(len(orange))
        if orange[row].sum() >= BAR[0] and orange[row][np.argmax(orange[row]) :][: BAR[0]].all()
    ]
    row = line[0]
    column = int(np.argmax(orange[row])) + 5 + BAR[0] // 2  # the line starts 5 pixels left of the bar
    return row, column, sheet[row - 2, column].mean() / 255


def test_the_sheet_marks_uniform_attention_where_the_panels_show_it(tmp_path):
    sharp, flat = np.zeros(9), np.full(9, 1 / 9)
    sharp[4] = 1.0
    white = Image.new("RGB", (60, 60), (255, 255, 255))
    shading = draw_overlay(white, ["sharp", "flat"], np.stack([sharp, flat]), (3, 3), tmp_path / "s.png", title="t")
    with Image.open(tmp_path / "s.png") as png:
        sheet = np.asarray(png.convert("RGB"))
    row, column, grey = mark_and_bar(sheet)
    flat_brightness = np.asarray(shading.panels[1]).mean() / 255  # a flat map on the caption's scale
    assert flat_brightness == pytest.approx(DIM_FLOOR + (1 - DIM_FLOOR) / 9 / shading.top, abs=0.01)
    assert grey == pytest.approx(flat_brightness, abs=0.03)  # the mark sits where the flat panel's shade is
    assert sheet[row - 60 : row + 1, column].mean() / 255 > grey  # brighter above: the bar runs up to the top


def test_bad_shapes_raise(tmp_path):
    image = gradient_image(20, 20)
    with pytest.raises(ValueError, match=r"alphas must be \(T, 9\)"):
        overlay_figure(image, ["a"], np.ones((1, 4)), (3, 3))
    with pytest.raises(ValueError, match="1 steps for 2 words"):
        overlay_figure(image, ["a", "b"], np.ones((1, 9)), (3, 3))
    with pytest.raises(ValueError, match="outside the 3x3 grid"):
        overlay_figure(image, ["a"], np.ones((1, 9)), (3, 3), locations=[9])
    with pytest.raises(ValueError, match="locations has 1 entries for 2 words"):
        overlay_figure(image, ["a", "b"], np.ones((2, 9)), (3, 3), locations=[0])
    assert not list(tmp_path.iterdir())


def test_shaded_panels_dim_where_the_word_does_not_look_and_outline_hard_attention():
    image = Image.new("RGB", (40, 20), (200, 200, 200))
    alphas = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # grid 1 x 2: word 0 looks left, word 1 right
    soft, _ = overlay.shade(image, ["left", "right"], alphas, (1, 2)).panels
    assert soft.size == (40, 20)
    pixels = np.asarray(soft).astype(float)
    assert pixels[10, 2].mean() > 190 and pixels[10, 37].mean() < 0.2 * 200 + 5  # bright left, dimmed right
    (hard,) = overlay.shade(image, ["right"], alphas[1:], (1, 2), locations=[1]).panels
    assert tuple(np.asarray(hard)[0, 30]) == (255, 0, 0)  # the chosen cell's outline
    assert tuple(np.asarray(hard)[0, 10]) != (255, 0, 0)


def test_a_very_wide_image_keeps_a_readable_panel_height():
    fig = overlay.overlay_figure(Image.new("RGB", (4000, 20)), ["a", "b"], torch.full((2, 4), 0.25), (2, 2))
    width, height = fig.get_size_inches()
    assert height >= 0.5 * overlay.PANEL_INCHES  # not 20/4000 of a panel's width


def test_a_panorama_is_drawn_as_a_band_its_attention_shows_in():
    """A 20000 x 20 panorama shrunk to 448 pixels across is 1 pixel high: its panels are stretched to 8:1, the
    attended cell lit, and the sheet shows them as bands, not a line (or nothing) under each word."""
    from captioner.viz.sheet import CELL, GAP, TEXT, sheet_picture

    shading = overlay.shade(Image.new("RGB", (20000, 20), "white"), ["left"], np.eye(1, 4), (2, 2))
    assert shading.picture.size == shading.panels[0].size == (448, 56)
    panel = np.asarray(shading.panels[0])[..., 0].astype(float)  # (56, 448)
    assert panel[:28, :224].mean() > 3 * panel[28:, 224:].mean()  # the top-left cell bright, the rest dimmed
    sheet = np.asarray(sheet_picture(shading, ["left"], None))
    column = sheet[GAP + TEXT + 8 :, GAP + CELL + GAP + 3 * CELL // 4]  # down the dimmed right of the panel
    assert (column.min(axis=-1) < 250).sum() == CELL // overlay.MAX_ASPECT  # 25 rows of the panel, not 0 or 1
    assert overlay.shade(Image.new("RGB", (4000, 500)), ["a"], np.eye(1, 4), (2, 2)).picture.size == (448, 56)


def test_a_tiny_image_is_enlarged_until_its_panels_show_each_cell():
    """A 1 x 1 image on a 12 x 12 grid was one pixel, each word's panel the mean of its attention: now each pixel
    is a block of 24 x 24 and the attended cell is lit; an image whose cells cover 2 pixels is drawn as it is."""
    shading = overlay.shade(Image.new("RGB", (1, 1), "white"), ["a"], np.eye(1, 144), (12, 12))
    assert shading.picture.size == shading.panels[0].size == (24, 24)
    assert np.asarray(shading.picture).min() == 255  # the one white pixel, repeated
    panel = np.asarray(shading.panels[0])[..., 0]
    assert panel[0, 0] == 255 and panel[12:, 12:].max() < 0.2 * 255  # the first cell lit, the far ones dimmed
    assert overlay.shade(Image.new("RGB", (24, 30)), ["a"], np.eye(1, 144), (12, 12)).picture.size == (24, 30)


def test_the_sheet_shows_a_small_image_at_a_whole_multiple_each_pixel_a_block_and_a_large_one_shrunk():
    from captioner.viz.sheet import CELL, GAP, TEXT, sheet_picture

    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8))
    alphas = np.eye(2, 4)
    shading = overlay.shade(noise, ["left", "right"], alphas, (2, 2))
    sheet = np.asarray(sheet_picture(shading, ["left", "right"], None))
    factor = CELL // 96  # 2: 192 pixels in a cell of 200
    top = GAP + TEXT + 8 + (CELL - 96 * factor) // 2  # under the word, centred in the cell
    for index, picture in enumerate([shading.picture, *shading.panels]):
        left = GAP + index * (CELL + GAP) + (CELL - 96 * factor) // 2
        shown = sheet[top : top + 96 * factor, left : left + 96 * factor]
        np.testing.assert_array_equal(shown, np.asarray(picture).repeat(factor, 0).repeat(factor, 1))
        assert (sheet[top - 1, left : left + 96 * factor] == 255).all()  # white just above: nothing cut off
    words = sheet[GAP : GAP + TEXT + 8, GAP + CELL + GAP : GAP + 2 * CELL + GAP]
    assert (words.min(axis=-1) < 100).sum() > 20  # the word over its panel is drawn
    large = overlay.shade(noise.resize((400, 400)), ["left"], alphas[:1], (2, 2))
    shrunk = np.asarray(sheet_picture(large, ["left"], None))[top - (CELL - 192) // 2 :][:CELL, GAP : GAP + CELL]
    assert (shrunk != 255).all(axis=-1).sum() > 0.95 * CELL * CELL  # 400 pixels shown in the cell's 200


def test_the_strip_holds_every_panel_as_is_on_jpeg_blocks_in_rows_a_jpeg_can_hold():
    from captioner.viz.sheet import BLOCK, JPEG_SIDE, Strip, strip_picture

    noise = Image.fromarray(np.random.default_rng(1).integers(0, 256, (6, 10, 3), dtype=np.uint8))  # 10 x 6
    words = [f"w{k}" for k in range(7)]
    shading = overlay.shade(noise, words, torch.rand(7, 4).softmax(-1), (2, 2))
    strip = Strip((10, 6), 7)
    assert (strip.stride, strip.columns, strip.picture_size) == ((16, 8), 5, (80, 16))
    assert [strip.corner(k) for k in (0, 4, 5, 6)] == [(0, 0), (64, 0), (0, 8), (16, 8)]
    pixels = np.asarray(strip_picture(shading))
    assert pixels.shape == (16, 80, 3)
    for step, panel in enumerate(shading.panels):
        x, y = strip.corner(step)
        np.testing.assert_array_equal(pixels[y : y + 6, x : x + 10], np.asarray(panel))  # each panel as it is
        assert (pixels[y : y + 8, x + 10 : x + 16] == 255).all() and (pixels[y + 6 : y + 8, x : x + 16] == 255).all()
    assert (pixels[8:, 32:] == 255).all()  # no panel after the last
    tall = Strip((448, 20_000), 20)  # five to a row would make a JPEG taller than it can be
    assert tall.columns == 7 and tall.picture_size[1] <= JPEG_SIDE and tall.stride == (448, 20_000)
    assert Strip((3, 3), 2).stride == (BLOCK, BLOCK) and Strip((3, 3), 2).columns == 2
