"""The attention gallery against captioning: where ``captioner attend``'s time goes, per stage and per image,
and the whole command's images/s next to ``captioner caption``'s on the same folder, in the same process.

The folder is generated: the built-in shapes (the demo's 96 px scenes); the model is the demo's with random
weights, made never to emit <end>, so every caption is ``--max-len`` words (the worst case: a panel per word).

    python benchmarks/gallery.py                 # 100 images, 20 words
    python benchmarks/gallery.py --images 400 --max-len 12

A third table splits one image's drawing into its pieces, each timed alone (the median of ``--pieces``
runs): shading, composing the sheet, encoding the sheet and the panels as JPEG in memory, and writing them as
a gallery does (each file recorded, then written atomically; on ext4 creating a file costs ~0.5 ms of CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import tempfile
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import torch
from PIL import Image

import clock
import composed
import machine
import options
import tables
from captioner import cli
from captioner.bundle import save_bundle
from captioner.config import DecodingConfig, ShapesSpec
from captioner.data.images import load_rgb
from captioner.data.shapes import generate_shapes
from captioner.inference import Captioned, caption_files, load_model
from captioner.viz.gallery import GalleryEntry, Panels, write_gallery
from captioner.viz.layout import GalleryFiles
from captioner.viz.overlay import shade
from captioner.viz.sheet import save_picture, sheet_picture, strip_picture, write_jpeg, write_sheet

STAGES = ["images", "words", "stage", "ms/image", "share %"]
PIECES = ["words", "piece", "ms/image"]
COMMANDS = ["command", "images", "words", "seconds", "images/s", "vs caption"]


def make_folder(root: Path, images: int, args: argparse.Namespace) -> tuple[Path, Path]:
    """The generated images and the demo's model (random weights, never ending) as a bundle: their paths."""
    spec = ShapesSpec(n_train=images, n_val=1, n_test=1)
    generate_shapes(root / "shapes", spec)
    size = composed.setup("demo", args)
    model = composed.never_end(composed.build_module(size, args).model.eval())
    bundle = root / "bundle.pt"
    save_bundle(bundle, model, size.vocab, size.model.net(), preprocess={"image_size": spec.image_size})
    return root / "shapes" / "images" / "train", bundle


def stage_rows(folder: Path, bundle: Path, args: argparse.Namespace, out: Path) -> list[list[object]]:
    """Each stage of a gallery timed on its own, over every image: captioning, decoding the image again,
    shading the panels, writing the sheet, writing the strip of the panels, writing the pages (copies included)."""
    paths = sorted(str(path) for path in folder.iterdir())
    loaded = load_model(bundle)
    decoding = dataclasses.replace(DecodingConfig.captioning(), max_len=args.max_len)
    seconds = dict.fromkeys(["caption", "decode", "shade", "sheet", "strip", "pages and copies"], 0.0)
    start = time.perf_counter()
    results = [
        item for item in caption_files(loaded, paths, workers=0, decoding=decoding) if isinstance(item, Captioned)
    ]
    seconds["caption"] = time.perf_counter() - start
    files, entries = GalleryFiles(out), []
    for number, result in enumerate(results):
        clock = time.perf_counter()
        picture = load_rgb(result.path)
        seconds["decode"] += time.perf_counter() - clock
        clock = time.perf_counter()
        shading = shade(picture, result.words, result.alphas, result.grid, result.locations)
        seconds["shade"] += time.perf_counter() - clock
        clock = time.perf_counter()
        sheet = write_sheet(shading, result.words, files.record(files.sheet(number, result.path)), result.caption)
        seconds["sheet"] += time.perf_counter() - clock
        clock = time.perf_counter()
        strip = save_picture(strip_picture(shading), files.record(files.strip(number, result.path)))
        seconds["strip"] += time.perf_counter() - clock
        panels = Panels(strip, tuple(result.words), shading.picture.size)
        entries.append(GalleryEntry(result.path, result.caption, sheet, panels=panels))
    clock = time.perf_counter()
    write_gallery(out, entries, files=files)
    seconds["pages and copies"] = time.perf_counter() - clock
    total = sum(seconds.values())
    words = sum(len(result.words) for result in results) / max(1, len(results))
    rows = [
        [len(results), words, name, 1e3 * value / len(results), 100 * value / total] for name, value in seconds.items()
    ]
    return [*rows, [len(results), words, "total", 1e3 * total / len(results), 100.0]]


def encoded(picture: Image.Image) -> int:
    """The bytes of ``picture`` (a PIL image) as the gallery's JPEG, encoded in memory."""
    buffer = io.BytesIO()
    write_jpeg(picture, buffer)
    return buffer.tell()


def piece_rows(folder: Path, args: argparse.Namespace, out: Path) -> list[list[object]]:
    """One image of ``folder`` drawn piece by piece with ``args.max_len`` random attention maps (one per word)."""
    picture = load_rgb(sorted(folder.iterdir())[0])
    alphas = torch.rand(args.max_len, 36, generator=torch.Generator().manual_seed(0)).softmax(-1)
    words = [f"word{step}" for step in range(args.max_len)]
    title = " ".join(words)
    shading = shade(picture, words, alphas, (6, 6))
    sheet = sheet_picture(shading, words, title)
    files = GalleryFiles(out)

    numbers = itertools.count(1)

    def write() -> None:
        number = next(numbers)  # a new entry each run, as a gallery writes them
        sheet_path, strip_path = files.record_all([files.sheet(number, "scene.png"), files.strip(number, "scene.png")])
        save_picture(sheet, sheet_path)
        save_picture(strip_picture(shading), strip_path)

    pieces: dict[str, Callable[[], object]] = {
        "shade": lambda: shade(picture, words, alphas, (6, 6)),
        "sheet picture": lambda: sheet_picture(shading, words, title),
        "sheet JPEG (memory)": lambda: encoded(sheet),
        "strip picture": lambda: strip_picture(shading),
        "strip JPEG (memory)": lambda: encoded(strip_picture(shading)),
        "files: sheet + strip": write,
    }
    return [
        [args.max_len, name, 1e3 * clock.measure(work, args, warmup=1, repeats=args.pieces).median]
        for name, work in pieces.items()
    ]


def command_rows(folder: Path, bundle: Path, args: argparse.Namespace, out: Path) -> list[list[object]]:
    """``captioner caption`` and ``captioner attend`` on the whole folder (model loading included), timed."""
    images = len(list(folder.iterdir()))
    common = ["--model", str(bundle), "--max-len", str(args.max_len), "--workers", "0", "--no-progress"]
    rows, rates = [], {}
    for name, extra in (("caption", []), ("attend", ["--out", str(out)])):
        start = time.perf_counter()
        with redirect_stdout(StringIO()), redirect_stderr(StringIO()):
            assert cli.main([name, str(folder), *common, *extra]) == 0
        seconds = time.perf_counter() - start
        rates[name] = images / seconds
        rows.append([f"captioner {name}", images, args.max_len, seconds, rates[name], rates[name] / rates["caption"]])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = options.make_parser(__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100, help="images in the generated folder (default: 100)")
    parser.add_argument("--max-len", type=int, default=20, help="words per caption (default: 20)")
    parser.add_argument("--pieces", type=int, default=30, help="timed runs of each piece, the median (default: 30)")
    args = options.parse(parser, argv)
    if args.tiny:
        args.images, args.max_len, args.pieces = 4, 3, 1
    machine.print_environment(
        "Attention gallery against captioning",
        args,
        [f"{args.images} generated shapes images (96 px), the demo's model with random weights, {args.max_len} words"],
    )
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        folder, bundle = make_folder(root, args.images, args)
        with machine.timed_section():
            tables.print_table("Gallery stages, per image", STAGES, stage_rows(folder, bundle, args, root / "staged"))
        with machine.timed_section():
            tables.print_table("Drawing one image, per piece", PIECES, piece_rows(folder, args, root / "pieces"))
        with machine.timed_section():
            tables.print_table("Whole commands", COMMANDS, command_rows(folder, bundle, args, root / "gallery"))


if __name__ == "__main__":
    main()
