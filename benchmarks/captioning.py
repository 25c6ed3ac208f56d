"""Captioning throughput: the encoder alone, then encoder + greedy, beam 3 and beam 5, each as a ratio of
the encoder alone (1.0: decoding is free); then beam search against the batch size.

``Captioner.generate`` is ``encode`` followed by ``generate_from_features``: the table times the two
parts separately (the total is their sum) and checks the sum against one real ``generate`` call.
The models are the ``coco_soft`` experiment's and the demo's; they never emit <end> (``composed.never_end``), so
every caption runs the experiment's full ``model.decoding.max_len`` words: the worst case, and the same work
at every batch size.

    python benchmarks/captioning.py                      # CPU: --quick by default
    python benchmarks/captioning.py --device cuda --precision bf16 --channels-last
"""

from __future__ import annotations

import argparse

import torch

import clock
import composed
import counters
import machine
import options
import tables
from captioner.config import DecodingConfig

METHODS = (("greedy", "greedy", 1), ("beam 3", "beam", 3), ("beam 5", "beam", 5))
THROUGHPUT_COLUMNS = [
    "size",
    "batch",
    "pipeline",
    "encoder ms",
    "decode ms",
    "ms/batch",
    "max/min",
    "images/s",
    "vs encoder alone",
    "words",
    "CNN images",
    *clock.FLOP_COLUMNS,
    "others %",
]
BEAM_COLUMNS = [
    "size",
    "beam",
    "batch",
    "ms/call",
    "max/min",
    "ms/image",
    "words",
    "torch calls/call",
    "host reads/call",
    *clock.FLOP_COLUMNS,
    "others %",
]
BEAM_BATCHES = (1, 8, 32, 128)


def throughput_rows(size: composed.Setup, args: argparse.Namespace) -> list[list[object]]:
    """Encoder alone, encoder + each decoding method, and one end-to-end ``generate`` call as a check.

    "max/min" is the spread of the part the row times itself (the encoder, or the decoding).
    """
    model = composed.never_end(composed.build_module(size, args).model.eval())
    batch = size.caption_batch
    images = composed.random_images(size, batch, args.device)
    encoded: list[tuple[torch.Tensor, tuple[int, int]]] = []

    def encode() -> None:
        with torch.no_grad(), composed.autocast(args):
            encoded[:] = [model.encode(images)]

    encoder_flops = clock.count_flops(encode)
    with counters.EncoderCounter(model) as counter, machine.OtherLoad() as others:
        encoder = clock.measure(encode, args)
    features, grid = encoded[0]
    cnn_images = counter.images / (args.warmup + args.repeats)
    encoder_s = encoder.median
    rows = [
        [
            size.name,
            batch,
            "encoder alone",
            encoder_s * 1e3,
            0.0,
            encoder_s * 1e3,
            encoder.spread,
            batch / encoder_s,
            1.0,
            "-",
            cnn_images,
            *clock.flop_cells(encoder_flops, encoder_s, args),
            others.percent,
        ]
    ]
    words: dict[str, int] = {}
    for label, method, beam in METHODS:

        def decode() -> None:
            with composed.autocast(args):
                settings = DecodingConfig(method=method, beam_size=beam, max_len=size.decode_len)
                generation, _ = model.generate_from_features(features, grid, settings)
            words[label] = generation.tokens.size(1)

        with composed.eager_decoding(model):
            decode_flops = clock.count_flops(decode)
        with machine.OtherLoad() as others:
            decoding = clock.measure(decode, args)
        total = encoder_s + decoding.median
        rows.append(
            [
                size.name,
                batch,
                f"encoder + {label}",
                encoder_s * 1e3,
                decoding.median * 1e3,
                total * 1e3,
                decoding.spread,
                batch / total,
                encoder_s / total,
                words[label],
                cnn_images,
                *clock.flop_cells(encoder_flops + decode_flops, total, args),
                others.percent,
            ]
        )
    with counters.EncoderCounter(model) as counter, machine.OtherLoad() as others, composed.autocast(args):
        total = clock.measure(
            lambda: model.generate(images, DecodingConfig(method="beam", beam_size=3, max_len=size.decode_len)),
            args,
            warmup=0,
            repeats=1,
        ).median
    rows.append(
        [
            size.name,
            batch,
            "Captioner.generate(beam 3), one call",
            "-",
            "-",
            total * 1e3,
            "-",
            batch / total,
            encoder_s / total,
            "-",
            counter.images,
            "-",
            "-",
            "-",
            others.percent,
        ]
    )
    return rows


def beam_rows(
    size: composed.Setup, batches: tuple[int, ...], args: argparse.Namespace, beam: int = 3
) -> list[list[object]]:
    """Beam search from features for each batch size; the untimed warm-up call counts torch calls and host reads."""
    model = composed.never_end(composed.build_module(size, args).model.eval())
    rows = []
    for batch in batches:
        features = composed.random_features(model, size, batch, args.device)

        def search() -> torch.Tensor:
            with composed.autocast(args):
                settings = DecodingConfig(method="beam", beam_size=beam, max_len=size.decode_len)
                generation, _ = model.generate_from_features(features, decoding=settings)
            return generation.tokens

        search()  # on CUDA the capture of the call's graph: the counts below are a replayed call's
        with counters.OpCounter() as ops:
            words = search().size(1)
        with composed.eager_decoding(model):
            flops = clock.count_flops(search)
        with machine.OtherLoad() as others:
            timing = clock.measure(search, args, warmup=max(args.warmup - 1, 0))
        rows.append(
            [
                size.name,
                beam,
                batch,
                timing.median * 1e3,
                timing.spread,
                timing.median * 1e3 / batch,
                words,
                ops.calls,
                ops.host_reads,
                *clock.flop_cells(flops, timing.median, args),
                others.percent,
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the captioning-throughput table and the beam-search batching table."""
    args = options.parse(options.make_parser(__doc__.split("\n")[0]), argv)
    sizes = composed.setups(args)
    machine.print_environment(
        "Captioning",
        args,
        [size.describe() for size in sizes]
        + [
            "max_len = the experiment's model.decoding.max_len; <end> is never emitted, so 'words' (steps decoded) "
            "= max_len",
            "'vs encoder alone' = encoder time / (encoder + decode time); 'CNN images' = images entering the CNN "
            "per batch (a hook on its first stage)",
            "'encoder ms' times Captioner.encode, the encoder's frozen part (what the feature cache holds); the "
            "stages an experiment trains (the demo's layer2) run in 'decode ms', from the features",
            "'host reads/call' = values read back to the host (bool(t), t.item(), ...: GPU syncs); counts that do "
            "not grow with the batch mean no per-image Python loop",
            "'max/min': slowest / fastest timed run of what the row times; 'others %': share of the cores other "
            "processes kept busy meanwhile (/proc/stat), above ~10 % the row is slowed by contention",
        ],
    )
    with machine.timed_section():
        rows = [row for size in sizes for row in throughput_rows(size, args)]
        tables.print_table("Captioning throughput (images to captions)", THROUGHPUT_COLUMNS, rows)
        batches = (1, 2) if args.tiny else BEAM_BATCHES
        rows = [row for size in sizes for row in beam_rows(size, batches, args)]
        tables.print_table("Beam search (beam 3) from features against the batch size", BEAM_COLUMNS, rows)


if __name__ == "__main__":
    main()
