"""Batched captioning of files: one result per path in input order, bad files in place, any image size."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from captioner.config import DecodingConfig
from captioner.data.dataset import Skipped
from captioner.inference import Captioned, ImageFiles, LoadedModel, caption_files
from conftest import never_ending_captioner

IMAGE_SIZE = 64  # resnet18: a 2x2 grid
BEAM = DecodingConfig(method="beam", beam_size=2, max_len=3)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    """An untrained captioner whose captions never end (always max_len words)."""
    model, vocab, config = never_ending_captioner(["a", "red", "blue", "circle", "square"])
    return LoadedModel(model, vocab, config, IMAGE_SIZE)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """Five different images of odd sizes and a broken file in the middle: paths as a user gives them."""
    folder = tmp_path_factory.mktemp("images")
    sizes = [(40, 30), (1, 1), (3, 500), (2000, 4), (7, 9)]
    paths = []
    for i, size in enumerate(sizes):
        image = Image.effect_noise(size, 40 + 20 * i).convert("RGB")
        image.save(folder / f"{i}.png")
        paths.append(str(folder / f"{i}.png"))
    (folder / "broken.png").write_bytes(b"not an image")
    return [*paths[:2], str(folder / "broken.png"), *paths[2:]]


def test_any_size_is_resized_to_the_model_input(files):
    dataset = ImageFiles(files, IMAGE_SIZE)
    for index in (0, 1, 3, 4):  # 40x30, 1x1, 3x500, 2000x4
        image = dataset[index]
        assert image.shape == (3, IMAGE_SIZE, IMAGE_SIZE) and torch.isfinite(image).all()


def test_an_unreadable_file_is_skipped_with_the_path_as_given_and_its_reason(files, tmp_path):
    dataset = ImageFiles([files[2], "./no/such.png", str(tmp_path)], IMAGE_SIZE)
    assert dataset[0] == Skipped(files[2], "not an image file (Pillow cannot identify its format)")
    assert dataset[1] == Skipped("./no/such.png", "file not found")
    assert dataset[2] == Skipped(str(tmp_path), "is a directory, not an image file")


def test_batches_give_the_captions_of_one_by_one_in_input_order(loaded, files, monkeypatch):
    batch_sizes = []
    generate = loaded.model.generate

    def spy(images, *args, **kwargs):
        batch_sizes.append(images.shape[0])
        return generate(images, *args, **kwargs)

    monkeypatch.setattr(loaded.model, "generate", spy)
    alone = list(caption_files(loaded, files, batch_size=1, decoding=BEAM))
    assert batch_sizes == [1] * 5
    batch_sizes.clear()
    batched = list(caption_files(loaded, files, batch_size=4, workers=2, decoding=BEAM))
    assert batch_sizes == [3, 2]  # the encoder and decoder run once per batch, on its readable images
    assert [r.path for r in batched] == files
    assert isinstance(batched[2], Skipped) and batched[2].path == files[2]
    for one, many in zip(alone, batched):
        if isinstance(one, Skipped):
            assert one == many
            continue
        assert isinstance(many, Captioned) and len(one.words) == 3 and one.words == many.words
        assert one.score == pytest.approx(many.score, abs=1e-4)
        assert one.grid == many.grid == (2, 2) and one.alphas.shape == (3, 4)
        assert torch.allclose(one.alphas, many.alphas, atol=1e-5)
        assert torch.allclose(one.alphas.sum(dim=1), torch.ones(3), atol=1e-5)
    scores = [r.score for r in batched if isinstance(r, Captioned)]
    assert len(set(scores)) == len(scores)  # each image its own result, not a neighbour's


def test_progress_bar_on_stderr(loaded, files, capsys):
    list(caption_files(loaded, files[:2], progress=True, decoding=DecodingConfig(method="greedy", max_len=2)))
    err = capsys.readouterr().err
    assert "captioning" in err and "2/2" in err


def test_hard_inference_option_sets_what_the_loaded_model_reads_and_says(tmp_path) -> None:
    """``--hard-inference`` changes the loaded model's config, which its decoder reads: the config a caller sees
    is the read (it was a decoder attribute the CLI changed alone, the config still saying argmax)."""
    import argparse

    from captioner.cli.options import load
    from conftest import write_bundle

    bundle = write_bundle(tmp_path / "hard.pt", ["a", "red", "circle"], mode="hard")
    args = argparse.Namespace(model=[str(bundle)], hard_inference="expectation", given=set())
    loaded = load(args, torch.device("cpu"))
    assert loaded.config.decoder.hard_inference == "expectation" and loaded.model.decoder.hard_read == "expectation"
    default = load(argparse.Namespace(model=[str(bundle)], hard_inference=None, given=set()), torch.device("cpu"))
    assert default.config.decoder.hard_inference == "argmax" and default.model.decoder.hard_read == "argmax"
