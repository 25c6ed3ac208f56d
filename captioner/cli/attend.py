"""``captioner attend``: caption images and draw the attention of every word: one PNG for one image, or a
gallery folder (captioner.viz.gallery) for many."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from captioner.cli import options
from captioner.cli.caption import captioned
from captioner.cli.inputs import IMAGE_SUFFIXES, Inputs, LeftOut, expand_inputs
from captioner.cli.output import Output
from captioner.data.dataset import Skipped
from captioner.data.images import ImageError, load_rgb
from captioner.errors import ConfigError
from captioner.viz.layout import MANIFEST, GalleryFiles

if TYPE_CHECKING:  # drawing's modules load with the command, not with the CLI
    import torch

    from captioner.inference import Captioned
    from captioner.viz.overlay import Shading

AHEAD = 4  # images whose sheet and strip the writing thread may still have to write while the next are shaded


def _check_gallery(files: GalleryFiles, found: Inputs, out: str) -> None:
    """ConfigError, before anything is loaded or removed, when the gallery would replace an input or a file
    that no gallery wrote (a user's own ``index.html``, a folder of the name of an entry's panels)."""
    from captioner.viz.gallery import page_count

    inputs = [path for path in found.paths if files.ours(path)]
    if inputs:
        raise ConfigError(
            f"--out {out}: the input {inputs[0]} is a file of the earlier gallery there, which --force replaces; "
            "copy it elsewhere first, or choose another --out"
        )
    pages = [files.page(k) for k in range(page_count(len(found.paths)))]
    planned = [*pages, *(path for number, image in enumerate(found.paths) for path in files.planned(number, image))]
    taken = files.conflicts(planned)
    if taken:
        raise ConfigError(
            f"--out {out}: {taken[0]} exists and no gallery wrote it (none recorded it in {files.root / MANIFEST}); "
            "a gallery never replaces a file of yours: move it, or choose another --out"
        )


def _write(shading: Shading, words: Sequence[str], target: Path, title: str, strip: Path | None) -> None:
    """Write one image's sheet at ``target`` and the strip of its panels at ``strip`` (none for a single
    ``.png``): Pillow composes and encodes, and the files are made, outside Python's lock, beside the next
    image's captioning."""
    from captioner.viz import sheet

    sheet.write_sheet(shading, words, target, title)
    if strip is not None:
        sheet.save_picture(sheet.strip_picture(shading), strip)


def run(args: argparse.Namespace) -> int:
    """Caption images and draw one attention panel per word; for a folder ``--out``, a gallery of pages that
    show each word's panel in turn and list the inputs that failed.

    Prints ``path<TAB>caption<TAB>overlay`` per image and a summary line on stderr; an image that cannot be
    drawn is that image's failure, listed on the gallery's first page. With ``--force`` a gallery replaces exactly
    the files an earlier gallery recorded in ``--out``, once all of its own are written (in a stage beside
    ``--out``, then moved in): a run that fails leaves the earlier gallery whole.
    """
    options.check_options(args)
    device = options.device(args.device)
    out = Path(args.out)
    single = out.suffix.lower() == ".png"
    if out.suffix.lower() in IMAGE_SUFFIXES and not single:
        raise ConfigError(f"--out {out}: overlays are PNG files; give NAME.png or a folder")
    if single and out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a .png file name, or a folder without .png")
    if single:
        options.refuse_overwrite(out, args)
    elif out.is_dir() and any(out.iterdir()) and not args.force:
        raise ConfigError(
            f"--out {out}: {out} holds an earlier gallery; pass --force to replace it (its files only: nothing else "
            "there is touched)"
            if GalleryFiles(out).earlier
            else f"--out {out}: {out} holds files; pass --force to write the gallery among them (none is replaced)"
        )
    options.check_writable(out if single else out / MANIFEST, args)
    files = GalleryFiles(out)
    found = expand_inputs(args.inputs, nul=args.nul, leave_out=LeftOut(None if single else out))
    if single and len(found.paths) > 1:
        raise ConfigError(f"--out {out}: {len(found.paths)} images need a folder, not a .png file")
    if single and any(os.path.realpath(path) == os.path.realpath(out) for path in found.paths):
        raise ConfigError(f"--out {out} is the input image; give another file name")
    if not single:
        _check_gallery(files, found, args.out)
    if not single and found.paths:  # written beside --out, moved in once it is whole
        beside = out.absolute()
        beside.parent.mkdir(parents=True, exist_ok=True)
        files = GalleryFiles(out, tempfile.mkdtemp(prefix=f".{beside.name}.", suffix=".new", dir=beside.parent))
    try:
        return _draw(args, out, single, found, files, device)
    finally:
        if files.stage != files.root:
            shutil.rmtree(files.stage, ignore_errors=True)


def _draw(
    args: argparse.Namespace, out: Path, single: bool, found: Inputs, files: GalleryFiles, device: torch.device
) -> int:
    """``run``'s captioning and drawing, once ``--out`` is checked: the gallery's files go to ``files``' stage and
    are moved in when the gallery is whole."""
    from captioner.viz.gallery import GalleryEntry, Panels, write_gallery
    from captioner.viz.overlay import shade

    numbers = {path: number for number, path in enumerate(found.paths)}  # entry n: the n-th input, for every name
    entries: list[GalleryEntry | None] = [None] * len(found.paths)
    output = Output(files=True)
    show = options.progress(args, len(found.paths))
    # (its files' writing in the background, the result, its sheet, its strip, its shading, its entry), in order
    pending: deque[tuple[Future, Captioned, Path, Path | None, Shading, int]] = deque()

    def finish(bar: tqdm) -> None:
        """Wait for the oldest image's files (an error in writing them raises here), then list and print it."""
        future, result, target, strip, shading, number = pending.popleft()
        future.result()
        if not single:
            panels = Panels(strip, tuple(result.words), shading.picture.size) if strip else None
            scale = (shading.uniform, shading.top)
            entries[number] = GalleryEntry(result.path, result.caption, target, panels=panels, scale=scale)
        output.caption(result, target if single else out / files.relative(target))  # where it is once moved in
        bar.update(output.captioned + output.failed - len(found.errors) - bar.n)

    with tqdm(total=len(found.paths), unit="img", file=sys.stderr, desc="drawing", disable=not show) as bar:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="attend-writer") as writer:
            for result in captioned(args, found, output, device, bar=False):
                number = numbers[result.path]
                try:
                    picture = load_rgb(result.path, args.max_pixels)
                except ImageError as exc:  # changed since it was captioned, or larger than it can be drawn
                    output.failure(Skipped(result.path, f"cannot be drawn: {exc.reason}"))
                    continue
                shading = shade(picture, result.words, result.alphas, result.grid, result.locations)
                target, strip = out, None
                if not single:
                    target = files.sheet(number, result.path)
                    strip = files.strip(number, result.path) if result.words else None  # no panel, no strip
                    files.record_all([target, strip] if strip else [target])
                job = writer.submit(_write, shading, result.words, target, result.caption, strip)
                pending.append((job, result, target, strip, shading, number))
                while len(pending) > AHEAD:
                    finish(bar)
            while pending:
                finish(bar)
        bar.update(len(found.paths) - bar.n)
    if single and out.exists():
        options.record_written(out)
    if not single and found.paths:
        for item in output.failed_inputs:
            failed = GalleryEntry(image=item.path, caption=None, error=item.reason)
            if item.path in numbers:
                entries[numbers[item.path]] = failed
            else:
                entries.append(failed)  # an input that named no image: a glob without a match, ...
        gallery = [entry for entry in entries if entry is not None]
        write_gallery(out, gallery, files=files, max_pixels=args.max_pixels)
        files.move_in()
        print(f"gallery: {files.page(0)}", file=sys.stderr)
    return output.close()
