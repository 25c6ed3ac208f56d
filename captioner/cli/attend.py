"""``captioner attend``: caption images and draw the attention of every word, one PNG per image."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from captioner.cli import options
from captioner.cli.caption import captioned
from captioner.cli.inputs import IMAGE_SUFFIXES, expand_inputs
from captioner.cli.output import Output
from captioner.data.images import load_rgb
from captioner.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    """Caption images and draw one attention panel per word; for a folder ``--out``, also a gallery page.

    Prints ``path<TAB>caption<TAB>overlay`` per image and a summary line on stderr.
    """
    from captioner.viz.gallery import GalleryEntry, write_gallery
    from captioner.viz.overlay import draw_overlay

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
    output = Output()
    entries = []
    for result in captioned(args, found, output, decode, device):
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
        output.caption(result, target)
    if not single and entries:
        print(f"gallery: {write_gallery(out, entries)}", file=sys.stderr)
    return output.close()
