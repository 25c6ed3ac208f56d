"""The decoder-only training step with the additive attention's read eager and fused (``model.fused_attention``:
scores, softmax and context compiled by inductor): pairs/s, the first call's seconds (the compilation, and on CUDA
the graph's capture), then the profile of each read's step, its top operators (on a GPU, kernels) by self time.

The step is train_step.py's decoder-only step (grid features in memory, 5 captions per image read as training reads
them, the experiment's loss, backward, Adam) for the COCO recipe (``experiment=coco_soft``, 64 images x 320 captions,
the size of the GPU targets; under --quick its training batch) and the demo (64 images). On CUDA each read runs
eagerly and as training runs it there, one CUDA graph per step (``model.graphs``), the fused read inside the capture.

    python benchmarks/fused_attention.py                                  # CPU: --quick by default
    python benchmarks/fused_attention.py --device cuda --precision bf16 --rows 12
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from profile_ops import profile_table
from train_step import decoder_batch

import clock
import composed
import machine
import options
import peak
import tables

COLUMNS = ["size", "read", "step", "images x captions", "first call s", "ms/step", "max/min", "pairs/s"]
COLUMNS += ["vs eager read", "peak MiB"]
READS = {False: "eager", True: "fused"}
STEPS = {False: "eager", True: "CUDA graph"}


def decoder_step(size: composed.Setup, images: int, graphs: bool, args: argparse.Namespace) -> Callable[[], None]:
    """The decoder-only training step of ``size`` on ``images`` images' random grids (``graphs``: one replay)."""
    module = composed.build_module(size, args)
    decoder = module.model.decoder
    features = composed.random_grid(size, images, args.device)  # (B, L, C)
    forward, batch = composed.decoder_training(decoder, features, *composed.random_captions(size, images, args.device))
    return composed.make_train_step(module, decoder, forward, batch, args, graphs)


def row(size: composed.Setup, fused: bool, graphs: bool, args: argparse.Namespace) -> tuple[list[object], float]:
    """Time one read and step kind of ``size``: the row, and its seconds per step. The fused read compiles from
    scratch in its first call (dynamo's cache emptied), so that "first call s" is that compilation's."""
    images = decoder_batch(size, args)
    torch._dynamo.reset()
    step = decoder_step(size, images, graphs, args)
    clock.synchronize(args.device)
    start = time.perf_counter()
    step()
    clock.synchronize(args.device)
    first = time.perf_counter() - start
    with peak.PeakMemory(args.device) as memory:
        timing = clock.measure(step, args)
    seconds, pairs = timing.median, images * 5
    cells = [first, seconds * 1e3, timing.spread, pairs / seconds]
    return [size.name, READS[fused], STEPS[graphs], f"{images} x {pairs}", *cells, "", memory.peak_mib], seconds


def main(argv: list[str] | None = None) -> None:
    """Print the eager-against-fused table, then the two profiles of the first size."""
    parser = options.make_parser(__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=12, help="operators per profile table (default: 12)")
    args = options.parse(parser, argv)
    cuda = args.device.type == "cuda"
    experiments = ["demo"] if args.tiny else composed.EXPERIMENTS["soft"]
    sizes = {fused: [composed.setup(name, args, "soft", overrides(fused)) for name in experiments] for fused in READS}
    machine.print_environment(
        "Fused attention",
        args,
        [size.describe() for size in sizes[False]]
        + [
            "'read': the additive attention eager, or fused (model.fused_attention=true); 'step': eager, or "
            "'CUDA graph' (model.graphs, CUDA only); 'first call s': the step's first call, the fused read's "
            "compilation (and the graph's capture) included; 'vs eager read': the eager read's ms/step over this "
            "row's, same step kind"
        ],
    )
    with machine.timed_section():
        table = []
        for index in range(len(sizes[False])):
            for graphs in (False, True) if cuda else (False,):
                eager, eager_s = row(sizes[False][index], False, graphs, args)
                fused, fused_s = row(sizes[True][index], True, graphs, args)
                fused[COLUMNS.index("vs eager read")] = eager_s / fused_s
                table += [eager, fused]
        tables.print_table("Decoder-only training step, the attention read eager and fused", COLUMNS, table)
        args.repeats = 1  # one profiled run of each
        # FLOPs counted on the eager read's eager step: the same matrix products, and a counter cannot see into
        # a compiled call or a replay
        flops = clock.count_flops(decoder_step(sizes[False][0], decoder_batch(sizes[False][0], args), False, args))
        for fused in READS:
            size = sizes[fused][0]
            images = decoder_batch(size, args)
            step = decoder_step(size, images, cuda, args)
            label = f"decoder-only training step, {READS[fused]} read, {STEPS[cuda]}, {size.name}, {images} images"
            profile_table(label, step, flops, args)


def overrides(fused: bool) -> list[str]:
    """The config overrides of a read: the fused one sets ``model.fused_attention``."""
    return [f"model.fused_attention={str(fused).lower()}"]


if __name__ == "__main__":
    main()
