"""Training-step throughput and peak memory: soft and hard attention, from images and from cached features,
for the COCO recipes (``experiment=coco_soft``, ``coco_hard``) and the demo (``python train.py``, and with
``model=hard``), then the decoder alone given features.

A step is what training runs per batch: forward (encoder once per image, its captions gathered after
it), the experiment's loss (its ``CaptionerModule.criterion``), backward, Adam. "images, per caption" is
the ``data.per_caption=true`` layout, where every caption brings its own copy of the image, so the CNN
runs once per caption.

    python benchmarks/train_step.py                      # CPU: --quick by default
    python benchmarks/train_step.py --device cuda --precision bf16 --channels-last
"""

from __future__ import annotations

import argparse

import clock
import composed
import counters
import machine
import options
import peak
import tables

TRAIN_COLUMNS = [
    "size",
    "attention",
    "input",
    "step",
    "images x captions",
    "steps",
    "ms/step",
    "max/min",
    "images/s",
    "pairs/s",
    "Karpathy epoch s",
    "CNN images/step",
    *clock.FLOP_COLUMNS,
    "peak MiB",
    "step MiB",
    "others %",
]
DECODER_COLUMNS = [
    "size",
    "attention",
    "captions",
    "step",
    "images x captions",
    "steps",
    "ms/step",
    "max/min",
    "images/s",
    "pairs/s",
    *clock.FLOP_COLUMNS,
    "peak MiB",
    "step MiB",
    "others %",
]
DECODER_BATCH = 64
SOURCES = {"images": "images", "per_caption": "images, per caption", "features": "cached features"}
STEPS = {False: "eager", True: "CUDA graph"}  # how a row's step runs
KARPATHY_TRAIN = 113_287  # images in the Karpathy training split (restval included): an epoch's estimate


def step_row(
    size: composed.Setup, source: str, graphs: bool, args: argparse.Namespace, flops: int | None = None
) -> tuple[list[object], int]:
    """Time one configuration of the whole captioner's training step; ``source``: images, per_caption, features;
    ``graphs``: forward, loss and backward replayed as one CUDA graph (``model.graphs``). The row and its step's
    FLOPs: counted on an eager step, or the eager row's ``flops`` for a graphed one (a replay dispatches nothing
    to count, and the work is the same)."""
    model, step, pairs = composed.model_train_step(size, args, source, graphs)
    flops = clock.count_flops(step) if flops is None else flops
    with (
        peak.PeakMemory(args.device) as memory,
        counters.EncoderCounter(model) as counter,
        machine.OtherLoad() as others,
    ):
        timing = clock.measure(step, args)
    seconds = timing.median
    return [
        size.name,
        size.model.attention.value,
        SOURCES[source],
        STEPS[graphs],
        f"{size.batch} x {pairs}",
        size.steps,
        seconds * 1e3,
        timing.spread,
        size.batch / seconds,
        pairs / seconds,
        KARPATHY_TRAIN / (size.batch / seconds),
        "-" if graphs else counter.images / (args.warmup + args.repeats),  # a replay runs no hook
        *clock.flop_cells(flops, seconds, args),
        memory.peak_mib,
        memory.added_mib,
        others.percent,
    ], flops


def decoder_row(
    size: composed.Setup, images: int, gathered: bool, graphs: bool, args: argparse.Namespace, flops: int | None = None
) -> tuple[list[object], int]:
    """Time the decoder's training step alone on grid features already in memory, its captions in training's
    layout (K per image, one copy of each image's features) or ``gathered`` (the features copied to each);
    ``graphs`` and ``flops`` as ``step_row``'s."""
    module = composed.build_module(size, args)
    decoder = module.model.decoder
    features = composed.random_grid(size, images, args.device)  # (B, L, C)
    captions, index = composed.random_captions(size, images, args.device, gathered)
    forward, batch = composed.decoder_training(decoder, features, captions, index)
    step = composed.make_train_step(module, decoder, forward, batch, args, graphs)
    flops = clock.count_flops(step) if flops is None else flops
    with peak.PeakMemory(args.device) as memory, machine.OtherLoad() as others:
        timing = clock.measure(step, args)
    seconds, pairs = timing.median, captions.size(0)
    return [
        size.name,
        size.model.attention.value,
        "gathered" if gathered else "K per image",
        STEPS[graphs],
        f"{images} x {pairs}",
        size.steps,
        seconds * 1e3,
        timing.spread,
        images / seconds,
        pairs / seconds,
        *clock.flop_cells(flops, seconds, args),
        memory.peak_mib,
        memory.added_mib,
        others.percent,
    ], flops


def decoder_batch(size: composed.Setup, args: argparse.Namespace) -> int:
    """64 images, except the COCO size under --quick (its batch) and --tiny (the tiny batch)."""
    if args.tiny or (args.quick and size.name.startswith("coco")):
        return size.batch
    return DECODER_BATCH


def main(argv: list[str] | None = None) -> None:
    """Print the training-step table and the decoder-only table."""
    args = options.parse(options.make_parser(__doc__.split("\n")[0]), argv)
    soft, hard = composed.setups(args, "soft"), composed.setups(args, "hard")
    machine.print_environment(
        "Training step",
        args,
        [size.describe() for size in soft]
        + [
            "hard attention: the same sizes with model=hard (the COCO one is experiment=coco_hard)",
            f"memory: {peak.memory_method(args.device)}; 'step MiB' is the peak above the memory held before "
            "the first step (model, batch), i.e. activations, gradients and Adam state",
            "'CNN images/step' counts the images entering the encoder per step (a hook on its first stage)",
            "captions: 'K per image' is training's layout (each image's 5 captions read one copy of its features), "
            "'gathered' the features copied to each caption (batches whose images have unequal caption counts)",
            "'step': eager, or 'CUDA graph' (model.graphs, on CUDA: forward, loss and backward one replay, then "
            "fused Adam); 'Karpathy epoch s': 113,287 training images at the row's images/s",
            "'max/min': slowest / fastest timed run; 'others %': share of the cores other processes kept busy "
            "during the row (/proc/stat), above ~10 % the row is slowed by contention",
        ],
    )
    cuda = args.device.type == "cuda"  # model.graphs: CUDA only, and a graphed row after its eager twin
    with machine.timed_section():
        rows = []
        for pair in zip(soft, hard):
            for size in pair:
                for source in ("images", "features"):
                    row, flops = step_row(size, source, False, args)
                    rows += [row, step_row(size, source, True, args, flops)[0]] if cuda else [row]
            if not (args.quick and pair[0].name.startswith("coco")):  # 5x the CNN work: slow at 448 px on a CPU
                rows.append(step_row(pair[0], "per_caption", False, args)[0])
        tables.print_table("Training step: encoder + decoder + loss + backward + Adam", TRAIN_COLUMNS, rows)
        rows = []
        for size in (size for pair in zip(soft, hard) for size in pair):
            images = decoder_batch(size, args)
            row, flops = decoder_row(size, images, False, False, args)
            rows += [row, decoder_row(size, images, False, True, args, flops)[0]] if cuda else [row]
            rows.append(decoder_row(size, images, True, False, args)[0])
        tables.print_table("Decoder-only training step given features", DECODER_COLUMNS, rows)


if __name__ == "__main__":
    main()
