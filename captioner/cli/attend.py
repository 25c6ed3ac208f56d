"""``captioner attend``: caption images and draw the attention of every word, one PNG per image."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from captioner.cli import options
from captioner.cli.caption import captioned
from captioner.cli.inputs import IMAGE_SUFFIXES, expand_inputs
from captioner.cli.output import Output
from captioner.data.images import load_rgb
from captioner.errors import ConfigError
from captioner.fileio import atomic_write

NUMBERED = "[0-9][0-9][0-9][0-9]_*"  # the names of what a gallery writes: 0000_<image name>, ...


def _clear(out: Path) -> None:
    """Remove what an earlier gallery wrote into ``out`` (``--force``): its page, overlays, panels and copies;
    other files are kept."""
    from captioner.viz.gallery import COPIES

    for path in [*out.glob(f"{NUMBERED}.png"), *(out / COPIES).glob(f"{NUMBERED}.jpg"), out / "index.html"]:
        if path.is_file():
            path.unlink()
    for folder in out.glob(NUMBERED):
        if folder.is_dir():
            shutil.rmtree(folder)


def run(args: argparse.Namespace) -> int:
    """Caption images and draw one attention panel per word; for a folder ``--out``, also a gallery page that
    shows each word's panel in turn and lists the inputs that failed.

    Prints ``path<TAB>caption<TAB>overlay`` per image and a summary line on stderr.
    """
    from captioner.viz.gallery import GalleryEntry, write_gallery
    from captioner.viz.overlay import draw_overlay, word_panels

    decode = options.decode_options(args)
    device = options.device(args.device)
    out = Path(args.out)
    single = out.suffix.lower() == ".png"
    if out.suffix.lower() in IMAGE_SUFFIXES and not single:
        raise ConfigError(f"--out {out}: overlays are PNG files; give NAME.png or a folder")
    if single and out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a .png file name, or a folder without .png")
    if single or (out.is_dir() and any(out.iterdir())):
        options.refuse_overwrite(out, args)
    found = expand_inputs(args.inputs, nul=args.nul)
    if single and len(found.paths) > 1:
        raise ConfigError(f"--out {out}: {len(found.paths)} images need a folder, not a .png file")
    if not single and out.is_dir():
        _clear(out)
    output = Output()
    entries = []
    for result in captioned(args, found, output, decode, device):
        name = f"{len(entries):04d}_{Path(result.path).stem}"
        target = out if single else out / f"{name}.png"
        picture = load_rgb(result.path)
        draw_overlay(
            picture, result.words, result.alphas, result.grid, target, locations=result.locations, title=result.caption
        )
        panels = []
        if not single:
            (out / name).mkdir(parents=True, exist_ok=True)
            for step, panel in enumerate(
                word_panels(picture, result.words, result.alphas, result.grid, result.locations)
            ):
                path = out / name / f"{step + 1:02d}.png"
                with atomic_write(path, "wb") as handle:
                    panel.save(handle, format="PNG")
                panels.append((result.words[step], path))
        entries.append(GalleryEntry(image=result.path, caption=result.caption, overlay=target, panels=tuple(panels)))
        output.caption(result, target)
    if not single and (entries or output.failed_inputs):
        entries += [GalleryEntry(image=item.path, caption="", error=item.reason) for item in output.failed_inputs]
        print(f"gallery: {write_gallery(out, entries)}", file=sys.stderr)
    return output.close()
