"""JPEGs decoded on the model's device (``data.decode=device``, ``captioner caption --decode device``), checked on
the CPU, where torchvision's decoder is libjpeg-turbo as Pillow's is: the batch the device path makes equals the one
the loader workers make with Pillow within one grey level (the resize of a uint8 tensor rounds where Pillow's
does not always), image by image fallbacks to Pillow are counted, and unreadable images are skipped as before."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from test_datamodule import ListSource
from torchvision.transforms.v2.functional import pil_to_tensor

from captioner.config import DataConfig, DecodingConfig, ImageDecoding, from_dict
from captioner.data import device_decoding
from captioner.data.dataset import (
    IMAGENET_STD,
    CaptionDataset,
    Skipped,
    Undecoded,
    build_transform,
    collate,
    defer,
)
from captioner.data.device_decoding import (
    REFUSED,
    DecodeTally,
    Encoded,
    Pillowed,
    decode_jpegs,
    on_device,
    read_for_device,
    upright,
)
from captioner.data.images import ImageError, load_rgb
from captioner.data.readers import Record
from captioner.data.vocab import Vocabulary
from captioner.inference import LoadedModel, caption_files
from captioner.training.datamodule import CaptionDataModule
from conftest import never_ending_captioner

SIZE = 48
CPU = torch.device("cpu")
# one grey level of the [0, 255] picture, in the normalised units of each channel
LEVEL = torch.tensor([1 / 255 / s for s in IMAGENET_STD]).view(3, 1, 1)
ORIENTATION = 0x0112  # the EXIF tag


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like RGB picture: smooth colour fields and grain (as benchmarks/data_loading.py writes them)."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.BICUBIC), dtype=np.float32)
    return Image.fromarray(np.clip(smooth + rng.normal(0.0, 12.0, smooth.shape), 0, 255).astype(np.uint8))


def jpeg_bytes(picture: Image.Image, **options: object) -> bytes:
    out = io.BytesIO()
    picture.save(out, "JPEG", **{"quality": 90, **options})
    return out.getvalue()


def turned(picture: Image.Image, orientation: int) -> bytes:
    """``picture`` as a JPEG whose EXIF says it is stored with ``orientation``."""
    exif = picture.getexif()
    exif[ORIENTATION] = orientation
    return jpeg_bytes(picture, exif=exif)


def without_scan(data: bytes) -> bytes:
    """A JPEG whose header reads (so the worker hands it on) but which has no image data: no decoder reads it."""
    return data[: data.index(b"\xff\xda")] + b"\xff\xd9"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Image files of every kind the two paths treat differently, by name."""
    folder = tmp_path_factory.mktemp("device_decoding")
    rgba = np.dstack([np.asarray(photo(30, 20, 5)), np.tile(np.linspace(0, 255, 30, dtype=np.uint8), (20, 1))])
    contents = {
        "photo.jpg": jpeg_bytes(photo(64, 48, 0)),
        "turned.jpg": turned(photo(50, 70, 1), 6),
        "grey.jpg": jpeg_bytes(photo(40, 40, 2).convert("L")),
        "full_chroma.jpg": jpeg_bytes(photo(45, 33, 3), subsampling=0),
        "alpha.png": _png(Image.fromarray(rgba, "RGBA")),
        "progressive.jpg": jpeg_bytes(photo(64, 48, 4), progressive=True),
        "cmyk.jpg": jpeg_bytes(photo(40, 30, 6).convert("CMYK")),
        "no_scan.jpg": without_scan(jpeg_bytes(photo(40, 30, 7))),
        "half.jpg": jpeg_bytes(photo(64, 48, 8))[:600],
    }
    paths = {}
    for name, data in contents.items():
        (folder / name).write_bytes(data)
        paths[name] = str(folder / name)
    paths["gone.jpg"] = str(folder / "gone.jpg")
    return paths


def _png(picture: Image.Image) -> bytes:
    out = io.BytesIO()
    picture.save(out, "PNG")
    return out.getvalue()


def _dataset(paths: list[str], encoded: bool, train: bool = False, augment: bool = False) -> CaptionDataset:
    records = [Record(path, i, ("a photo", "a picture"), "train") for i, path in enumerate(paths)]
    transform = build_transform(SIZE, train=train, augment=augment)
    return CaptionDataset(records, Vocabulary(["a", "photo", "picture"]), transform, encoded=encoded)


def _both(paths: list[str], tally: DecodeTally, **batching: object) -> tuple[dict, dict]:
    """The batch of ``paths`` as the workers make it with Pillow, and as the device path makes it on the CPU."""
    batches = functools.partial(collate, **batching)
    pillow = batches([item for item in _dataset(paths, encoded=False)])
    dataset = _dataset(paths, encoded=True)
    device = defer(list(dataset), batches, dataset.transform).decoded(CPU, tally)
    return pillow, device


def _levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| of normalised images (B, 3, S, S) in grey levels."""
    return (a - b).abs() / LEVEL


def test_the_device_path_gives_the_pillow_batch_within_one_grey_level(images: dict[str, str]) -> None:
    names = ["photo.jpg", "turned.jpg", "grey.jpg", "full_chroma.jpg"]
    tally = DecodeTally()
    pillow, device = _both([images[name] for name in names], tally)
    assert device["images"].shape == pillow["images"].shape == (4, 3, SIZE, SIZE)
    levels = _levels(device["images"], pillow["images"])
    assert levels.max() <= 1 + 1e-3 and levels.mean() < 0.05  # measured: at most 1, mean 0 to 0.005
    assert levels[1].max() <= 1 + 1e-3  # the turned photo is turned as Pillow turns it
    for key in ("captions", "lengths", "caption_weights", "image_index", "real", "image_ids", "indices"):
        assert torch.equal(device[key], pillow[key]), key
    assert device["skipped"] == pillow["skipped"] == []
    assert (tally.on_device, tally.by_pillow) == (4, {})


@pytest.mark.parametrize("static", [True, False], ids=["training rows", "evaluation rows"])
def test_other_formats_fall_back_to_pillow_and_unreadable_images_are_skipped_as_before(
    images: dict[str, str], static: bool
) -> None:
    names = list(images)  # every kind in one batch
    tally = DecodeTally()
    batching = {"captions_per_image": 2, "rows": len(names) + 2} if static else {}
    pillow, device = _both([images[name] for name in names], tally, **batching)
    assert device["images"].shape == pillow["images"].shape
    assert _levels(device["images"], pillow["images"]).max() <= 1 + 1e-3
    for key in ("captions", "lengths", "caption_weights", "image_index", "real", "image_ids", "indices"):
        assert torch.equal(device[key], pillow[key]), key
    unreadable = [images[name] for name in ("no_scan.jpg", "half.jpg", "gone.jpg")]
    assert [item.path for item in device["skipped"]] == unreadable
    assert device["skipped"] == pillow["skipped"]  # the same reasons, word for word
    if static:  # masked rows where the unreadable images were, and two of padding
        assert device["real"].tolist() == [True] * 7 + [False] * 5
    assert tally.on_device == 4
    assert tally.by_pillow == {"PNG": 1, "progressive JPEG": 1, "CMYK JPEG": 1}
    dataset = _dataset([images[name] for name in names], encoded=True)
    undecoded = defer(list(dataset), collate, dataset.transform)  # what crosses from the worker
    assert undecoded.pixels.shape == (3, 3, SIZE, SIZE)  # Pillow's three, stacked: one copy to the device
    jpegs = [item["image"] for item in undecoded.items if isinstance(item, dict) and item["image"] is not None]
    assert len(jpegs) == 5 and len({item.data.untyped_storage().data_ptr() for item in jpegs}) == 1  # one block
    assert (
        tally.report("cpu") == "images decoded on cpu: 4 JPEGs; by Pillow: 3 (1 PNG, 1 progressive JPEG, 1 CMYK JPEG)"
    )


def test_a_jpeg_the_device_refuses_is_decoded_by_pillow_and_counted(
    images: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = read_for_device(images["turned.jpg"])
    decode = device_decoding.decode_jpeg

    def device_refusing(data: torch.Tensor | list[torch.Tensor], **options: object):
        """The decoder, refusing ``refused`` as nvjpeg refuses what it cannot decode (RuntimeError, the whole call)."""
        alone = data if isinstance(data, list) else [data]
        if any(item.equal(refused.data) for item in alone):
            raise RuntimeError("nvjpeg: the bitstream is not supported")
        return decode(data, **options)

    monkeypatch.setattr(device_decoding, "decode_jpeg", device_refusing)
    tally = DecodeTally()
    pillow, device = _both([images["photo.jpg"], images["turned.jpg"], images["no_scan.jpg"]], tally)
    assert tally.on_device == 1 and tally.by_pillow == {REFUSED: 1}
    assert torch.equal(device["image_ids"], pillow["image_ids"]) and device["skipped"] == pillow["skipped"]
    assert _levels(device["images"], pillow["images"]).max() <= 1 + 1e-3


@pytest.mark.parametrize("orientation", range(1, 9))
def test_each_exif_orientation_is_turned_as_pillow_turns_it(orientation: int) -> None:
    data = turned(photo(20, 12, orientation), orientation)
    encoded = read_for_device("turned.jpg", data=data)
    assert isinstance(encoded, Encoded) and encoded.orientation == orientation
    (image,) = decode_jpegs([encoded], CPU, DecodeTally())
    assert torch.equal(image, pil_to_tensor(load_rgb("turned.jpg", data=data)))  # the same libjpeg-turbo: exact
    assert torch.equal(upright(image, 1), image) and torch.equal(upright(image, 9), image)  # unknown values: as is
    stored = pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
    assert torch.equal(
        upright(stored, orientation), pil_to_tensor(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    )


def test_the_worker_reads_only_what_the_device_decodes_as_pillow_does(images: dict[str, str], tmp_path: Path) -> None:
    photo_jpg = read_for_device(images["photo.jpg"])
    assert isinstance(photo_jpg, Encoded) and photo_jpg.path == images["photo.jpg"]
    assert (
        photo_jpg.data.dtype == torch.uint8 and bytes(photo_jpg.data.numpy()) == Path(images["photo.jpg"]).read_bytes()
    )
    reasons = {name: read_for_device(images[name]) for name in ("alpha.png", "progressive.jpg", "cmyk.jpg")}
    assert {name: read.reason for name, read in reasons.items()} == {
        "alpha.png": "PNG",
        "progressive.jpg": "progressive JPEG",
        "cmyk.jpg": "CMYK JPEG",
    }
    for name, read in reasons.items():  # decoded by Pillow as load_rgb decodes them
        assert isinstance(read, Pillowed) and np.array_equal(np.asarray(read.image), np.asarray(load_rgb(images[name])))
    # over max_pixels: Pillow reads a JPEG at a reduced scale, the size the model needs at least
    big = jpeg_bytes(photo(640, 480, 9))
    read = read_for_device("big.jpg", max_pixels=100_000, size=224, data=big)
    assert isinstance(read, Pillowed) and read.reason == "JPEG over max_pixels" and read.image.size == (320, 240)
    # bytes after the end marker: Pillow decides (it reads the JPEG, ignoring them)
    assert read_for_device("tail.jpg", data=big + b"\0" * 8).reason == "JPEG whose bytes do not end with its end marker"
    adobe_rgb = read_for_device("rgb.jpg", data=_adobe_rgb(photo(16, 16, 10)))
    assert adobe_rgb.reason == "RGB-coded JPEG"


def _adobe_rgb(picture: Image.Image) -> bytes:
    """A JPEG whose Adobe marker says its channels are R, G, B (transform 0), not YCbCr: Pillow's CMYK-free way
    to write one is to patch the marker into a baseline file."""
    data = jpeg_bytes(picture)
    marker = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00"  # version 100, flags 0, transform 0
    return data[:2] + marker + data[2:]


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda folder: folder / "gone.jpg", "file not found"),
        (lambda folder: folder, "is a directory, not an image file"),
        (lambda folder: _write(folder / "empty.jpg", b""), "file is empty"),
        (lambda folder: _write(folder / "text.jpg", b"not an image"), "not an image file"),
    ],
)
def test_an_unreadable_file_is_the_error_load_rgb_raises(tmp_path: Path, make, reason: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ImageError) as device:
        read_for_device(path)
    with pytest.raises(ImageError) as pillow:
        load_rgb(path)
    assert device.value.reason == pillow.value.reason and device.value.reason.startswith(reason)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_augmented_training_images_take_the_same_crop_and_jitter() -> None:
    """The random crop and colour jitter draw the same numbers from torch's generator whichever path runs them;
    Pillow's colour operations and the tensor ones differ by a few levels (measured: mean 0.4 to 1.0, max 9)."""
    data = jpeg_bytes(photo(320, 240, 11))
    transform = build_transform(SIZE, train=True, augment=True)
    torch.manual_seed(3)
    pillow = transform(load_rgb("a.jpg", data=data))
    (image,) = decode_jpegs([read_for_device("a.jpg", data=data)], CPU, DecodeTally())
    torch.manual_seed(3)
    device = transform(image)
    torch.manual_seed(4)
    other = transform(image)
    assert device.shape == pillow.shape == (3, SIZE, SIZE)
    assert _levels(device, pillow).mean() < 2 < _levels(other, pillow).mean()


def test_the_data_module_decodes_on_the_device_it_is_given(images: dict[str, str]) -> None:
    """Through a loader worker (the batch's bytes cross processes in one tensor) and the module's transfer hook."""
    names = ["photo.jpg", "alpha.png", "no_scan.jpg", "turned.jpg"]
    records = [Record(images[name], i, ("a photo",), "train") for i, name in enumerate(names)]
    batches = {}
    for decode in ("loader", "device"):
        settings = {"image_size": SIZE, "batch_size": 4, "num_workers": 1, "min_word_count": 1, "decode": decode}
        datamodule = CaptionDataModule(
            ListSource({"train": records, "val": [], "test": []}), from_dict(DataConfig, settings)
        )
        datamodule.setup("fit")
        assert datamodule.decodes_on_device() == (decode == "device")  # no trainer: the CPU, where auto is loader
        torch.manual_seed(0)  # the same shuffled order
        (batch,) = list(datamodule.train_dataloader())
        assert isinstance(batch, Undecoded) == (decode == "device")
        batches[decode] = datamodule.transfer_batch_to_device(batch, CPU, 0)
        report = datamodule.decoding_report()
    assert report == "images decoded on cpu: 2 JPEGs; by Pillow: 1 (1 PNG)" and datamodule.decoding_report() == ""
    pillow, device = batches["loader"], batches["device"]
    assert _levels(device["images"], pillow["images"]).max() <= 1 + 1e-3
    assert device["real"].tolist() == pillow["real"].tolist() and device["real"].sum() == 3
    assert torch.equal(device["image_ids"], pillow["image_ids"])
    assert device["skipped"] == pillow["skipped"] and [s.path for s in device["skipped"]] == [images["no_scan.jpg"]]


def test_auto_decodes_on_the_device_on_cuda_only() -> None:
    cuda = torch.device("cuda", 1)
    assert [on_device(ImageDecoding(d), CPU) for d in ("auto", "loader", "device")] == [False, False, True]
    assert [on_device(ImageDecoding(d), cuda) for d in ("auto", "loader", "device")] == [True, False, True]
    assert from_dict(DataConfig, {}).decode == ImageDecoding.auto


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    model, vocab, config = never_ending_captioner(["a", "red", "blue", "circle", "square"])
    return LoadedModel(model, vocab, config, 64)


def test_caption_files_decoding_on_the_device_captions_as_the_loader_does(
    loaded: LoadedModel, images: dict[str, str]
) -> None:
    paths = [images[name] for name in ("photo.jpg", "alpha.png", "no_scan.jpg", "grey.jpg", "gone.jpg")]
    greedy = DecodingConfig(method="greedy", max_len=3)
    by_loader = list(caption_files(loaded, paths, batch_size=3, workers=0, decoding=greedy))  # auto, on a CPU
    tally = DecodeTally()
    by_device = list(
        caption_files(loaded, paths, batch_size=3, workers=0, decoding=greedy, decode="device", tally=tally)
    )
    assert [type(r) for r in by_device] == [type(r) for r in by_loader]
    for one, other in zip(by_loader, by_device):
        if isinstance(one, Skipped):
            assert one == other
        else:
            assert (one.path, one.words) == (other.path, other.words)
            assert one.score == pytest.approx(other.score, abs=1e-2)
    assert (tally.on_device, tally.by_pillow) == (2, {"PNG": 1})
