"""``captioner splits``: write Karpathy's split file of COCO or Flickr8k from the official annotation files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from captioner.cli import options
from captioner.data import split_files
from captioner.errors import ConfigError


def default_out(dataset: str) -> str:
    """Where the dataset configs look for the split file (``conf/data``, relative to the checkout)."""
    return f"data/karpathy/dataset_{dataset}.json"


def run(args: argparse.Namespace) -> int:
    """Build the split file from ``--captions-dir`` and write it to ``--out``; print its sizes on stderr."""
    out = Path(args.out or default_out(args.dataset))
    options.refuse_overwrite(out, args)
    if args.partial and args.dataset != "coco":
        raise ConfigError("--partial goes with coco (a subset of the COCO 2014 images)")
    if args.dataset == "coco":
        split = split_files.coco_split(args.captions_dir, partial=args.partial)
    else:
        split = split_files.flickr8k_split(args.captions_dir)
    split_files.write_split(split, out)
    options.record_written(out)
    sizes = ", ".join(f"{name} {count:,}" for name, count in split_files.split_sizes(split).items())
    print(f"wrote {out}: {len(split['images']):,} images ({sizes})", file=sys.stderr)
    return 0
