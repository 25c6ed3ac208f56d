"""The operators that compute in one beam-search call at batch 1 (beam 3, the experiment's full caption length):
on a GPU each is a kernel, replayed inside the call's CUDA graph, so their number per word is what bounds beam 3 at
batch 1 there (docs/gpu_report.md: ~1,900 kernels, 5.3 ms on an H100). Counted on any device, views left out
(``counters.KernelCounter``); the demo's and ``coco_soft``'s models, which never emit <end> (``composed.never_end``).

    python benchmarks/beam_kernels.py                 # CPU: the counts are the GPU's, without timing
    python benchmarks/beam_kernels.py --top 20        # the 20 commonest operators per word
"""

from __future__ import annotations

import argparse

import torch

import composed
import counters
import machine
import options
import tables
from captioner.config import DecodingConfig


def kernel_rows(size: composed.Setup, args: argparse.Namespace, beam: int) -> tuple[list[object], counters.Counter]:
    """One row of the table for ``size`` and the counts by operator of one beam-search call."""
    model = composed.never_end(composed.build_module(size, args).model.eval())
    features = composed.random_features(model, size, 1, args.device)
    settings = DecodingConfig(method="beam", beam_size=beam, max_len=size.decode_len)
    with torch.no_grad():
        model.generate_from_features(features, decoding=settings)  # on CUDA: the capture; counted below: a call
        with counters.KernelCounter() as counted:
            words = model.generate_from_features(features, decoding=settings)[0].tokens.size(1)
    total = sum(counted.kernels.values())
    return [size.name, beam, words, total, total / words], counted.kernels


def main(argv: list[str] | None = None) -> None:
    """Print the kernels of a beam-search call per size, then the commonest operators per word."""
    parser = options.make_parser(__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=12, help="operators listed per size (default: 12)")
    parser.add_argument("--beam", type=int, default=3, help="beam width (default: 3)")
    args = options.parse(parser, argv)
    sizes = composed.setups(args)
    machine.print_environment(
        "Beam-search kernels",
        args,
        [size.describe() for size in sizes]
        + ["'kernels': aten operators that compute (views left out), each a kernel of the call's CUDA graph on a GPU"],
    )
    with machine.timed_section():
        rows, by_size = [], {}
        for size in sizes:
            row, kernels = kernel_rows(size, args, args.beam)
            rows.append(row)
            by_size[size.name] = (kernels, row[2])
        tables.print_table(
            f"Beam search (beam {args.beam}), batch 1: operators that compute (a GPU kernel each)",
            ["size", "beam", "words", "kernels/call", "kernels/word"],
            rows,
        )
        for name, (kernels, words) in by_size.items():
            top = [[op, count, count / words] for op, count in kernels.most_common(args.top)]
            title = f"{name}: the {args.top} commonest operators"
            tables.print_table(title, ["operator", "per call", "per word"], top)


if __name__ == "__main__":
    main()
