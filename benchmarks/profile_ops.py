"""torch.profiler tables of one training step (soft attention, from images), one decoder-only training step (64
images x 320 captions from grid features) and one beam-search call (beam 3, from features) of the ``coco_soft``
experiment: the operators (on a GPU, the kernels) that take the most time, by self time. On CUDA the steps and the
search run as training and captioning run them there: replays of CUDA graphs (``model.graphs``); their FLOPs are
counted on the same work run eagerly.

    python benchmarks/profile_ops.py                         # CPU: --quick by default (COCO training batch of 8)
    python benchmarks/profile_ops.py --device cuda --precision bf16 --channels-last --rows 25
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile, record_function

import clock
import composed
import machine
import options
from captioner.config import DecodingConfig

DECODER_BATCH = 64  # images of the decoder-only step on a GPU (x 5 captions): the size the GPU targets name


def profile_table(label: str, fn: Callable[[], object], flops: int, args: argparse.Namespace) -> None:
    """Run ``fn`` ``args.warmup`` times (and once more), then once under the profiler, and print its top operators,
    its ``flops`` and their rate over the profiled run's wall time."""
    for _ in range(args.warmup + 1):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.type == "cuda" else [])
    clock.synchronize(args.device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        with record_function(label):
            fn()
        clock.synchronize(args.device)
    gflop, rate, share = clock.flop_cells(flops, time.perf_counter() - start, args)
    sort_by = "self_device_time_total" if args.device.type == "cuda" else "self_cpu_time_total"
    print(f"\n### {label} (sorted by {sort_by})\n")
    print(f"{gflop:.3g} GFLOP at {rate:.3g} GFLOP/s over the profiled run, {share:.3g} % of the matmul probe\n")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=40))


def main(argv: list[str] | None = None) -> None:
    """Profile the training step, then beam search."""
    parser = options.make_parser(__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=15, help="operators per table (default: 15)")
    args = options.parse(parser, argv)
    args.repeats = 1  # one profiled run of each
    size = composed.setups(args)[0]
    machine.print_environment("Profile", args, [size.describe()])
    graphs = args.device.type == "cuda"  # as training and captioning run there
    with machine.timed_section():
        model, step, pairs = composed.model_train_step(size, args, "images", graphs)
        flops = clock.count_flops(composed.model_train_step(size, args, "images")[1] if graphs else step)
        profile_table(f"training step, soft, {size.batch} images x {pairs} captions", step, flops, args)
        module = composed.build_module(size, args)
        decoder = module.model.decoder
        images = size.batch if args.tiny or args.quick else DECODER_BATCH
        grid = composed.random_grid(size, images, args.device)  # (B, L, C)
        forward, batch = composed.decoder_training(decoder, grid, *composed.random_captions(size, images, args.device))
        decoder_step = composed.make_train_step(module, decoder, forward, batch, args, graphs)
        eager = composed.make_train_step(module, decoder, forward, batch, args) if graphs else decoder_step
        flops = clock.count_flops(eager)  # a replay dispatches nothing to count
        label = f"decoder-only training step, soft, {images} images x {batch['captions'].size(0)} captions"
        profile_table(label, decoder_step, flops, args)
        composed.never_end(model.eval())
        features = composed.random_features(model, size, size.caption_batch, args.device)

        settings = DecodingConfig(method="beam", beam_size=3, max_len=size.decode_len)

        def search() -> None:
            with composed.autocast(args):
                model.generate_from_features(features, decoding=settings)

        with composed.eager_decoding(model):
            flops = clock.count_flops(search)
        profile_table(f"beam search, beam 3, {size.caption_batch} images from features", search, flops, args)


if __name__ == "__main__":
    main()
