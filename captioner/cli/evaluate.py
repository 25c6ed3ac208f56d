"""``captioner evaluate``: decode a dataset split and score it (nltk BLEU, the coco-caption suite, attention
correctness where the dataset has boxes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from captioner.cli import options
from captioner.cli.caption import server_results
from captioner.data.readers import Record
from captioner.errors import ConfigError, DataError


def run(args: argparse.Namespace) -> int:
    """Decode a dataset split; report BLEU (nltk) and the coco-caption suite; write results, metrics and the
    scores of each image. With ``--image-info`` (images without captions) write the server's results file."""
    from captioner.evaluation.report import PER_IMAGE_FILE, RESULTS_FILE, evaluate_split
    from captioner.run_files import METRICS_FILE

    names = ("shapes", "karpathy", "coco_captions", "captions", "image_info")
    datasets = [name for name in names if getattr(args, name)]
    if len(datasets) != 1:
        raise ConfigError(
            "give exactly one dataset: --shapes ROOT, --karpathy FILE --images ROOT, "
            "--coco-captions FILE --images DIR, --captions FILE, or --image-info FILE --images DIR"
        )
    if args.split_file and not args.captions:
        raise ConfigError("--split-file goes with --captions (the split a run wrote of that captions file)")
    if args.instances and not args.coco_captions:
        raise ConfigError("--instances goes with --coco-captions (the boxes of that captions file's images)")
    if args.image_info:
        print(
            f"{args.image_info} lists images without captions: nothing to score; writing the results file "
            "for the evaluation server",
            file=sys.stderr,
        )
        return server_results(args, echo=False)
    options.check_options(args)
    device = options.device(args.device)
    out = Path(args.out)
    for name in (RESULTS_FILE, METRICS_FILE, PER_IMAGE_FILE):
        options.refuse_overwrite(out / name, args)
    options.check_writable(out / RESULTS_FILE, args)
    records = _records(args)
    loaded = options.load(args, device)
    metrics, skipped = evaluate_split(
        loaded,
        records,
        out,
        args.batch_size,
        args.workers,
        coco=not args.no_coco,
        progress=options.progress(args, len(records)),
        decoding=loaded.decoding,
        max_pixels=args.max_pixels,
        decode=args.decode,
    )
    for name in (RESULTS_FILE, METRICS_FILE, PER_IMAGE_FILE):
        options.record_written(out / name)
    for item in skipped:
        print(f"error: {item.path}: {item.reason}", file=sys.stderr)
    print(metrics["table"])
    if args.instances and "attention_correctness" not in metrics:
        boxed = sum(1 for record in records if record.boxes)
        print(
            f"note: --instances {args.instances}: no attention correctness, since no generated caption names an "
            f"object category of its {boxed} images with boxes",
            file=sys.stderr,
        )
    return 1 if skipped else 0


def _records(args: argparse.Namespace) -> list[Record]:
    """The records of ``--split`` from the one dataset the arguments name (shapes, Karpathy, COCO or captions)."""
    from captioner.data import shapes, sources

    if args.captions:
        return _captions_records(args)
    if args.shapes:
        if args.image_dir:
            raise ConfigError("--images goes with --karpathy or --coco-captions; --shapes has its own")
        if not (Path(args.shapes) / shapes.META).is_file():
            raise DataError(
                f"--shapes {args.shapes}: no generated shapes dataset there ({shapes.META} is missing); "
                "python train.py generates it in data/shapes on first use, "
                f"captioner shapes --out {args.shapes} generates it there"
            )
        return sources.ShapesSource(args.shapes).records(args.split)
    if not args.image_dir:
        raise ConfigError("--images is required with --karpathy and --coco-captions")
    dataset = ("--karpathy", args.karpathy) if args.karpathy else ("--coco-captions", args.coco_captions)
    _check_given((*dataset, "file"), ("--images", args.image_dir, "folder"), ("--instances", args.instances, "file"))
    if args.karpathy:
        source = sources.KarpathySource(args.karpathy, args.image_dir)
    else:
        entry = {"captions": args.coco_captions, "images": args.image_dir, "instances": args.instances}
        source = sources.CocoSource({args.split: entry})
    source.prepare()
    records = source.records(args.split)
    options.check_images_found(args, args.split, [record.image_path for record in records])
    return records


def _run_split(model: str) -> Path | None:
    """The captions split file of the run that ``--model`` names (its folder, its bundle.pt, or a checkpoint in
    its checkpoints/), or None."""
    from captioner.data.captions_file import SPLIT_FILE

    path = Path(model)
    folders = [path] if path.is_dir() else [path.parent, path.parent.parent]
    return next((folder / SPLIT_FILE for folder in folders if (folder / SPLIT_FILE).is_file()), None)


def _captions_records(args: argparse.Namespace) -> list[Record]:
    """The records of ``--split`` of a captions file, split (and numbered) as the run that wrote the split file
    split it; the file's settings (columns, images folder) are that run's, ``--images`` replacing its folder.
    Without the run's split file, the file's own split column (``_own_split_records``)."""
    from captioner.data.sources import CaptionsSource
    from captioner.fileio import read_json

    first = args.model[0]  # an ensemble's members share their split: its first member's run names it
    split_file = Path(args.split_file) if args.split_file else _run_split(first)
    _check_given(("--captions", args.captions, "file"), ("--images", args.image_dir, "folder"))
    if split_file is None:
        return _own_split_records(args, first)
    _check_given(("--split-file", str(split_file), "file"))
    written = read_json(split_file, "captions split file")
    settings = dict(written.get("settings") or {}) if isinstance(written, dict) else {}
    if args.image_dir:
        settings["images"] = args.image_dir
    source = CaptionsSource(args.captions, split_from=str(split_file), **settings)
    source.prepare()
    records = source.records(args.split)
    if not records:
        raise DataError(f"--captions {args.captions}: the split of {split_file} has no {args.split} image")
    return records


def _own_split_records(args: argparse.Namespace, model: str) -> list[Record]:
    """The records of ``--split`` of a captions file whose own split column splits it (the file's default
    columns, ``--images`` its images folder): where no run's split file is at hand (a bundle copied elsewhere),
    the split a run on it trained with. ConfigError for a file without that column, whose split only the run's
    split file knows (its seed and sizes)."""
    from captioner.config import CaptionsSpec
    from captioner.data.captions_file import SPLIT_FILE
    from captioner.data.sources import CaptionsSource

    source = CaptionsSource(args.captions, images=args.image_dir)
    if not source.read().split_column:
        raise ConfigError(
            f"--captions {args.captions}: no {SPLIT_FILE} beside --model {model} (a run on data=captions writes "
            f"it into its folder), and the file has no {CaptionsSpec.split_column!r} column to split it: give the "
            "run's folder, or its split with --split-file"
        )
    records = source.records(args.split)
    if not records:
        raise DataError(
            f"--captions {args.captions}: its {CaptionsSpec.split_column!r} column names no {args.split} image"
        )
    return records


def _check_given(*given: tuple[str, str | None, str]) -> None:
    """Raise DataError naming the flag of the first ``(flag, path, kind)`` whose path, where given, is not an
    existing ``kind`` ("file" or "folder")."""
    from captioner.data.sources import path_problem

    for flag, path, kind in given:
        if path is not None and (problem := path_problem(f"{flag} {path}", path, kind)):
            raise DataError(problem)
