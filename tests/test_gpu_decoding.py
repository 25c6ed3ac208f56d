"""JPEGs decoded on a CUDA device by nvjpeg (``data.decode=device``, auto on CUDA) against the CPU's libjpeg-turbo,
which decodes as Pillow does (tests/test_device_decoding.py): skipped without CUDA; ``python
benchmarks/gpu_check.py`` runs it on a lent GPU. The differences measured are printed (``pytest -rA`` shows them)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_device_decoding import LEVEL, _dataset, images, jpeg_bytes, photo, turned  # noqa: F401 (a fixture)
from torch.utils.data import DataLoader

from captioner.data.dataset import build_transform, collate, defer
from captioner.data.device_decoding import DecodeTally, Encoded, decode_jpegs, read_for_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
CPU = torch.device("cpu")
SIZE = 224  # the model's input side the differences are measured at


def _jpegs() -> dict[str, bytes]:
    """COCO-like JPEGs of the layouts a data set holds: 4:2:0 at COCO's size, 4:4:4, 4:2:2, grey, odd sizes, one
    turned by its EXIF orientation."""
    return {
        "640x480 4:2:0 q92": jpeg_bytes(photo(640, 480, 0), quality=92),
        "640x480 4:4:4": jpeg_bytes(photo(640, 480, 1), subsampling=0),
        "500x375 4:2:2": jpeg_bytes(photo(500, 375, 2), subsampling=1),
        "427x640 grey": jpeg_bytes(photo(427, 640, 3).convert("L")),
        "37x23 4:2:0": jpeg_bytes(photo(37, 23, 4)),
        "480x640 EXIF 6": turned(photo(640, 480, 5), 6),
    }


@needs_cuda
def test_nvjpeg_decodes_as_the_cpu_does_within_tolerance() -> None:
    encoded = {name: read_for_device(name, data=data) for name, data in _jpegs().items()}
    assert all(isinstance(item, Encoded) for item in encoded.values())
    on_cuda, on_cpu = DecodeTally(), DecodeTally()
    cuda = decode_jpegs(list(encoded.values()), CUDA, on_cuda)
    cpu = decode_jpegs(list(encoded.values()), CPU, on_cpu)
    assert on_cuda.on_device == len(encoded) and not on_cuda.by_pillow  # nvjpeg read them all
    transform = build_transform(SIZE, train=False)
    for name, one, other in zip(encoded, cuda, cpu):
        assert one.device.type == "cuda" and one.shape == other.shape and one.dtype == torch.uint8
        raw = (one.cpu().float() - other.float()).abs()
        levels = (transform(one).cpu() - transform(other)).abs() / LEVEL  # as the model reads it, in grey levels
        print(
            f"{name}: decoded max {raw.max():.0f} mean {raw.mean():.3f} levels; at {SIZE} px max {levels.max():.2f} "
            f"mean {levels.mean():.3f}"
        )
        assert raw.mean() < 2  # torchvision's own bound for nvjpeg against libjpeg-turbo (its test_decode_jpegs_cuda)
        assert levels.mean() < 1 and levels.max() <= 32  # a colour conversion or a turn gone wrong is far over


@needs_cuda
def test_a_mixed_batch_decodes_on_cuda_as_on_the_cpu(images: dict[str, str]) -> None:  # noqa: F811
    """PNG, progressive and CMYK files by Pillow, and a JPEG no decoder reads (nvjpeg refuses the whole call, then
    each alone) skipped, as on the CPU; the CUDA context stays usable."""
    dataset = _dataset(list(images.values()), encoded=True)
    batches = functools.partial(collate, captions_per_image=2)
    tallies = {CPU: DecodeTally(), CUDA: DecodeTally()}
    cpu = defer(list(dataset), batches, dataset.transform).decoded(CPU, tallies[CPU])
    deferred = functools.partial(defer, collate=batches, transform=dataset.transform)
    loader = DataLoader(dataset, batch_size=len(dataset), num_workers=1, pin_memory=True, collate_fn=deferred)
    (undecoded,) = list(loader)
    assert undecoded.pixels.is_pinned()  # Pillow's images cross in one asynchronous copy
    cuda = undecoded.decoded(CUDA, tallies[CUDA])
    assert cuda["images"].device.type == "cuda" and cuda["images"].shape == cpu["images"].shape
    assert ((cuda["images"].cpu() - cpu["images"]).abs() / LEVEL).mean() < 1
    assert cuda["skipped"] == cpu["skipped"] and torch.equal(cuda["real"], cpu["real"])
    assert tallies[CUDA] == tallies[CPU]
    assert torch.ones(4, device=CUDA).sum().item() == 4
