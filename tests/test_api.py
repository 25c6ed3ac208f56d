"""The Python API for notebooks: ``from captioner import load_model, show_attention``; ``model.caption`` on
file paths, PIL images and image tensors gives the same captions and attention as the command line."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor

import captioner
from captioner.config import DecodingConfig
from captioner.data.images import ImageError
from captioner.errors import ConfigError
from captioner.inference import Captioned, caption_files
from conftest import ROOT, write_bundle

WORDS = ["a", "red", "blue", "circle", "square", "left", "of"]
GREEDY = {"method": "greedy", "max_len": 4}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A training run's folder holding a (soft attention) bundle."""
    folder = tmp_path_factory.mktemp("runs") / "2026-01-01_00-00-00"
    folder.mkdir()
    write_bundle(folder / "bundle.pt", WORDS)
    return folder


@pytest.fixture(scope="module")
def model(run: Path) -> captioner.LoadedModel:
    return captioner.load_model(run)  # a run folder means its bundle.pt


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """Three images of different sizes and modes."""
    folder = tmp_path_factory.mktemp("photos")
    paths = []
    for i, (size, mode) in enumerate((((64, 48), "RGB"), ((40, 90), "L"), ((96, 96), "RGBA"))):
        torch.manual_seed(i)
        pixels = (torch.rand(size[1], size[0], 3) * 255).to(torch.uint8).numpy()
        paths.append(folder / f"{i}.png")
        Image.fromarray(pixels).convert(mode).save(paths[-1])
    return paths


def test_import_captioner_is_cheap_and_names_its_api():
    code = "import sys, captioner; print(sorted(m for m in ('torch', 'lightning', 'matplotlib') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stderr
    assert {"load_model", "show_attention", "Captioned", "LoadedModel", "__version__"} <= set(dir(captioner))
    assert captioner.load_model is captioner.inference.load_model
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        captioner.nothing  # noqa: B018


def test_a_path_a_pil_image_and_tensors_give_the_same_caption_and_attention(model, photos):
    image = Image.open(photos[1])
    rgb = image.convert("RGB")
    uint8 = pil_to_tensor(rgb)  # (3, H, W) uint8, as torchvision.io.read_image gives
    results = [
        model.caption(source, **GREEDY)
        for source in (photos[1], str(photos[1]), image, uint8, uint8.float() / 255, pil_to_tensor(image.convert("L")))
    ]
    first = results[0]
    assert isinstance(first, Captioned) and len(first.words) == 4 and first.caption == " ".join(first.words)
    assert first.path == str(photos[1]) and first.image is None
    assert first.alphas.shape == (4, 9) and first.grid == (3, 3)
    assert torch.allclose(first.alphas.sum(dim=1), torch.ones(4), atol=1e-5)
    assert isinstance(first.score, float) and first.score < 0  # a summed log-probability
    for other in results[1:]:
        assert other.words == first.words
        assert other.score == pytest.approx(first.score, abs=1e-5)
        assert torch.allclose(other.alphas, first.alphas, atol=1e-6)
    assert results[2].path is None and results[2].image is image  # kept for show_attention
    (files,) = list(caption_files(model, [str(photos[1])], decoding=DecodingConfig(**GREEDY)))  # the CLI's path
    assert files.words == first.words and torch.equal(files.alphas, first.alphas)


def test_a_list_or_a_batch_tensor_gives_one_result_per_image_in_order(model, photos):
    one_by_one = [model.caption(p, **GREEDY) for p in photos]
    batched = model.caption([str(p) for p in photos], batch_size=2, **GREEDY)
    assert [r.words for r in batched] == [r.words for r in one_by_one]
    assert [r.path for r in batched] == [str(p) for p in photos]
    for a, b in zip(batched, one_by_one):
        assert torch.allclose(a.alphas, b.alphas, atol=1e-5)
    square = [pil_to_tensor(Image.open(p).convert("RGB").resize((50, 50))) for p in photos]
    stacked = model.caption(torch.stack(square), **GREEDY)  # (B, 3, H, W)
    assert [r.words for r in stacked] == [model.caption(t, **GREEDY).words for t in square]
    assert model.caption([], **GREEDY) == []
    generated = model.caption((p for p in photos), batch_size=2, **GREEDY)  # a generator: Path.glob's, say
    assert [(r.path, r.words) for r in generated] == [(r.path, r.words) for r in batched]
    assert model.caption(photos[0], **GREEDY).words == one_by_one[0].words  # a Path stays one image


def test_decoding_options_reach_generate(model, photos):
    assert len(model.caption(photos[0], method="greedy", max_len=2).words) == 2
    greedy = model.caption(photos[0], **GREEDY)
    assert model.caption(photos[0], method="beam", beam_size=1, max_len=4).words == greedy.words  # beam of one
    with pytest.raises(TypeError, match="no_such_option"):
        model.caption(photos[0], no_such_option=1)


def test_decoding_keywords_are_checked_as_the_command_line_checks_its_flags(model, photos):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'beamsize'; did you mean 'beam_size'\?"):
        model.caption(photos[0], beamsize=5)
    refused = {
        "beam_size goes with method='beam' or method='diverse'; this call decodes with method='greedy'": dict(
            method="greedy", beam_size=5
        ),
        "seed goes with method='sample'; this call decodes with method='beam' (the default)": dict(seed=3),
        "temperature goes with method='sample'; this call decodes with method='greedy'": dict(
            method="greedy", temperature=0.5
        ),
    }
    for message, settings in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            model.caption(photos[0], **settings)
    with pytest.raises(ConfigError, match="seed=-1 must be in"):
        model.caption(photos[0], method="sample", seed=-1)


def test_a_seed_gives_the_same_samples_as_the_command_line_s_and_leaves_torch_s_generator_alone(model, photos):
    state = torch.get_rng_state()
    sampled = [model.caption(photos, method="sample", seed=seed, temperature=3.0, max_len=6) for seed in (3, 3, 4)]
    assert torch.equal(torch.get_rng_state(), state)
    assert [r.words for r in sampled[0]] == [r.words for r in sampled[1]]
    assert [r.words for r in sampled[0]] != [r.words for r in sampled[2]]
    paths = [str(p) for p in photos]
    decoding = DecodingConfig(method="sample", seed=3, temperature=3.0, max_len=6)
    files = list(caption_files(model, paths, workers=0, decoding=decoding))  # the CLI's path, --seed 3
    assert [r.words for r in files] == [r.words for r in sampled[0]]


@pytest.mark.parametrize(
    "image, error, message",
    [
        (123, TypeError, r"a tensor or a numpy array, not int \(123\)"),
        (torch.rand(2, 3), ValueError, r"\(3, H, W\) or \(1, H, W\), got \(2, 3\)"),
        (torch.rand(4, 8, 8), ValueError, r"got \(4, 8, 8\)"),
        (torch.rand(3, 8, 8) * 2 - 1, ValueError, "values in \\[0, 1\\] \\(not normalised\\)"),
        (torch.zeros(3, 8, 8, dtype=torch.int64), ValueError, "uint8 or floating point"),
        (np.zeros((0, 8, 3), np.uint8), ValueError, "the image is 8x0 pixels: it has none to caption"),
        (Image.new("RGB", (5, 0)), ValueError, "the image is 5x0 pixels"),  # was captioned as a black image
        ("missing.jpg", ImageError, "missing.jpg: file not found"),
    ],
)
def test_what_cannot_be_captioned_is_one_clear_error(model, image, error, message):
    with pytest.raises(error, match=message):
        model.caption(image, **GREEDY)


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_show_attention_draws_one_panel_per_word(mode, photos, tmp_path):
    model = captioner.load_model(write_bundle(tmp_path / f"{mode}.pt", WORDS, mode))
    for source in (photos[0], Image.open(photos[0]), pil_to_tensor(Image.open(photos[0]).convert("RGB"))):
        result = model.caption(source, **GREEDY)
        fig = captioner.show_attention(result)
        assert isinstance(fig, Figure)
        panels = fig.axes[1 : 1 + len(result.words)]
        assert len(fig.axes) == 1 + len(result.words) + bool(result.words)  # image, words, colour bar
        assert [ax.get_title() for ax in panels] == result.words
        assert fig.get_suptitle() == result.caption
        marks = [sum(isinstance(p, Rectangle) for p in ax.patches) for ax in panels]
        assert marks == [1 if mode == "hard" else 0] * len(result.words)  # hard: the attended cell outlined
        height, width = fig.axes[0].images[0].get_array().shape[:2]
        assert (width, height) == Image.open(photos[0]).size  # the image itself, not the model's input
    if mode == "hard":
        assert result.locations == result.alphas.argmax(dim=1).tolist()
    result.image = None
    with pytest.raises(ValueError, match="pass image="):
        captioner.show_attention(result)
    assert len(captioner.show_attention(result, image=photos[0]).axes) == 1 + len(result.words) + 1  # + colour bar


def test_the_readme_example_runs(run, photos, tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Python API.*?```python\n(.*?)```", readme, re.DOTALL).group(1)
    assert "from captioner import load_model, show_attention" in block
    shutil.copy(photos[0], tmp_path / "photo.jpg")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(block.replace("outputs/train/runs/<run>", str(run)), namespace)  # noqa: S102
    assert isinstance(namespace["fig"], Figure)
    assert (tmp_path / "photo_attention.png").is_file()


def test_a_list_gives_a_result_per_input_with_an_error_for_a_broken_one(model, photos, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_text("not an image")
    good = model.caption(photos[0], **GREEDY)
    results = model.caption([photos[0], broken, 123, photos[0]], batch_size=3, **GREEDY)
    assert [r.error is None for r in results] == [True, False, False, True]
    assert results[0].words == results[3].words == good.words
    assert results[1].path == str(broken) and results[1].words == [] and "not an image file" in results[1].error
    assert [r.caption for r in results] == [good.caption, None, None, good.caption]  # a failure has no caption
    assert isinstance(good.caption, str) and math.isnan(results[1].score)
    assert results[2].image == 123 and results[2].error == (
        "an image is a file path, a PIL image, a tensor or a numpy array, not int (123)"
    )
    assert repr(results[1]) == f"Captioned({str(broken)!r}, error={results[1].error!r})"
    with pytest.raises(ImageError, match="not an image file"):
        model.caption([photos[0], broken], raise_errors=True, **GREEDY)
    with pytest.raises(ImageError):
        model.caption(broken, **GREEDY)  # a single image: there is no list to hold its error
    with pytest.raises(ValueError, match="was not captioned"):
        captioner.show_attention(results[1])


def test_numpy_arrays_are_images(model, photos):
    rgb = Image.open(photos[0]).convert("RGB")
    array = np.asarray(rgb)  # (H, W, 3) uint8
    from_file = model.caption(photos[0], **GREEDY)
    from_array = model.caption(array, **GREEDY)
    assert from_array.words == from_file.words and torch.allclose(from_array.alphas, from_file.alphas, atol=1e-6)
    batch = model.caption(np.stack([array, array[::-1]]), **GREEDY)  # (B, H, W, 3)
    assert len(batch) == 2 and batch[0].words == from_file.words
    assert (
        model.caption(np.asarray(rgb.convert("L")), **GREEDY).words == model.caption(rgb.convert("L"), **GREEDY).words
    )
    with pytest.raises(ValueError, match=r"must be uint8 of shape \(H, W, 3\), \(H, W, 4\) or \(H, W\), got float64"):
        model.caption(array / 255.0, **GREEDY)
    assert captioner.show_attention(from_array).axes[0].images[0].get_array().shape[:2] == array.shape[:2]


def test_show_attention_of_a_list_draws_each(model, photos):
    results = model.caption([photos[0], photos[1]], **GREEDY)
    figures = captioner.show_attention(results)
    assert [type(f) for f in figures] == [Figure, Figure]
    assert [f.get_suptitle() for f in figures] == [r.caption for r in results]
    with pytest.raises(ValueError, match="image= goes with one result"):
        captioner.show_attention(results, image=photos[0])


def test_show_attention_of_a_list_draws_the_captioned_and_names_those_left_out(model, photos, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_text("not an image")
    results = model.caption([photos[0], broken, photos[1]], **GREEDY)
    assert results[1].error == "not an image file (Pillow cannot identify its format)"  # the path is .path
    left_out = rf"1 of 3 results not drawn \(not captioned\): {re.escape(str(broken))} \(not an image file"
    with pytest.warns(UserWarning, match=left_out):
        figures = captioner.show_attention(results)
    assert [f.get_suptitle() for f in figures] == [results[0].caption, results[2].caption]
    with pytest.raises(ValueError, match="was not captioned") as info:
        captioner.show_attention(results[1])
    assert str(info.value).count(str(broken)) == 1


def test_max_pixels_lets_a_large_image_through(model, photos, monkeypatch):
    expected = model.caption(Image.open(photos[2]), **GREEDY).words
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # photos[2] is a 96x96 PNG: 9,216 pixels
    with pytest.raises(ImageError, match=r"over the limit of 5,000.*\(max_pixels=N in Python\)"):
        model.caption(photos[2], **GREEDY)
    result = model.caption(photos[2], max_pixels=10_000, **GREEDY)
    assert result.words == expected
    assert [r.error is None for r in model.caption([photos[0], photos[2]], **GREEDY)] == [True, False]
    with pytest.raises(ImageError, match="over the limit"):
        captioner.show_attention(result)
    assert isinstance(captioner.show_attention(result, max_pixels=10_000), Figure)


def test_repr_is_a_one_paragraph_summary(model, run):
    text = repr(model)
    assert text == (
        f"LoadedModel: resnet18 (last stage) -> a 3x3 grid of 512 channels at {model.image_size} px; soft attention "
        f"(AdditiveAttention); {len(model.vocab)} words; loaded from {run}"
    )
    assert "\n" not in text and model.grid == (3, 3)


@pytest.mark.parametrize("max_pixels", [0, -5, 2.5, "many"])
def test_a_bad_max_pixels_is_a_config_error_for_the_call_whatever_the_images(model, photos, max_pixels):
    """Checked once, before any image is read, as the decoding keywords are: for a file, a PIL image (which
    max_pixels does not limit) and a list of both alike, never a file's ``.error``; caption_files too."""
    picture = Image.open(photos[0])
    for images in (photos[0], picture, [picture], [photos[0], picture]):
        with pytest.raises(ConfigError, match=f"^max_pixels={max_pixels!r} must be"):
            model.caption(images, max_pixels=max_pixels, **GREEDY)
    with pytest.raises(ConfigError, match=f"^max_pixels={max_pixels!r} must be"):
        next(caption_files(model, [str(photos[0])], workers=0, max_pixels=max_pixels))
