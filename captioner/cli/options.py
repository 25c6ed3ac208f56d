"""The options every command shares, checked: decoding and batching, the device, the model, ``--out``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from captioner import load_model
from captioner.cli import parser
from captioner.config import MAX_WORDS, DecodingConfig, EnsembleMean, HardInference, captioning_settings
from captioner.errors import ConfigError, DataError, check_range
from captioner.fileio import append_record, read_record

if TYPE_CHECKING:
    from captioner import LoadedModel


def device(name: str) -> torch.device:
    """``--device``: auto, cpu, cuda or cuda:N; ConfigError for one this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif chosen.type != "cpu":
        raise ConfigError(f"--device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return chosen


def check_options(args: argparse.Namespace) -> None:
    """Check the batching and decoding options before anything loads, refusing only what no model accepts: the
    decoding ones as ``caption()`` checks its keywords (:func:`decoding`) over captioning's defaults with the
    longest captions any model may decode (``--min-len 21`` fits a model of ``max_len`` 24); ``load`` checks them
    against the model's own settings."""
    check_range("--batch-size", args.batch_size, 1, kind=int)
    check_range("--workers", args.workers, 0, kind=int)
    if args.max_pixels is not None:
        check_range("--max-pixels", args.max_pixels, 1, kind=int)
    decoding(args, DecodingConfig.captioning(max_len=MAX_WORDS))


def decoding(args: argparse.Namespace, base: DecodingConfig | None = None) -> DecodingConfig:
    """The decoding options given (``args.given``) over ``base`` (a model's own: ``LoadedModel.decoding``; None:
    captioning's defaults), checked as ``caption()`` checks its keywords."""
    names = [field.name for field in dataclasses.fields(DecodingConfig)]
    given = {name: getattr(args, name) for name in names if name in args.given}
    return captioning_settings(given, flags=True, base=base)


def load(args: argparse.Namespace, on: torch.device) -> LoadedModel:
    """The ``--model`` file (bundle or training checkpoint), in eval mode on ``on``, decoding as its run did with
    the decoding options given over that (:func:`decoding`); a hard attention model reading what
    ``--hard-inference`` asks. Several ``--model``: their ensemble (``load_model`` of the list, averaging as
    ``--ensemble-mean`` says), decoding as the first one's run did, ``--hard-inference`` read by each hard attention
    member."""
    from captioner.inference import LoadedEnsemble

    mean = getattr(args, "ensemble_mean", EnsembleMean.log)
    if len(args.model) == 1 and mean != EnsembleMean.log:
        raise ConfigError(f"--ensemble-mean {mean}: one --model is not an ensemble")
    if len(args.model) == 1:
        loaded = load_model(args.model[0], map_location="cpu")
    else:
        loaded = load_model(args.model, map_location="cpu", mean=mean)
    loaded = dataclasses.replace(loaded, decoding=decoding(args, loaded.decoding))
    loaded.model.to(on)
    if getattr(args, "hard_inference", None) is not None:
        members = loaded.members if isinstance(loaded, LoadedEnsemble) else (loaded,)
        hard = [member for member in members if member.model.decoder.hard_read is not None]
        if not hard:
            modes = ", ".join(f"{member.source} uses {member.model.decoder.mode} attention" for member in members)
            raise ConfigError(
                f"--hard-inference {args.hard_inference}: {modes}; the option chooses what a hard attention model reads"
            )
        for member in hard:
            member.config.decoder.hard_inference = HardInference(args.hard_inference)  # what the decoder reads
    return loaded


def progress(args: argparse.Namespace, images: int) -> bool:
    """Show a progress bar for many images on a terminal, unless ``--no-progress``."""
    return not args.no_progress and images >= parser.PROGRESS_MIN_IMAGES and sys.stderr.isatty()


def check_images_found(args: argparse.Namespace, label: str, paths: list[str]) -> None:
    """DataError when none of a dataset's images ``paths`` is under ``--images`` (rather than one failure per
    image): the check of training's preflight."""
    from captioner.data.images import images_present, none_found

    if paths and not images_present(paths):
        raise DataError(
            f"--images {args.image_dir}: {none_found(label, paths)}; point --images at the folder that holds them"
        )


# A folder's record of the files that captioner's commands wrote there (evaluate's results, caption --image-info's
# results file, attend's NAME.png, a splits file), a JSON name per line: what --force may replace. A file it does
# not name is the user's, which no command replaces. (A gallery keeps its own record: viz.layout.MANIFEST.)
WRITTEN = ".captioner-written"


def refuse_overwrite(target: Path, args: argparse.Namespace) -> None:
    """ConfigError when ``target`` exists, unless ``--force`` was given and a captioner command wrote it
    (``record_written``): a file of the user's is never replaced."""
    if not target.exists():
        return
    if not args.force:
        raise ConfigError(f"--out {args.out or target}: {target} already exists; pass --force to overwrite it")
    if target.name not in read_record(target.parent / WRITTEN):
        raise ConfigError(
            f"--out {args.out or target}: {target} was not written by captioner, and --force replaces only the files "
            "it wrote: move it, or choose another --out"
        )


def record_written(target: Path) -> None:
    """Record in its folder that a captioner command wrote ``target``, so that ``--force`` may replace it."""
    if target.name not in read_record(target.parent / WRITTEN):
        append_record(target.parent / WRITTEN, [target.name])


def check_writable(target: Path, args: argparse.Namespace) -> None:
    """ConfigError, before any work, when the file ``target`` of ``--out`` could not be written there: the nearest
    folder of its path that exists takes no new file (read-only, another user's, a file where a folder would go).
    A file is made there and removed to find out, since permission bits do not tell (root, a read-only mount)."""
    there = target.parent
    while not there.exists() and there != there.parent:
        there = there.parent
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as exc:
        raise ConfigError(f"--out {args.out}: {there} cannot be written ({exc.strerror or exc})") from None
