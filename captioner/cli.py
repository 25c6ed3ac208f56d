"""The ``captioner`` command: caption images, draw attention overlays, evaluate a model on a dataset.

    captioner caption IMAGE_OR_FOLDER_OR_GLOB... --model bundle.pt [--beam-size 3] [--json]
    captioner attend IMAGE... --model bundle.pt --out overlay.png | --out DIR
    captioner evaluate --model bundle.pt|last.ckpt --shapes data/shapes --split test --out DIR

``--model`` takes the ``bundle.pt`` that training exports or one of its Lightning checkpoints. Images are
decoded in worker processes and captioned a batch at a time; a progress bar shows on stderr for many.
A bad input file gets one line on stderr naming it and the reason; the other images are still captioned
and the exit status is 1. A bad argument, model file or dataset gets one line and exit status 2. No
traceback.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path
from typing import Sequence

import torch

from captioner.data.dataset import Skipped
from captioner.data.images import load_rgb
from captioner.data.readers import Record
from captioner.errors import CaptionerError, ConfigError, check_range
from captioner.inference import caption_files
from captioner.model.captioner import LoadedModel, load_model

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
PROGRESS_MIN_IMAGES = 64


# ------------------------------------------------------------------------------------------- inputs
def _expand(item: str, paths: list[str], errors: list[Skipped]) -> None:
    """Add the image paths of one argument (file, folder or glob) to ``paths``, or its error to ``errors``."""
    path = Path(item)
    if path.is_dir() and path.suffix.lower() not in IMAGE_SUFFIXES:
        found = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            errors.append(Skipped(item, "folder holds no image files"))
        paths.extend(found)
    elif not path.exists() and glob.has_magic(item):
        matches = sorted(glob.glob(item, recursive=True))
        if not matches:
            errors.append(Skipped(item, "no file matches this pattern"))
        for match in matches:
            _expand(match, paths, errors)
    else:
        paths.append(item)  # a file, a missing file or a folder named like an image: load_rgb says which


def expand_inputs(items: Sequence[str]) -> tuple[list[str], list[Skipped]]:
    """Files, folders (their image files, recursively, sorted) and globs -> image paths, plus input errors.

    A folder contributes the files whose suffix is in ``IMAGE_SUFFIXES``; a file given by name is always
    kept, so that an unreadable one gets its own error.
    """
    paths: list[str] = []
    errors: list[Skipped] = []
    for item in items:
        _expand(item, paths, errors)
    return paths, errors


def _report(skipped: Skipped) -> None:
    """One line on stderr naming an input that could not be used and why."""
    print(f"error: {skipped.path}: {skipped.reason}", file=sys.stderr)


def _inputs(args: argparse.Namespace) -> tuple[list[str], list[Skipped]]:
    """The image paths of the command line; input errors are reported at once and returned."""
    paths, failed = expand_inputs(args.images)
    for skipped in failed:
        _report(skipped)
    return paths, failed


# ------------------------------------------------------------------------------------------ options
def _device(name: str) -> torch.device:
    """``--device``: auto, cpu, cuda or cuda:N; ConfigError for one this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ConfigError(f"--device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def _decode_options(args: argparse.Namespace) -> dict:
    """Check the decoding and batching options; return the ``Captioner.generate`` keywords."""
    check_range("--beam-size", args.beam_size, 1, kind=int)
    check_range("--max-len", args.max_len, 1, kind=int)
    check_range("--batch-size", args.batch_size, 1, kind=int)
    check_range("--workers", args.workers, 0, kind=int)
    check_range("--temperature", args.temperature, 1e-6)
    check_range("--length-penalty", args.length_penalty, 0.0)
    check_range("--min-len", args.min_len, 0, args.max_len - 1, kind=int)
    check_range("--no-repeat-ngram-size", args.no_repeat_ngram_size, 0, kind=int)
    return dict(method=args.method, beam_size=args.beam_size, max_len=args.max_len, temperature=args.temperature,
                length_penalty=args.length_penalty, min_len=args.min_len,
                no_repeat_ngram_size=args.no_repeat_ngram_size)


def _load(args: argparse.Namespace, device: torch.device) -> LoadedModel:
    """The ``--model`` file (bundle or training checkpoint), in eval mode on ``device``."""
    loaded = load_model(args.model, map_location="cpu")
    loaded.model.to(device)
    return loaded


def _progress(args: argparse.Namespace, images: int) -> bool:
    """Show a progress bar for many images unless ``--no-progress``."""
    return not args.no_progress and images >= PROGRESS_MIN_IMAGES


def _refuse_overwrite(target: Path, args: argparse.Namespace) -> None:
    """ConfigError when ``target`` exists and ``--force`` was not given."""
    if target.exists() and not args.force:
        raise ConfigError(f"--out {args.out}: {target} already exists; pass --force to overwrite it")


# ------------------------------------------------------------------------------------------ commands
def cmd_caption(args: argparse.Namespace) -> int:
    """Caption images; print ``path<TAB>caption`` or JSON lines (path, caption, score, tokens)."""
    decode = _decode_options(args)
    loaded = _load(args, _device(args.device))
    paths, failed = _inputs(args)
    for result in caption_files(loaded, paths, args.batch_size, args.workers, _progress(args, len(paths)),
                                **decode):
        if isinstance(result, Skipped):
            _report(result)
            failed.append(result)
        elif args.json:
            print(json.dumps({"path": result.path, "caption": " ".join(result.words),
                              "score": round(result.score, 4), "tokens": result.words}), flush=True)
        else:
            print(f"{result.path}\t{' '.join(result.words)}", flush=True)
    return 1 if failed else 0


def cmd_attend(args: argparse.Namespace) -> int:
    """Caption images and draw one attention panel per word; for a folder ``--out``, also a gallery page."""
    from captioner.viz.gallery import GalleryEntry, write_gallery
    from captioner.viz.overlay import draw_overlay

    decode = _decode_options(args)
    device = _device(args.device)
    out = Path(args.out)
    single = out.suffix.lower() == ".png"
    if out.suffix.lower() in IMAGE_SUFFIXES and not single:
        raise ConfigError(f"--out {out}: overlays are PNG files; give NAME.png or a folder")
    if single and out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a .png file name, or a folder without .png")
    if single or (out.is_dir() and any(out.iterdir())):
        _refuse_overwrite(out, args)
    loaded = _load(args, device)
    decoder = loaded.model.decoder
    mark_locations = decoder.mode == "hard" and decoder.hard_inference == "argmax"
    paths, failed = _inputs(args)
    if single and len(paths) > 1:
        raise ConfigError(f"--out {out}: {len(paths)} images need a folder, not a .png file")
    entries = []
    for result in caption_files(loaded, paths, args.batch_size, args.workers, _progress(args, len(paths)),
                                **decode):
        if isinstance(result, Skipped):
            _report(result)
            failed.append(result)
            continue
        caption = " ".join(result.words)
        target = out if single else out / f"{len(entries):04d}_{Path(result.path).stem}.png"
        # hard attention at inference attends to the most likely cell: mark it in each panel
        locations = result.alphas.argmax(dim=1).tolist() if mark_locations else None  # (T,)
        draw_overlay(load_rgb(result.path), result.words, result.alphas, result.grid, target,
                     locations=locations, title=caption)
        entries.append(GalleryEntry(image=result.path, caption=caption, overlay=target))
        print(f"{result.path}\t{caption}\t{target}", flush=True)
    if not single and entries:
        print(f"gallery: {write_gallery(out, entries)}", file=sys.stderr)
    return 1 if failed else 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Decode a dataset split; report BLEU (nltk) and the coco-caption suite; write results and metrics."""
    from captioner.evaluation.report import evaluate_split

    decode = _decode_options(args)
    device = _device(args.device)
    out = Path(args.out)
    for name in ("results.json", "metrics.json"):
        _refuse_overwrite(out / name, args)
    records = _records(args)
    loaded = _load(args, device)
    metrics, skipped = evaluate_split(loaded, records, out, args.batch_size, args.workers, coco=not args.no_coco,
                                      progress=_progress(args, len(records)), **decode)
    for item in skipped:
        _report(item)
    print(metrics["table"])
    return 1 if skipped else 0


def _records(args: argparse.Namespace) -> list[Record]:
    """The records of ``--split`` from the one dataset the arguments name."""
    from captioner.data import sources

    chosen = [name for name in ("shapes", "karpathy", "coco_captions") if getattr(args, name)]
    if len(chosen) != 1:
        raise ConfigError("give exactly one dataset: --shapes ROOT, --karpathy FILE --images ROOT, "
                          "or --coco-captions FILE --images DIR")
    if args.instances and not args.coco_captions:
        raise ConfigError("--instances goes with --coco-captions")
    if args.shapes:
        if args.images:
            raise ConfigError("--images goes with --karpathy or --coco-captions; --shapes has its own")
        return sources.ShapesSource(args.shapes).records(args.split)
    if not args.images:
        raise ConfigError("--images is required with --karpathy and --coco-captions")
    if args.karpathy:
        source = sources.KarpathySource(args.karpathy, args.images)
    else:
        entry = {"captions": args.coco_captions, "images": args.images, "instances": args.instances}
        source = sources.CocoSource({args.split: entry})
    source.prepare()
    return source.records(args.split)


# ------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(prog="captioner", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--model", required=True, help="inference bundle (bundle.pt) or training checkpoint")
        sub.add_argument("--method", choices=("beam", "greedy", "sample"), default="beam")
        sub.add_argument("--beam-size", type=int, default=3)
        sub.add_argument("--max-len", type=int, default=20, help="maximum words per caption")
        sub.add_argument("--temperature", type=float, default=1.0, help="for --method sample")
        sub.add_argument("--length-penalty", type=float, default=0.0, help="GNMT alpha for beam search")
        sub.add_argument("--min-len", type=int, default=0, help="no <end> before this many words (0: off)")
        sub.add_argument("--no-repeat-ngram-size", type=int, default=0,
                         help="no n-gram of this many words twice in a caption (0: off)")
        sub.add_argument("--batch-size", type=int, default=32, help="images encoded and decoded together")
        sub.add_argument("--workers", type=int, default=2, help="image-decoding processes (0: in this one)")
        sub.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        sub.add_argument("--no-progress", action="store_true",
                         help=f"no progress bar on stderr (shown from {PROGRESS_MIN_IMAGES} images)")

    caption = commands.add_parser("caption", help="caption image files, folders and globs")
    caption.add_argument("images", nargs="+")
    common(caption)
    caption.add_argument("--json", action="store_true", help="JSON lines: path, caption, score, tokens")
    caption.set_defaults(func=cmd_caption)

    attend = commands.add_parser("attend", help="draw the attention map of every generated word")
    attend.add_argument("images", nargs="+")
    common(attend)
    attend.add_argument("--out", required=True, help="FILE.png for one image, or a folder (with index.html)")
    attend.add_argument("--force", action="store_true", help="overwrite an existing --out")
    attend.set_defaults(func=cmd_attend)

    evaluate = commands.add_parser("evaluate", help="BLEU and coco-caption metrics on a dataset split")
    common(evaluate)
    evaluate.add_argument("--split", choices=("train", "val", "test"), default="test")
    evaluate.add_argument("--shapes", help="root of the built-in dataset")
    evaluate.add_argument("--karpathy", help="Karpathy split file (dataset_coco.json, dataset_flickr8k.json, ...)")
    evaluate.add_argument("--coco-captions", help="COCO captions file (captions_val2014.json, ...)")
    evaluate.add_argument("--instances", help="COCO instances file (boxes for attention correctness)")
    evaluate.add_argument("--images", help="image root or folder")
    evaluate.add_argument("--out", required=True, help="folder for results.json and metrics.json")
    evaluate.add_argument("--no-coco", action="store_true", help="skip the Java coco-caption suite")
    evaluate.add_argument("--force", action="store_true", help="overwrite results.json and metrics.json")
    evaluate.set_defaults(func=cmd_evaluate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command and return its exit status: 0 done, 1 some input image failed, 2 a bad argument,
    model file or dataset (one line on stderr, never a traceback), 130 interrupted."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code
    try:
        return args.func(args)
    except CaptionerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout went away (`captioner caption ... | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # e.g. an --out folder that cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
