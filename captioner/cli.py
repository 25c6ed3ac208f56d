"""The captioner command: caption images, draw attention overlays, evaluate a model on a dataset.

    captioner caption IMAGE_OR_FOLDER_OR_GLOB... --model bundle.pt [--beam-size 3] [--json]
    find photos -name '*.jpg' | captioner caption - --model bundle.pt
    captioner caption --image-info image_info_test2014.json --images test2014/ --out DIR --model bundle.pt
    captioner attend IMAGE... --model bundle.pt --out overlay.png | --out DIR
    captioner evaluate --model bundle.pt|last.ckpt --shapes data/shapes --split test --out DIR

--model takes a training run's folder, the bundle.pt that training exports there, or one of its Lightning
checkpoints. Images are decoded in worker processes and captioned a batch at a time; a progress bar
shows on stderr for many. A bad input file gets one line on stderr naming it and the reason; the other
images are still captioned and the exit status is 1. A bad argument, model file or dataset gets one line
and exit status 2. No traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from captioner import __version__
from captioner.config import DecodeMethod, DecodingConfig, to_dict
from captioner.data.dataset import Skipped
from captioner.data.images import load_rgb
from captioner.data.readers import Record
from captioner.errors import CaptionerError, ConfigError, check_range
from captioner.inference import Captioned, LoadedModel, caption_files, load_model

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
PROGRESS_MIN_IMAGES = 64
STDIN = "-"  # among the inputs: read image paths from standard input, one per line
DEFAULT_NAME = "captioner"  # the algorithm name in a results file for the COCO evaluation server


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
    kept, so that an unreadable one gets its own error. ``-`` reads more inputs from standard input, one
    per line (blank lines ignored); ConfigError when it is given twice.
    """
    if list(items).count(STDIN) > 1:
        raise ConfigError(f"{STDIN} (standard input) is given more than once")
    paths: list[str] = []
    errors: list[Skipped] = []
    for item in items:
        lines = (line.rstrip("\r\n") for line in sys.stdin) if item == STDIN else [item]
        for line in lines:
            if line.strip():
                _expand(line, paths, errors)
    return paths, errors


def _report(skipped: Skipped) -> None:
    """One line on stderr naming an input that could not be used and why."""
    print(f"error: {skipped.path}: {skipped.reason}", file=sys.stderr)


def _inputs(args: argparse.Namespace) -> tuple[list[str], list[Skipped]]:
    """The image paths of the command line; input errors are reported at once and returned."""
    paths, failed = expand_inputs(args.inputs)
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
    check_range("--batch-size", args.batch_size, 1, kind=int)
    check_range("--workers", args.workers, 0, kind=int)
    fields = [field.name for field in dataclasses.fields(DecodingConfig)]
    try:  # checked where the decoding settings are defined; the messages name the flags
        return to_dict(DecodingConfig(**{field: getattr(args, field) for field in fields}))
    except ConfigError as exc:
        message = str(exc)
        for field in fields:
            message = message.replace(field, "--" + field.replace("_", "-"))
        raise ConfigError(message) from None


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


def _print_result(result: Captioned, as_json: bool, image_id: int | None = None) -> None:
    """One line on stdout: ``path<TAB>caption``, or a JSON object (image_id, path, caption, score, tokens)."""
    if as_json:
        line = {"image_id": image_id} if image_id is not None else {}
        line.update(path=result.path, caption=result.caption, score=round(result.score, 4), tokens=result.words)
        print(json.dumps(line), flush=True)
    else:
        print(f"{result.path}\t{result.caption}", flush=True)


# ------------------------------------------------------------------------------------------ commands
def cmd_caption(args: argparse.Namespace) -> int:
    """Caption images; print ``path<TAB>caption`` or JSON lines (path, caption, score, tokens).

    With ``--image-info``: caption the images a COCO image list names and write the evaluation server's
    results file into ``--out``.
    """
    if args.image_info or args.out:
        if args.inputs:
            raise ConfigError("give images either as arguments or with --image-info, not both")
        return _server_results(args, echo=True)
    if not args.inputs:
        raise ConfigError(
            "give image files, folders or globs (- reads paths from standard input), "
            "or --image-info FILE --images DIR --out DIR"
        )
    if args.image_dir or args.name != DEFAULT_NAME or args.force:
        raise ConfigError("--images, --name and --force go with --image-info and --out")
    decode = _decode_options(args)
    loaded = _load(args, _device(args.device))
    paths, failed = _inputs(args)
    for result in caption_files(loaded, paths, args.batch_size, args.workers, _progress(args, len(paths)), **decode):
        if isinstance(result, Skipped):
            _report(result)
            failed.append(result)
        else:
            _print_result(result, args.json)
    return 1 if failed else 0


def _server_results(args: argparse.Namespace, echo: bool) -> int:
    """Caption every image of ``--image-info`` and write ``captions_<split>_<name>_results.json`` to ``--out``.

    ``echo`` prints each caption as ``caption`` does. The file is written only when every image was
    captioned (the server needs a caption for each image id); unreadable images are reported one per
    line and the exit status is 1.
    """
    from captioner.data.readers import read_image_info
    from captioner.evaluation.results import server_results_name, write_results

    if not (args.image_info and args.image_dir and args.out):
        raise ConfigError(
            "--image-info, --images and --out go together: the COCO image list, the folder of "
            "its images and the folder for the results file"
        )
    decode = _decode_options(args)
    target = Path(args.out) / server_results_name(args.image_info, args.name)
    _refuse_overwrite(target, args)
    records = read_image_info(args.image_info, args.image_dir)
    if not records:
        raise ConfigError(f"--image-info {args.image_info} lists no images")
    loaded = _load(args, _device(args.device))
    paths = [record.image_path for record in records]
    captions: dict[int, str] = {}
    failed: list[Skipped] = []
    results = caption_files(loaded, paths, args.batch_size, args.workers, _progress(args, len(paths)), **decode)
    for record, result in zip(records, results):
        if isinstance(result, Skipped):
            _report(result)
            failed.append(result)
            continue
        captions[record.image_id] = result.caption
        if echo:
            _print_result(result, args.json, record.image_id)
    if failed:
        print(
            f"error: {len(failed)} of {len(records)} images could not be read (listed above); {target} was "
            "not written, since the evaluation server needs a caption for every image",
            file=sys.stderr,
        )
        return 1
    write_results(target, captions)
    print(f"results: {target} ({len(captions)} images)", file=sys.stderr)
    return 0


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
    paths, failed = _inputs(args)
    if single and len(paths) > 1:
        raise ConfigError(f"--out {out}: {len(paths)} images need a folder, not a .png file")
    entries = []
    for result in caption_files(loaded, paths, args.batch_size, args.workers, _progress(args, len(paths)), **decode):
        if isinstance(result, Skipped):
            _report(result)
            failed.append(result)
            continue
        target = out if single else out / f"{len(entries):04d}_{Path(result.path).stem}.png"
        draw_overlay(
            load_rgb(result.path),
            result.words,
            result.alphas,
            result.grid,
            target,
            locations=result.locations,
            title=result.caption,
        )
        entries.append(GalleryEntry(image=result.path, caption=result.caption, overlay=target))
        print(f"{result.path}\t{result.caption}\t{target}", flush=True)
    if not single and entries:
        print(f"gallery: {write_gallery(out, entries)}", file=sys.stderr)
    return 1 if failed else 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Decode a dataset split; report BLEU (nltk) and the coco-caption suite; write results, metrics and the
    scores of each image. With ``--image-info`` (images without captions) write the server's results file."""
    from captioner.evaluation.report import METRICS_FILE, PER_IMAGE_FILE, RESULTS_FILE, evaluate_split

    datasets = [name for name in ("shapes", "karpathy", "coco_captions", "image_info") if getattr(args, name)]
    if len(datasets) != 1:
        raise ConfigError(
            "give exactly one dataset: --shapes ROOT, --karpathy FILE --images ROOT, "
            "--coco-captions FILE --images DIR, or --image-info FILE --images DIR"
        )
    if args.instances and not args.coco_captions:
        raise ConfigError("--instances goes with --coco-captions")
    if args.image_info:
        print(
            f"{args.image_info} lists images without captions: nothing to score; writing the results file "
            "for the evaluation server",
            file=sys.stderr,
        )
        return _server_results(args, echo=False)
    decode = _decode_options(args)
    device = _device(args.device)
    out = Path(args.out)
    for name in (RESULTS_FILE, METRICS_FILE, PER_IMAGE_FILE):
        _refuse_overwrite(out / name, args)
    records = _records(args)
    loaded = _load(args, device)
    metrics, skipped = evaluate_split(
        loaded,
        records,
        out,
        args.batch_size,
        args.workers,
        coco=not args.no_coco,
        progress=_progress(args, len(records)),
        **decode,
    )
    for item in skipped:
        _report(item)
    print(metrics["table"])
    return 1 if skipped else 0


def _records(args: argparse.Namespace) -> list[Record]:
    """The records of ``--split`` from the one dataset the arguments name (shapes, Karpathy or COCO)."""
    from captioner.data import sources

    if args.shapes:
        if args.image_dir:
            raise ConfigError("--images goes with --karpathy or --coco-captions; --shapes has its own")
        return sources.ShapesSource(args.shapes).records(args.split)
    if not args.image_dir:
        raise ConfigError("--images is required with --karpathy and --coco-captions")
    if args.karpathy:
        source = sources.KarpathySource(args.karpathy, args.image_dir)
    else:
        entry = {"captions": args.coco_captions, "images": args.image_dir, "instances": args.instances}
        source = sources.CocoSource({args.split: entry})
    source.prepare()
    return source.records(args.split)


# ------------------------------------------------------------------------------------------- parser
class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help (not for required options, flags, or no default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.required
            or not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(prog="captioner", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--model",
            required=True,
            help="a training run's folder (its bundle.pt), a bundle.pt, or a training checkpoint",
        )
        sub.add_argument("--method", choices=list(DecodeMethod), default="beam", help="decoding method")
        sub.add_argument(
            "--beam-size", type=int, default=DecodingConfig.beam_size, help="captions kept per image by beam search"
        )
        sub.add_argument("--max-len", type=int, default=DecodingConfig.max_len, help="maximum words per caption")
        sub.add_argument("--temperature", type=float, default=DecodingConfig.temperature, help="for --method sample")
        sub.add_argument(
            "--length-penalty", type=float, default=DecodingConfig.length_penalty, help="GNMT alpha for beam search"
        )
        sub.add_argument(
            "--min-len", type=int, default=DecodingConfig.min_len, help="no <end> before this many words (0: off)"
        )
        sub.add_argument(
            "--no-repeat-ngram-size",
            type=int,
            default=DecodingConfig.no_repeat_ngram_size,
            help="no n-gram of this many words twice in a caption (0: off)",
        )
        sub.add_argument("--batch-size", type=int, default=32, help="images encoded and decoded together")
        sub.add_argument("--workers", type=int, default=2, help="image-decoding processes; 0 decodes in this one")
        sub.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        sub.add_argument(
            "--no-progress",
            action="store_true",
            help=f"no progress bar on stderr (shown from {PROGRESS_MIN_IMAGES} images)",
        )

    def server(sub: argparse.ArgumentParser, images: str) -> None:
        sub.add_argument(
            "--image-info",
            metavar="FILE",
            help="COCO image list (image_info_test2014.json, or a captions file such as "
            "captions_val2014.json): caption its images and write the evaluation server's "
            "results file captions_<split>_<name>_results.json into --out",
        )
        sub.add_argument("--images", dest="image_dir", metavar="DIR", help=images)
        sub.add_argument(
            "--name", default=DEFAULT_NAME, help="algorithm name in the results file name (letters, digits, hyphens)"
        )

    inputs_help = "image files, folders (searched recursively) and globs; - reads paths from standard input"
    caption = command("caption", "caption image files, folders and globs, or the images of a COCO image list")
    caption.add_argument("inputs", nargs="*", metavar="IMAGE", help=inputs_help)
    common(caption)
    caption.add_argument("--json", action="store_true", help="JSON lines: path, caption, score, tokens")
    server(caption, "folder of the --image-info images")
    caption.add_argument("--out", metavar="DIR", help="folder for the --image-info results file")
    caption.add_argument("--force", action="store_true", help="overwrite an existing results file")
    caption.set_defaults(func=cmd_caption)

    attend = command("attend", "draw the attention map of every generated word")
    attend.add_argument("inputs", nargs="+", metavar="IMAGE", help=inputs_help)
    common(attend)
    attend.add_argument("--out", required=True, help="FILE.png for one image, or a folder (with index.html)")
    attend.add_argument("--force", action="store_true", help="overwrite an existing --out")
    attend.set_defaults(func=cmd_attend)

    evaluate = command("evaluate", "BLEU and coco-caption metrics on a dataset split")
    common(evaluate)
    evaluate.add_argument(
        "--split",
        choices=("train", "val", "test"),
        default="test",
        help="split of --shapes and --karpathy (and the name of the --coco-captions one)",
    )
    evaluate.add_argument("--shapes", help="root of the built-in dataset")
    evaluate.add_argument("--karpathy", help="Karpathy split file (dataset_coco.json, dataset_flickr8k.json, ...)")
    evaluate.add_argument("--coco-captions", help="COCO captions file (captions_val2014.json, ...)")
    evaluate.add_argument("--instances", help="COCO instances file (boxes for attention correctness)")
    server(evaluate, "image root (--karpathy) or folder (--coco-captions, --image-info)")
    evaluate.add_argument("--out", required=True, help="folder for results.json, metrics.json and per_image.json")
    evaluate.add_argument("--no-coco", action="store_true", help="skip the Java coco-caption suite")
    evaluate.add_argument("--force", action="store_true", help="overwrite the files of an earlier --out")
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
