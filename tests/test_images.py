"""load_rgb: every Pillow mode to RGB, EXIF orientation, first frames, and one-line errors."""

from __future__ import annotations

import pickle
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.data.images import ImageError, load_rgb, to_rgb
from captioner.errors import ConfigError, DataError

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def pixels(path: Path) -> np.ndarray:
    """Decode with load_rgb, check it is RGB, return (H, W, 3) int array."""
    image = load_rgb(path)
    assert image.mode == "RGB"
    return np.asarray(image).astype(int)


def save(image: Image.Image, path: Path, **kwargs) -> Path:
    image.save(path, **kwargs)
    return path


def test_bilevel_and_grey(tmp_path):
    bilevel = Image.new("1", (3, 1), 0)
    bilevel.putpixel((1, 0), 1)
    assert pixels(save(bilevel, tmp_path / "b.png"))[0].tolist() == [[0, 0, 0], [255, 255, 255], [0, 0, 0]]
    grey = Image.fromarray(np.array([[0, 100, 255]], dtype=np.uint8), "L")
    assert pixels(save(grey, tmp_path / "l.png"))[0].tolist() == [[0] * 3, [100] * 3, [255] * 3]


def test_grey_with_alpha_is_composited_on_white(tmp_path):
    grey_alpha = np.array([[[50, 255], [50, 0], [0, 128]]], dtype=np.uint8)
    values = pixels(save(Image.fromarray(grey_alpha, "LA"), tmp_path / "la.png"))[0]
    assert values[0].tolist() == [50] * 3  # opaque: its own value
    assert values[1].tolist() == [255] * 3  # transparent: white
    assert abs(values[2][0] - 127) <= 1  # half-transparent black over white


def test_rgba_is_composited_on_white(tmp_path):
    rgba = np.array([[[255, 0, 0, 255], [255, 0, 0, 0], [0, 0, 255, 128]]], dtype=np.uint8)
    values = pixels(save(Image.fromarray(rgba, "RGBA"), tmp_path / "rgba.png"))[0]
    assert values[0].tolist() == list(RED)
    assert values[1].tolist() == list(WHITE)
    assert values[2][2] == 255 and abs(values[2][0] - 127) <= 1


@pytest.mark.parametrize("suffix", ["png", "gif"])
def test_palette_with_transparency(tmp_path, suffix):
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, *RED, *BLUE] + [0] * (256 * 3 - 9))
    palette.putpixel((0, 0), 0)  # transparent index
    palette.putpixel((1, 0), 2)
    path = save(palette, tmp_path / f"p.{suffix}", transparency=0)
    assert pixels(path)[0].tolist() == [list(WHITE), list(BLUE)]


def test_palette_without_transparency(tmp_path):
    palette = Image.new("P", (2, 1))
    palette.putpalette([*RED, *BLUE] + [0] * (256 * 3 - 6))
    palette.putpixel((1, 0), 1)
    assert pixels(save(palette, tmp_path / "p.png"))[0].tolist() == [list(RED), list(BLUE)]


@pytest.mark.parametrize("suffix", ["tif", "jpg"])
def test_cmyk(tmp_path, suffix):
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # pure red in CMYK
    values = pixels(save(cmyk, tmp_path / f"c.{suffix}"))
    assert np.abs(values - np.array(RED)).max() <= 3


@pytest.mark.parametrize("suffix", ["png", "tif"])
def test_16_bit_is_scaled_not_clipped(tmp_path, suffix):
    levels = np.array([[0, 257, 32768, 65535]], dtype=np.uint16)
    image = Image.fromarray(levels)
    assert image.mode == "I;16"
    values = pixels(save(image, tmp_path / f"g16.{suffix}"))[0]
    assert values[:, 0].tolist() == [0, 1, 128, 255]
    assert (values == values[:, :1]).all()  # grey


def test_32_bit_integer_mode(tmp_path):
    in_range = Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.int32))
    assert in_range.mode == "I"
    assert pixels(save(in_range, tmp_path / "i.tif"))[0, :, 0].tolist() == [0, 128, 255]
    wide = Image.fromarray(np.array([[-1000, 49000, 99000]], dtype=np.int32))
    assert pixels(save(wide, tmp_path / "wide.tif"))[0, :, 0].tolist() == [0, 128, 255]  # stretched


def test_float_mode(tmp_path):
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    assert unit.mode == "F"
    assert pixels(save(unit, tmp_path / "f.tif"))[0, :, 0].tolist() == [0, 128, 255]
    large = Image.fromarray(np.array([[-2.0, 0.0, 2.0]], dtype=np.float32))
    assert pixels(save(large, tmp_path / "f2.tif"))[0, :, 0].tolist() == [0, 128, 255]


def test_exif_orientation_is_honoured(tmp_path):
    # Stored 32 wide x 16 tall: left half red, right half blue. Orientation 6 = rotate 90 degrees
    # clockwise to display, so the upright image is 16 wide x 32 tall with red on top, blue below.
    stored = np.zeros((16, 32, 3), dtype=np.uint8)
    stored[:, :16] = RED
    stored[:, 16:] = BLUE
    exif = Image.Exif()
    exif[0x0112] = 6
    path = save(Image.fromarray(stored), tmp_path / "rotated.jpg", exif=exif, quality=95)
    values = pixels(path)
    assert values.shape == (32, 16, 3)
    assert np.abs(values[4:12, 4:12] - np.array(RED)).max() < 40
    assert np.abs(values[20:28, 4:12] - np.array(BLUE)).max() < 40


@pytest.mark.parametrize("suffix", ["gif", "tif", "webp"])
def test_first_frame_of_multi_frame_files(tmp_path, suffix):
    frames = [Image.new("RGB", (8, 8), RED), Image.new("RGB", (8, 8), BLUE)]
    kwargs = {"lossless": True} if suffix == "webp" else {}
    path = save(frames[0], tmp_path / f"anim.{suffix}", save_all=True, append_images=frames[1:], **kwargs)
    with Image.open(path) as image:
        assert image.n_frames == 2
    assert np.abs(pixels(path) - np.array(RED)).max() <= 2


def test_webp_and_progressive_jpeg(tmp_path):
    colour = (30, 160, 90)
    webp = save(Image.new("RGB", (16, 16), colour), tmp_path / "a.webp", lossless=True)
    assert (pixels(webp) == np.array(colour)).all()
    jpeg = save(Image.new("RGB", (16, 16), colour), tmp_path / "p.jpg", progressive=True, quality=95)
    with Image.open(jpeg) as image:
        assert image.info.get("progressive") == 1
    assert np.abs(pixels(jpeg) - np.array(colour)).max() <= 4


def truncated_png(path: Path) -> Path:
    noise = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def truncated_jpeg(path: Path) -> Path:
    noise = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path, quality=90)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: p, "file not found"),
        (lambda p: (p.mkdir(), p)[1], "is a directory"),
        (lambda p: (p.write_bytes(b""), p)[1], "file is empty"),
        (lambda p: (p.write_text("hello, not an image\n"), p)[1], "not an image file"),
        (truncated_png, "truncated or corrupt"),
        (truncated_jpeg, "truncated or corrupt"),
    ],
)
def test_errors_are_one_line_naming_the_file(tmp_path, make, reason):
    path = make(tmp_path / "bad.png")
    with pytest.raises(ImageError) as info:
        load_rgb(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and reason in message
    assert "\n" not in message
    assert isinstance(info.value, DataError)
    assert (info.value.path, info.value.reason) == (str(path), message[len(f"{path}: ") :])


# 400 pixels: over twice the limit of 100 (Pillow's error), over the limit of 300 (its warning)
@pytest.mark.parametrize("limit", [100, 300])
def test_decompression_bomb_is_refused(tmp_path, monkeypatch, limit):
    path = save(Image.new("RGB", (20, 20), RED), tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    with pytest.raises(ImageError, match="decompression bomb") as info:
        load_rgb(path)
    assert str(info.value) == (
        f"{path}: image too large: 20x20 is 400 pixels, over the limit of {limit:,}, refused as a possible "
        "decompression bomb; for a file you trust raise the limit with --max-pixels N (max_pixels=N in Python)"
    )


def test_max_pixels_raises_the_limit_and_leaves_pillow_s_own_alone(tmp_path, monkeypatch):
    path = save(Image.new("RGB", (20, 20), RED), tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 400 pixels: over twice Pillow's limit
    assert load_rgb(path, max_pixels=400).size == (20, 20)
    assert Image.MAX_IMAGE_PIXELS == 100
    with pytest.raises(ImageError, match="over the limit of 399"):
        load_rgb(path, max_pixels=399)
    with pytest.raises(ConfigError, match="max_pixels=0 must be >= 1"):
        load_rgb(path, max_pixels=0)


class Watched(types.ModuleType):
    """PIL.Image while a test watches it: setting its process-wide ``MAX_IMAGE_PIXELS`` fails the test."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "MAX_IMAGE_PIXELS":
            raise AssertionError(f"PIL.Image.MAX_IMAGE_PIXELS set to {value!r}")
        super().__setattr__(name, value)


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_pillow_s_own_limit_is_never_changed_nor_in_the_way_of_max_pixels(tmp_path, monkeypatch):
    png = save(Image.new("RGB", (20, 20), RED), tmp_path / "big.png")
    jpeg = save(Image.new("RGB", (800, 600), BLUE), tmp_path / "large.jpg")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 400 pixels: over twice Pillow's limit (its error)
    monkeypatch.setattr(Image, "__class__", Watched)  # changed for a call, it races with other threads' calls
    with ThreadPoolExecutor(4) as pool:
        sizes = list(pool.map(lambda path: load_rgb(path, max_pixels=400).size, [png] * 8))
    assert sizes == [(20, 20)] * 8
    assert load_rgb(jpeg, max_pixels=40_000, size=96).size == (200, 150)  # 480,000 pixels drafted at 1/4
    with pytest.raises(ImageError) as info:
        load_rgb(png)
    assert str(info.value) == (
        f"{png}: image too large: 20x20 is 400 pixels, over the limit of 100, refused as a possible decompression "
        "bomb; for a file you trust raise the limit with --max-pixels N (max_pixels=N in Python)"
    )
    tiff = save(Image.new("RGB", (20, 20), RED), tmp_path / "big.tif")  # Pillow's TIFF decoder checks its limit
    with pytest.raises(ImageError, match=r"big.tif: image too large: Image size \(400 pixels\) exceeds limit of 200"):
        load_rgb(tiff, max_pixels=400)
    assert Image.MAX_IMAGE_PIXELS == 100


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_a_file_past_pillow_s_own_limit_that_max_pixels_allows_decodes_without_pillow_s_warning(tmp_path, monkeypatch):
    """Pillow's TIFF decoder warns past Pillow's limit (a raw line on stderr, with its source line): an image
    that ``max_pixels`` allowed decodes without it, in any thread, and the process's warning filters are
    left as they were."""
    tiff = save(Image.new("RGB", (20, 20), RED), tmp_path / "big.tif")
    png = save(Image.new("RGB", (20, 20), BLUE), tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)  # 400 pixels: past it, within twice it (a warning)
    with pytest.warns(Image.DecompressionBombWarning):
        Image.open(tiff).load()  # what load_rgb keeps quiet
    filters = list(warnings.filters)
    with ThreadPoolExecutor(4) as pool:
        sizes = list(pool.map(lambda path: load_rgb(path, max_pixels=400).size, [tiff, png] * 4))
    assert sizes == [(20, 20)] * 8 and warnings.filters == filters
    with pytest.raises(ImageError, match="20x20 is 400 pixels, over the limit of 300"):
        load_rgb(tiff)  # without max_pixels Pillow's limit is the limit: refused in one line, as before


def test_a_jpeg_over_the_limit_is_decoded_at_a_reduced_scale(tmp_path, monkeypatch):
    gradient = np.linspace(0, 255, 800, dtype=np.uint8)[None, :, None].repeat(600, 0).repeat(3, 2)  # (600, 800, 3)
    jpeg = save(Image.fromarray(gradient), tmp_path / "large.jpg", quality=95)
    png = save(Image.fromarray(gradient), tmp_path / "large.png")
    full = np.asarray(Image.open(jpeg).convert("RGB").resize((200, 150), Image.Resampling.BOX)).astype(int)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)  # 480,000 pixels: over it
    # libjpeg decodes at 1/4: each side still at least the 96 px the model reads, 30,000 pixels
    small = load_rgb(jpeg, size=96)
    assert small.size == (200, 150)
    assert np.abs(np.asarray(small).astype(int) - full).mean() < 2  # the same picture, smaller
    assert load_rgb(jpeg, size=96, max_pixels=500_000).size == (800, 600)  # under the limit: decoded whole
    # no size (to draw it): the least reduction that brings it under the limit
    assert load_rgb(jpeg).size == (200, 150) and load_rgb(jpeg, max_pixels=120_000).size == (400, 300)
    for path, size in ((png, 96), (jpeg, 700)):  # not a JPEG, or no reduction keeps 700 px a side
        with pytest.raises(ImageError, match="800x600 is 480,000 pixels, over the limit of 100,000"):
            load_rgb(path, size=size)
    with pytest.raises(ImageError, match=r"800x600 \(at 1/8 scale: 100x75\) is 7,500 pixels, over the limit of 5,000"):
        load_rgb(jpeg, max_pixels=5_000)


def test_the_draft_scale_is_chosen_by_the_size_libjpeg_decodes(tmp_path):
    """libjpeg decodes ceil(W / s) x ceil(H / s): 2001x1999 at 1/2 is 1001x1000, over 1,000,000 pixels, so 1/4;
    the scale picked by floor(W / s) x floor(H / s) (1000x999: under) was refused once decoded."""
    jpeg = save(Image.new("RGB", (2001, 1999), (200, 40, 40)), tmp_path / "odd.jpg")
    assert load_rgb(jpeg, max_pixels=1_000_000).size == (501, 500)
    assert load_rgb(jpeg, max_pixels=1_001_000).size == (1001, 1000)  # 1/2 fits exactly
    assert load_rgb(jpeg, max_pixels=1_000_000, size=224).size == (251, 250)


def test_image_error_survives_pickling():
    error = pickle.loads(pickle.dumps(ImageError("a/b.jpg", "file is empty")))
    assert str(error) == "a/b.jpg: file is empty" and error.reason == "file is empty"


def test_an_image_in_memory_becomes_the_rgb_image_of_its_file(tmp_path):
    rng = np.random.default_rng(0)
    grey = Image.fromarray(rng.integers(0, 256, (9, 7), dtype=np.uint8), "L")
    expected = pixels(save(grey, tmp_path / "grey.png"))
    levels = torch.from_numpy(np.asarray(grey).copy())[None]  # (1, H, W) uint8
    for image in (grey, levels, levels.expand(3, -1, -1), levels.double() / 255, levels.float() / 255):
        converted = to_rgb(image)
        assert converted.mode == "RGB" and np.asarray(converted).astype(int).tolist() == expected.tolist()
    with pytest.raises(ValueError, match=r"in \[0, 1\] \(not normalised\), got \[-0.5, 1\]"):
        to_rgb(torch.tensor([[[-0.5, 1.0]]]))
    with pytest.raises(TypeError, match="not a ndarray"):
        to_rgb(np.zeros((3, 4, 4)))
