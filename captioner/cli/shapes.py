"""``captioner shapes``: generate the built-in shapes dataset, of a chosen size, into a chosen folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from captioner.cli.parser import SHAPES_OPTIONS
from captioner.config import SceneKind, ShapesSpec
from captioner.data.shapes import META, generate_shapes
from captioner.errors import ConfigError


def _spec(args: argparse.Namespace) -> ShapesSpec:
    """The ShapesSpec of the options given (ShapesSpec's defaults for the others); ConfigError naming the option
    of a bad value, or of one that the chosen scenes do not use."""
    given = {name: getattr(args, name) for name in SHAPES_OPTIONS if getattr(args, name) is not None}
    try:
        spec = ShapesSpec(**given)
    except ConfigError as exc:
        message = str(exc)
        name = next((name for name in SHAPES_OPTIONS if message.startswith(f"{name}=")), None)
        raise ConfigError(message if name is None else SHAPES_OPTIONS[name][0] + message[len(name) :]) from None
    used = [name for name in SHAPES_OPTIONS if name in spec.params() and name != "scenes"]
    unused = [SHAPES_OPTIONS[name][0] for name in given if name not in used and name != "scenes"]
    if unused:
        raise ConfigError(
            f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to the {spec.scenes} scenes "
            f"(they take {', '.join(SHAPES_OPTIONS[name][0] for name in used)})"
        )
    return spec


def run(args: argparse.Namespace) -> int:
    """Generate the dataset (a no-op when ``--out`` already holds the same one); print what is there and the
    ``train.py`` overrides that train on it."""
    spec = _spec(args)
    existed = (Path(args.out) / META).is_file()
    generate_shapes(args.out, spec)
    if spec.scenes is SceneKind.simple:
        changed = [f"data.source.{k}={v}" for k, v in spec.params().items() if v != getattr(ShapesSpec, k)]
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
