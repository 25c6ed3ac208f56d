"""Data loading throughput next to what the training step consumes, so a starved loader shows.

Two sources, each through the dataset class training uses: JPEG files of COCO's typical size (640x480,
generated into a temporary folder) decoded and transformed by ``CaptionDataset``, and a fp16 feature
cache read by ``FeatureCaptionDataset``. Each is read in the main process (workers 0: the rate of one
worker) and by DataLoader worker processes; "step consumes" is the soft-attention training step's rate on
the same input (images or cached features). A loader/step ratio below 1 starves the step; "workers
needed" = step rate / rate of one worker, rounded up.

    python benchmarks/data_loading.py                    # CPU: --quick by default
    python benchmarks/data_loading.py --device cuda --precision bf16 --channels-last --workers 0 4 8 16
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import common
from captioner.data.dataset import CaptionDataset, build_transform, collate
from captioner.data.features import FeatureCache, FeatureCaptionDataset
from captioner.data.readers import Record
from captioner.data.vocab import Vocabulary

COLUMNS = [
    "size",
    "source",
    "workers",
    "loader images/s",
    "per worker",
    "step consumes images/s",
    "loader / step",
    "workers needed",
    "others %",
]
JPEG_SIZE = (640, 480)
WORDS = [f"word{i}" for i in range(50)]


def write_jpegs(folder: Path, count: int, seed: int = 0) -> list[Record]:
    """``count`` 640x480 JPEGs with photo-like content (smooth colour fields plus grain, quality 92,
    ~130 KiB each, COCO's average is ~160 KiB) and five 12-word captions each."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        coarse = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
        smooth = np.asarray(coarse.resize(JPEG_SIZE, Image.BICUBIC), dtype=np.float32)
        pixels = np.clip(smooth + rng.normal(0.0, 12.0, smooth.shape), 0, 255).astype(np.uint8)
        path = folder / f"{i:06d}.jpg"
        Image.fromarray(pixels).save(path, "JPEG", quality=92)
        captions = tuple(" ".join(rng.choice(WORDS, 12)) for _ in range(5))
        records.append(Record(str(path), i, captions, "train"))
    return records


def write_cache(folder: Path, dataset: CaptionDataset, locations: int, channels: int) -> FeatureCache:
    """A fp16 feature cache of random (L, C) grids for the images of ``dataset``, built as training builds
    one (``FeatureCache.build`` over a DataLoader), with random features in place of the encoder's."""

    def encode(images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        return torch.rand(images.size(0), locations, channels), (1, locations)

    cache = FeatureCache(folder)
    cache.build(encode, DataLoader(dataset, batch_size=32, collate_fn=collate), "cpu")
    return cache


def loader_rate(dataset: Dataset, workers: int, batch: int, pin_memory: bool) -> float:
    """Images per second through a DataLoader as training builds it, the first batch (worker start) untimed."""
    loader = DataLoader(
        dataset, batch_size=batch, shuffle=False, collate_fn=collate, num_workers=workers, pin_memory=pin_memory
    )
    iterator = iter(loader)
    next(iterator)
    images, start = 0, time.perf_counter()
    for item in iterator:
        images += item["indices"].numel()
    return images / (time.perf_counter() - start)


def step_rate(size: common.Size, source: str, args: argparse.Namespace) -> float:
    """Images per second of the soft-attention training step on ``source`` (images or features)."""
    _, step, _ = common.model_train_step(size, args, "soft", source)
    return size.batch / common.measure(step, args).median


def size_rows(size: common.Size, folder: Path, records: list[Record], args: argparse.Namespace) -> list[list[object]]:
    """Loader rows of both sources for ``size``, each next to the step's consumption."""
    vocab = Vocabulary(WORDS)
    height, width, channels = common.encoder_grid(size)
    locations = height * width
    images = CaptionDataset(records, vocab, build_transform(size.image_size, train=True), max_len=size.steps)
    cache = write_cache(folder / f"cache-{size.name}", images, locations, channels)
    sources = [
        (f"JPEG 640x480 -> {size.image_size} px", "images", images),
        (
            f"fp16 cache {locations}x{channels}",
            "features",
            FeatureCaptionDataset(records, vocab, cache, max_len=size.steps),
        ),
    ]
    rows = []
    for label, source, dataset in sources:
        consumes = step_rate(size, source, args)
        for workers in args.workers:
            with common.OtherLoad() as others:
                rate = loader_rate(dataset, workers, size.batch, pin_memory=args.device.type == "cuda")
            per_worker = rate / max(workers, 1)
            rows.append(
                [
                    size.name,
                    label,
                    workers or "0 (main process)",
                    rate,
                    per_worker,
                    consumes,
                    rate / consumes,
                    math.ceil(consumes / per_worker),
                    others.percent,
                ]
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the loader-against-step table."""
    parser = common.make_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts to try (default: 0 1 2)"
    )
    parser.add_argument("--images", type=int, default=None, help="JPEGs to generate (default: 4 of the largest batch)")
    args = common.parse(parser, argv)
    sizes = common.sizes(args)
    count = args.images or (4 * max(size.batch for size in sizes))
    with tempfile.TemporaryDirectory(prefix="captioner-bench-") as tmp:
        folder = Path(tmp)
        records = write_jpegs(folder, count)
        kib = sum(Path(record.image_path).stat().st_size for record in records) / count / 1024
        common.print_environment(
            "Data loading",
            args,
            [size.describe() for size in sizes]
            + [
                f"{count} generated JPEGs, {JPEG_SIZE[0]}x{JPEG_SIZE[1]}, mean {kib:.0f} KiB; the training "
                "transform (resize to the model's size, to tensor, normalise); 5 captions each",
                "the training step consumes at its measured rate (soft attention, random weights)",
                "'others %': share of the cores other processes kept busy while the loader row ran (/proc/stat)",
            ],
        )
        with common.timed_section():
            rows = [row for size in sizes for row in size_rows(size, folder, records, args)]
            common.print_table("Data loading against the training step", COLUMNS, rows)


if __name__ == "__main__":
    main()
