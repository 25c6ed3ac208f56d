"""``captioner caption``: caption images; or the images of a COCO image list, for the evaluation server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from captioner.cli import options
from captioner.cli.inputs import Inputs, expand_inputs
from captioner.cli.output import Output
from captioner.cli.parser import DEFAULT_NAME
from captioner.data.dataset import Skipped
from captioner.data.device_decoding import DecodeTally
from captioner.errors import ConfigError
from captioner.inference import Captioned, caption_files


def run(args: argparse.Namespace) -> int:
    """Caption images; print ``path<TAB>caption`` or JSON lines, and a summary on stderr.

    With ``--image-info``: caption the images a COCO image list names and write the evaluation server's
    results file into ``--out``.
    """
    if args.image_info:
        if args.inputs:
            raise ConfigError("give images either as arguments or with --image-info, not both")
        return server_results(args, echo=True)
    server_only = [flag for flag, given in _server_flags(args).items() if given]
    if server_only:
        raise ConfigError(
            f"{', '.join(server_only)} {'goes' if len(server_only) == 1 else 'go'} with --image-info (the COCO "
            "image list whose results file --out receives); the captions of IMAGE arguments are printed on "
            "stdout: redirect it to keep them (> captions.tsv)"
        )
    if not args.inputs:
        raise ConfigError(
            "give image files, folders or globs (- reads paths from standard input), "
            "or --image-info FILE --images DIR --out DIR"
        )
    options.check_options(args)
    device = options.device(args.device)
    output = Output(args.json)
    for result in captioned(args, expand_inputs(args.inputs, nul=args.nul), output, device):
        output.caption(result)
    return output.close()


def captioned(
    args: argparse.Namespace,
    found: Inputs,
    output: Output,
    device: torch.device,
    bar: bool = True,
) -> Iterator[Captioned]:
    """The captioned images of ``found`` in order; its input errors and unreadable images go to ``output`` as
    failures, its skipped files to its summary, the line on what its search left out (a gallery's files) to
    stderr. The model is loaded only when there is an image to caption, and decodes as ``options.load`` says; the
    images are decoded where ``--decode`` says, which ``output``'s summary tells when the device decoded JPEGs.
    ``bar``: show captioning's progress bar (``--no-progress`` and a terminal allowing); False when the caller
    shows its own."""
    output.skipped = found.skipped
    if found.left_out:
        output.note(found.left_out)
    output.failures(found.errors)
    if not found.paths:
        return
    loaded = options.load(args, device)
    output.start(len(found.paths))
    show = bar and options.progress(args, len(found.paths))
    tally = DecodeTally()
    results = caption_files(
        loaded, found.paths, args.batch_size, args.workers, show, loaded.decoding, args.max_pixels, args.decode, tally
    )
    for result in results:
        if isinstance(result, Skipped):
            output.failure(result)
        else:
            yield result
    output.decoding = tally.report(device)


def _server_flags(args: argparse.Namespace) -> dict[str, bool]:
    """The options that only a COCO image list (``--image-info``) uses, and whether each was given."""
    return {
        "--out": args.out is not None,
        "--images": args.image_dir is not None,
        "--name": args.name != DEFAULT_NAME,
        "--force": args.force,
    }


def server_results(args: argparse.Namespace, echo: bool) -> int:
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
    options.check_options(args)
    target = Path(args.out) / server_results_name(args.image_info, args.name)
    options.refuse_overwrite(target, args)
    options.check_writable(target, args)
    records = read_image_info(args.image_info, args.image_dir)
    if not records:
        raise ConfigError(f"--image-info {args.image_info} lists no images")
    options.check_images_found(args, Path(args.image_info).name, [record.image_path for record in records])
    device = options.device(args.device)
    loaded = options.load(args, device)
    output = Output(getattr(args, "json", False), rows=echo, files=True)
    paths = [record.image_path for record in records]
    output.start(len(paths))
    captions: dict[int, str] = {}
    show = options.progress(args, len(paths))
    tally = DecodeTally()
    results = caption_files(
        loaded, paths, args.batch_size, args.workers, show, loaded.decoding, args.max_pixels, args.decode, tally
    )
    for record, result in zip(records, results):
        if isinstance(result, Skipped):
            output.failure(result)
            continue
        captions[record.image_id] = result.caption
        output.caption(result, image_id=record.image_id)
    output.decoding = tally.report(device)
    if output.failed:
        print(
            f"error: {output.failed} of {len(records)} images could not be read (listed above); {target} was "
            "not written, since the evaluation server needs a caption for every image",
            file=sys.stderr,
        )
    else:
        write_results(target, captions)
        options.record_written(target)
        print(f"results: {target} ({len(captions)} images)", file=sys.stderr)
    return output.close()
