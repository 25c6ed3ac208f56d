"""``captioner shapes``: generate the built-in shapes dataset, of a chosen size, into a chosen folder."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from captioner.config import SceneKind, ShapesSpec
from captioner.data.shapes import META, generate_shapes
from captioner.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    """Generate the dataset (a no-op when ``--out`` already holds the same one); print what is there and the
    ``train.py`` overrides that train on it."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ShapesSpec) if getattr(args, f.name) is not None}
    try:
        spec = ShapesSpec(**given)
    except ConfigError as exc:
        flags = {"n_train": "--train", "n_val": "--val", "n_test": "--test", "image_size": "--image-size"}
        flags |= {"scenes": "--scenes", "width": "--width", "height": "--height"}
        message = str(exc)
        for name, flag in flags.items():
            message = message.replace(name, flag)
        raise ConfigError(message.replace("seed", "--seed")) from None
    existed = (Path(args.out) / META).is_file()
    generate_shapes(args.out, spec)
    if spec.scenes is SceneKind.simple:
        changed = [f"data.source.{k}={v}" for k, v in dataclasses.asdict(spec).items() if v != getattr(ShapesSpec, k)]
        what, overrides = f"{spec.image_size} px", [f"data.source.root={args.out}", *changed]
    else:  # every parameter: conf/data/scenes.yaml's differ from ShapesSpec's defaults
        given = [f"data.source.{k}={v}" for k, v in spec.params().items() if k != "scenes"]
        what = f"{spec.width}x{spec.height} px cluttered scenes"
        overrides = ["experiment=scenes", f"data.source.root={args.out}", *given]
    print(
        f"{args.out}: {'already there' if existed else 'generated'}, {spec.n_train:,} train, {spec.n_val:,} val and "
        f"{spec.n_test:,} test images of {what} (seed {spec.seed}); train on it with: "
        f"python train.py {' '.join(overrides)}",
        file=sys.stderr,
    )
    return 0
