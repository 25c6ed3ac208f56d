"""The ``captioner`` command: caption images, draw attention overlays, evaluate a model on a dataset.

    captioner caption IMAGE_OR_FOLDER_OR_GLOB... --model bundle.pt [--beam-size 3] [--json]
    captioner attend IMAGE... --model bundle.pt --out overlay.png | --out DIR
    captioner evaluate --model bundle.pt|last.ckpt --shapes data/shapes --split test --out DIR

A bad input file gets one line on stderr naming it and the reason; the other images are still captioned
and the exit status is 1. A bad argument or model file gets one line and exit status 2. No traceback.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from captioner.data.dataset import Skipped
from captioner.data.images import load_rgb
from captioner.errors import CaptionerError, ConfigError, check_range
from captioner.inference import caption_files

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
PROGRESS_MIN_IMAGES = 64


# ------------------------------------------------------------------------------------------- inputs
def expand_inputs(items: Sequence[str]) -> tuple[list[str], list[Skipped]]:
    """Files, folders (their images, recursively, sorted) and globs -> image paths, plus input errors."""
    paths: list[str] = []
    errors: list[Skipped] = []
    for item in items:
        path = Path(item)
        if path.is_dir() and path.suffix.lower() not in IMAGE_SUFFIXES:
            found = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                errors.append(Skipped(item, "folder holds no image files"))
            paths.extend(found)
        elif not path.exists() and glob.has_magic(item):
            found = sorted(glob.glob(item, recursive=True))
            if not found:
                errors.append(Skipped(item, "no file matches this pattern"))
            paths.extend(found)
        else:
            paths.append(item)
    return paths, errors


# ------------------------------------------------------------------------------------------ commands
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None


def _load(args: argparse.Namespace):
    from captioner.model.captioner import load_model

    device = _device(args.device)
    model, vocab, config = load_model(args.model, map_location="cpu")
    return model.to(device).eval(), vocab, config, device


def _decode_options(args: argparse.Namespace) -> dict:
    check_range("--beam-size", args.beam_size, 1, kind=int)
    check_range("--max-len", args.max_len, 1, kind=int)
    check_range("--batch-size", args.batch_size, 1, kind=int)
    check_range("--temperature", args.temperature, 1e-6)
    return dict(method=args.method, beam_size=args.beam_size, max_len=args.max_len, temperature=args.temperature,
                length_penalty=args.length_penalty)


def _report(skipped: Skipped) -> None:
    print(f"error: {skipped.path}: {skipped.reason}", file=sys.stderr)


def cmd_caption(args: argparse.Namespace) -> int:
    """Caption images; print ``path<TAB>caption`` or JSON lines."""
    decode = _decode_options(args)
    paths, failed = expand_inputs(args.images)
    for skipped in failed:
        _report(skipped)
    model, vocab, config, device = _load(args)
    progress = not args.no_progress and len(paths) >= PROGRESS_MIN_IMAGES
    for result in caption_files(model, vocab, config["image_size"], paths, device, args.batch_size,
                                args.workers, progress, **decode):
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
    """Caption images and draw one attention panel per word (and a gallery page for several images)."""
    from captioner.viz.gallery import GalleryEntry, write_gallery
    from captioner.viz.overlay import draw_overlay

    decode = _decode_options(args)
    paths, failed = expand_inputs(args.images)
    for skipped in failed:
        _report(skipped)
    out = Path(args.out)
    single = out.suffix.lower() == ".png"
    if single and len(paths) > 1:
        raise ConfigError(f"--out {out}: {len(paths)} images need a folder, not a .png file")
    if out.exists() and not args.force and (out.is_file() or (out / "index.html").exists()):
        raise ConfigError(f"--out {out} already exists; pass --force to overwrite it")
    model, vocab, config, device = _load(args)
    hard = config["decoder"].get("mode") == "hard"
    entries = []
    for result in caption_files(model, vocab, config["image_size"], paths, device, args.batch_size,
                                args.workers, False, **decode):
        if isinstance(result, Skipped):
            _report(result)
            failed.append(result)
            continue
        target = out if single else out / f"{len(entries):04d}_{Path(result.path).stem}.png"
        locations = result.alphas.argmax(dim=1).tolist() if hard else None
        draw_overlay(load_rgb(result.path), result.words, result.alphas, result.grid, target,
                     locations=locations, title=" ".join(result.words))
        entries.append(GalleryEntry(image=str(Path(result.path).resolve()), caption=" ".join(result.words),
                                    overlay=str(target.resolve())))
        print(f"{result.path}\t{' '.join(result.words)}\t{target}", flush=True)
    if not single and entries:
        page = write_gallery(out, entries)
        print(f"gallery: {page}", file=sys.stderr)
    return 1 if failed else 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Decode a dataset split and report BLEU (nltk) and the coco-caption suite; write results + metrics."""
    from captioner.evaluation.report import evaluate_split

    decode = _decode_options(args)
    records = _records(args)
    model, vocab, config, device = _load(args)
    metrics = evaluate_split(model, vocab, config["image_size"], records, device, args.batch_size,
                             args.workers, Path(args.out), coco=not args.no_coco, **decode)
    print(metrics["table"])
    return 0


def _records(args: argparse.Namespace):
    from captioner.data import sources

    chosen = [name for name in ("shapes", "karpathy", "coco_captions") if getattr(args, name)]
    if len(chosen) != 1:
        raise ConfigError("give exactly one dataset: --shapes ROOT, --karpathy FILE --images ROOT, "
                          "or --coco-captions FILE --images DIR")
    if args.shapes:
        source = sources.ShapesSource(args.shapes)
        if not (Path(args.shapes) / "meta.json").is_file():
            raise ConfigError(f"--shapes {args.shapes}: no generated dataset there (train once to create it)")
        return source.records(args.split)
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
        sub.add_argument("--batch-size", type=int, default=32)
        sub.add_argument("--workers", type=int, default=2, help="image-decoding processes")
        sub.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")

    caption = commands.add_parser("caption", help="caption image files, folders and globs")
    caption.add_argument("images", nargs="+")
    common(caption)
    caption.add_argument("--json", action="store_true", help="JSON lines: path, caption, score, tokens")
    caption.add_argument("--no-progress", action="store_true")
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
    evaluate.set_defaults(func=cmd_evaluate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; user errors print one line on stderr (exit 2), never a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CaptionerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
