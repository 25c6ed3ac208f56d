"""Data loading throughput next to what the training step consumes, so a starved loader shows.

Three sources, for the ``coco_soft`` experiment and the demo: JPEG files of COCO's typical size (640x480,
generated into a temporary folder) through the experiment's data module (``CaptionDataModule``, built from
its ``data`` section, as training reads images), the same JPEGs in WebDataset tar shards streamed through the
same data module (``data=webdataset``: ``WebDatasetSource``, ``ShardStream``), and a fp16 feature cache of the
model's frozen part read by ``FeatureCaptionDataset``. Each is read in the main process (workers 0: the rate of one
worker) and by DataLoader worker processes; "step consumes" is the soft-attention training step's rate on
the same input (images or cached features). A loader/step ratio below 1 starves the step; "workers
needed" = step rate / rate of one worker, rounded up. The JPEG and shard rows are read twice (``--decode``): with
``data.decode=loader`` (Pillow decodes in the workers) and with ``data.decode=device`` (the workers read the files,
the data module's ``transfer_batch_to_device`` decodes each batch's JPEGs on ``--device``: nvjpeg on CUDA); each
batch goes through that transfer to ``--device`` in both, so a row's images/s is what the step receives there.

    python benchmarks/data_loading.py                    # CPU: --quick by default
    python benchmarks/data_loading.py --device cuda --precision bf16 --channels-last --workers 2 4 8 --images 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import clock
import composed
import machine
import options
import tables
from captioner.config import ImageDecoding
from captioner.data.dataset import collate
from captioner.data.features import FeatureCache, FeatureCaptionDataset
from captioner.data.readers import Record
from captioner.data.shards import WebDatasetSource
from captioner.training.datamodule import CaptionDataModule

COLUMNS = [
    "size",
    "source",
    "workers",
    "loader images/s",
    "per worker",
    "step consumes images/s",
    "step GFLOP/s",
    "step matmul %",
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


class GeneratedSource:
    """A dataset source (``captioner.data.sources.Source``) of the generated JPEGs, all in the training split."""

    def __init__(self, records: list[Record]) -> None:
        self.train = records

    def paths(self) -> list:
        """No configured files: they were just written."""
        return []

    def prepare(self) -> None:
        """Nothing to generate."""

    def records(self, split: str) -> list[Record]:
        """The generated records for ``train``, none for the other splits."""
        return self.train if split == "train" else []


def write_shards(folder: Path, records: list[Record], shards: int) -> str:
    """``records``' JPEGs and captions in ``shards`` tar shards in img2dataset's layout (``key.jpg``, ``key.json``
    with ``captions``, ``_stats.json``), written by ``webdataset.ShardWriter``; returns their brace pattern."""
    folder.mkdir()
    bounds = [shard * len(records) // shards for shard in range(shards + 1)]
    with wds.ShardWriter(str(folder / "%05d.tar"), maxcount=len(records), verbose=0) as writer:
        for shard in range(shards):
            if shard:
                writer.next_stream()
            for record in records[bounds[shard] : bounds[shard + 1]]:
                meta = {"captions": list(record.captions), "key": f"{record.image_id:09d}"}
                writer.write({"__key__": meta["key"], "jpg": Path(record.image_path).read_bytes(), "json": meta})
            stats = {"successes": bounds[shard + 1] - bounds[shard], "failures": 0}
            (folder / f"{shard:05d}_stats.json").write_text(json.dumps(stats))
    return f"{folder}/{{00000..{shards - 1:05d}}}.tar"


def datamodule(size: composed.Setup, source: object, workers: int, decode: str = "loader") -> CaptionDataModule:
    """The experiment's data module (its ``data`` section, as ``train.py`` builds it) over ``source``, with
    ``workers`` loader processes, images decoded where ``decode`` says, and no feature cache; a trainer of one CPU
    process attached (a stream reads its rank and epoch from it)."""
    settings = dataclasses.replace(size.data, num_workers=workers, feature_cache=None, decode=ImageDecoding(decode))
    module = CaptionDataModule(source, settings)
    module.setup("fit")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)  # no device banner a row
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    return module


def write_cache(folder: Path, dataset: Dataset, shape: torch.Size) -> FeatureCache:
    """A fp16 feature cache of random ``shape`` (L', C') maps for the images of ``dataset``, built as training
    builds one (``FeatureCache.build`` over a DataLoader), with random features in place of the encoder's."""

    def encode(images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        return torch.rand(images.size(0), *shape), (1, shape[0])

    cache = FeatureCache(folder)
    cache.build(
        encode, dataset, lambda images, size: DataLoader(images, batch_size=size, collate_fn=collate), 32, "cpu"
    )
    return cache


def loader_rate(
    loader: DataLoader, module: CaptionDataModule | None = None, device: torch.device | None = None
) -> float:
    """Images per second through ``loader`` and, for the loader of a data ``module``, its transfer to ``device``
    (where the device decodes JPEGs: their decoding), the first batch (worker start, nvjpeg's set-up) untimed."""

    def batches() -> Iterator[dict]:
        for batch in loader:
            yield batch if module is None else module.transfer_batch_to_device(batch, device, 0)

    iterator = batches()
    next(iterator)
    images, start = 0, time.perf_counter()
    for item in iterator:
        images += item["indices"].numel()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return images / (time.perf_counter() - start)


def step_rate(size: composed.Setup, source: str, args: argparse.Namespace) -> tuple[float, list[float], torch.Size]:
    """Images per second of the experiment's training step on ``source`` (images or features), its FLOP cells,
    and the shape of one image's cached features (L', C')."""
    model, step, _ = composed.model_train_step(size, args, source)
    flops = clock.count_flops(step)
    seconds = clock.measure(step, args).median
    shape = composed.random_features(model, size, 1, args.device).shape[1:]
    return size.batch / seconds, clock.flop_cells(flops, seconds, args), shape


def size_rows(
    size: composed.Setup, folder: Path, records: list[Record], pattern: str, args: argparse.Namespace
) -> list[list[object]]:
    """Loader rows of the three sources for ``size``, each next to the step's consumption (the shards of
    ``pattern`` hold ``records``' JPEGs)."""
    source = GeneratedSource(records)
    images = datamodule(size, source, 0)
    consumes, flops, shape = step_rate(size, "images", args)
    streamed = WebDatasetSource(train=pattern, eval_source=GeneratedSource([]), shuffle_buffer=size.batch)
    rows = []
    for read, name in ((source, "JPEG 640x480"), (streamed, "shards of the JPEGs")):
        for decode in args.decode:
            label = f"{name} -> {size.data.image_size} px" + (
                f", decoded on {args.device}" if decode == "device" else ""
            )
            for workers in args.workers:
                module = datamodule(size, read, workers, decode)
                with machine.OtherLoad() as others:
                    rate = loader_rate(module.train_dataloader(), module, args.device)
                rows.append(loader_row(size, label, workers, rate, consumes, flops, others))
    cache = write_cache(folder / f"cache-{size.name}", images.image_dataset("train"), shape)
    features = FeatureCaptionDataset(records, images.vocab, cache, max_len=size.data.max_len)
    consumes, flops, _ = step_rate(size, "features", args)
    for workers in args.workers:
        loader = DataLoader(
            features,
            batch_size=size.batch,
            shuffle=True,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=args.device.type == "cuda",
        )
        with machine.OtherLoad() as others:
            rate = loader_rate(loader)
        label = f"fp16 cache {shape[0]}x{shape[1]}"
        rows.append(loader_row(size, label, workers, rate, consumes, flops, others))
    return rows


def loader_row(
    size: composed.Setup,
    label: str,
    workers: int,
    rate: float,
    consumes: float,
    flops: list[float],
    others: machine.OtherLoad,
) -> list[object]:
    """One table row: the loader's rate against the step's."""
    per_worker = rate / max(workers, 1)
    return [
        size.name,
        label,
        workers or "0 (main process)",
        rate,
        per_worker,
        consumes,
        *flops[1:],
        rate / consumes,
        math.ceil(consumes / per_worker),
        others.percent,
    ]


def main(argv: list[str] | None = None) -> None:
    """Print the loader-against-step table."""
    parser = options.make_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts to try (default: 0 1 2)"
    )
    parser.add_argument("--images", type=int, default=None, help="JPEGs to generate (default: 4 of the largest batch)")
    parser.add_argument(
        "--decode",
        choices=("loader", "device"),
        nargs="+",
        default=["loader", "device"],
        help="data.decode settings the JPEG and shard rows read with (default: loader device)",
    )
    args = options.parse(parser, argv)
    sizes = composed.setups(args)
    count = args.images or (4 * max(size.batch for size in sizes))
    with tempfile.TemporaryDirectory(prefix="captioner-bench-") as tmp:
        folder = Path(tmp)
        records = write_jpegs(folder, count)
        shards = max(4, 2 * max(args.workers))
        pattern = write_shards(folder / "shards", records, shards)
        kib = sum(Path(record.image_path).stat().st_size for record in records) / count / 1024
        machine.print_environment(
            "Data loading",
            args,
            [size.describe() for size in sizes]
            + [
                f"{count} generated JPEGs, {JPEG_SIZE[0]}x{JPEG_SIZE[1]}, mean {kib:.0f} KiB; the training "
                "transform (resize to the model's size, to tensor, normalise); 5 captions each",
                f"the same JPEGs in {shards} WebDataset tar shards (key.jpg + key.json, _stats.json beside), "
                "streamed with a shuffle buffer of one batch",
                "the training step consumes at its measured rate (soft attention, random weights); the JPEG and shard "
                "rows read through the experiment's data module (CaptionDataModule.train_dataloader, the training "
                "transform, then its transfer_batch_to_device to the device), the cache rows through "
                "FeatureCaptionDataset",
                f"'decoded on {args.device}': data.decode=device, the workers read the files and the main process has "
                f"the {args.device} decode each batch's JPEGs in one call (nvjpeg on CUDA, libjpeg-turbo on a CPU) and "
                "resize them there; the other rows decode with Pillow in the workers (data.decode=loader)",
                "'others %': share of the cores other processes kept busy while the loader row ran (/proc/stat)",
            ],
        )
        with machine.timed_section():
            rows = [row for size in sizes for row in size_rows(size, folder, records, pattern, args)]
            tables.print_table("Data loading against the training step", COLUMNS, rows)


if __name__ == "__main__":
    main()
