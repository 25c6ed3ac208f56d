"""Peak memory of building the feature cache: flat in the number of images, since each chunk is written into
the preallocated ``features.npy`` as it is encoded (the former build held every chunk, then a concatenated
copy: twice the cache, ~180 GB for COCO's Karpathy train).

Each row builds one cache as training does (``CaptionerModule.fill_cache``: ``FeatureCache.fill`` with the
model's frozen stages in eval mode, then ``FeatureCache.finish``) in this process, over random images made in
memory (a Dataset of seeded tensors at the experiment's image size: no files, so the loader holds nothing
that grows), with random encoder weights, into a temporary folder. The peak is the process's resident set
(VmHWM, reset before each row; ``peak.PeakMemory``); "added" is its rise over the row's start.

    python benchmarks/feature_cache.py                                  # demo 2,000 and 20,000; COCO 500, 2,000
    python benchmarks/feature_cache.py --demo-images 2000 20000 --coco-images 64 256 --coco-batch 8   # as measured
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import composed
import machine
import options
import peak
import tables
from captioner.data.dataset import collate
from captioner.data.features import FeatureCache, Share

COLUMNS = [
    "experiment",
    "images",
    "cached per image",
    "chunk (images)",
    "cache MiB",
    "former build held MiB (2 x cache)",
    "peak RSS MiB",
    "added MiB",
    "images/s",
    "others %",
]

TINY_DEMO = [3, 7]  # --tiny (smoke tests): the tiny demo's caches of a few images


class RandomImages(Dataset):
    """``count`` items as ``CaptionDataset`` yields them: a (3, S, S) image of seeded noise (made when asked
    for, so nothing is held), one caption, image id and index ``i``."""

    def __init__(self, count: int, image_size: int) -> None:
        self.count = count
        self.image_size = image_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        generator = torch.Generator().manual_seed(i)
        image = torch.randn(3, self.image_size, self.image_size, generator=generator)  # (3, S, S)
        return {"image": image, "captions": [torch.tensor([1, 4, 2])], "image_id": i, "index": i}


def batches(images: Dataset, batch_size: int) -> DataLoader:
    """The images in order, in the main process (so that the peak counts everything the build holds)."""
    return DataLoader(images, batch_size=batch_size, collate_fn=collate)


def build_row(size: composed.Setup, count: int, batch: int, folder: Path, args: argparse.Namespace) -> list[object]:
    """Build the cache of ``count`` random images of ``size`` in ``folder``, ``batch`` at a time: its table row."""
    module = composed.build_module(size, args)
    module.cached_stages()  # the check training runs first: the experiment has frozen stages to cache
    images = RandomImages(count, size.data.image_size)
    cache = FeatureCache(folder / f"{size.name}-{count}")
    dtype = size.data.feature_dtype.value
    with machine.OtherLoad() as others, peak.PeakMemory(torch.device("cpu")) as memory:
        start = time.perf_counter()
        module.fill_cache(cache, images, batches, batch, dtype, Share())
        cache.finish()
        seconds = time.perf_counter() - start
    features = cache.folder / "features.npy"
    shape = cache.get(0).shape
    mib = features.stat().st_size / peak.MiB
    print(f"- {size.name}, {count} images: {seconds:.0f} s, peak RSS {memory.peak_mib:.0f} MiB", flush=True)
    row = [size.name, count, f"{shape[0]} x {shape[1]}", batch, mib, 2 * mib, memory.peak_mib, memory.added_mib]
    return [*row, count / seconds, others.percent]


def main(argv: list[str] | None = None) -> None:
    """Print the peak memory of each build."""
    parser = options.make_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--demo-images",
        type=int,
        nargs="*",
        default=None,
        help="demo caches' sizes, none to leave it out (default: 2000 20000)",
    )
    parser.add_argument(
        "--coco-images",
        type=int,
        nargs="*",
        default=None,
        help="coco_soft caches' sizes, none to leave it out (default: 500 2000)",
    )
    parser.add_argument(
        "--coco-batch", type=int, default=None, help="coco_soft images per chunk (default: data.eval_batch_size)"
    )
    args = options.parse(parser, argv)
    sizes = composed.setups(args)  # the COCO recipe and the demo, or only the tiny demo
    demo = args.demo_images
    counts = {
        "coco_soft": [500, 2000] if args.coco_images is None else args.coco_images,
        "demo": [2000, 20000] if demo is None else demo,
        "tiny": TINY_DEMO if demo is None else demo,
    }
    plan = []
    for size in reversed(sizes):  # the demo first
        batch = args.coco_batch if size.name == "coco_soft" and args.coco_batch else size.data.eval_batch_size
        plan += [(size, count, batch) for count in counts[size.name]]
    machine.print_environment(
        "Feature cache build",
        args,
        [
            *(size.describe() for size in sizes),
            "random images made in memory at the experiment's size, random encoder weights; the cache is "
            "built by CaptionerModule.fill_cache (FeatureCache.fill) then FeatureCache.finish, in this process, "
            f"stored as {sizes[-1].data.feature_dtype.value}",
            peak.memory_method(torch.device("cpu")),
            "'former build held': what the build before features were written as computed kept in memory at its "
            "peak (every chunk, then their concatenation), on top of the same model",
        ],
    )
    with machine.timed_section(), tempfile.TemporaryDirectory(prefix="captioner-cache-bench-") as tmp:
        rows = [build_row(*planned, Path(tmp), args) for planned in plan]
        tables.print_table("Peak memory of a feature cache build", COLUMNS, rows)


if __name__ == "__main__":
    main()
