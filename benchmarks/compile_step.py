"""The decoder's step compiled (``model.compile``) against eager: compile seconds, step times and graphs.

At the demo's size (``python train.py``, and ``model=hard``) on cached-size features: the decoder-only training
step (forward over the longest captions, the experiment's loss, backward, Adam), then greedy and beam 3 decoding
of ``model.decoding.max_len`` words with static shapes. "first s" is the first compiled call (compilation
included) in wall seconds and in CPU seconds of this process and its compiler children; "graphs" counts the
graphs dynamo compiled for the row, after five training batches of other caption lengths.

    python benchmarks/compile_step.py                                   # CPU: model.compile=default
    python benchmarks/compile_step.py --device cuda --precision bf16    # CUDA: reduce-overhead
"""

from __future__ import annotations

import argparse
import copy
import resource
import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

import clock
import composed
import machine
import options
import tables
from captioner.config import Compile, DecodingConfig
from captioner.model.decoding import Generation, decode

COLUMNS = ["size", "attention", "work", "compile", "first s", "first CPU s", "eager ms", "compiled ms", "speed-up"]
COLUMNS += ["graphs"]
IMAGES = 32  # the demo's training batch, and captioning's


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler runs as one)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def compare(
    eager: Callable[[], object], compiled: Callable[[], object], args: argparse.Namespace
) -> tuple[float, float, float, float]:
    """First compiled call (wall s, CPU s), then the eager and compiled medians (s)."""
    clock.synchronize(args.device)
    start, cpu = time.perf_counter(), cpu_seconds()
    compiled()
    clock.synchronize(args.device)
    first, first_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return first, first_cpu, clock.measure(eager, args).median, clock.measure(compiled, args).median


def rows(size: composed.Setup, mode: Compile, args: argparse.Namespace) -> list[list[object]]:
    """The training step and the two decodings of ``size``, eager against ``mode``."""
    module = composed.build_module(size, args)
    eager = module.model.decoder
    compiled = copy.deepcopy(eager)
    compiled.compile_step(mode)
    features = composed.random_grid(size, IMAGES, args.device)  # (B, L, C)
    captions, index = composed.random_captions(size, IMAGES, args.device)

    def train(decoder: torch.nn.Module) -> Callable[[], None]:
        return composed.make_train_step(
            module, decoder, *composed.decoder_training(decoder, features, captions, index), args
        )

    head = [size.name, size.model.attention.value]
    graphs = counters["stats"]["unique_graphs"]
    first, first_cpu, eager_s, compiled_s = compare(train(eager), train(compiled), args)
    for words in (3, 7, 11, 15):  # other caption lengths: no new graph
        short = captions[:, : words + 1]
        with composed.autocast(args):
            module.criterion(compiled(features, short, index), short)["loss"].backward()
    work = f"training step, {IMAGES} x {captions.size(0)}"
    table = [[*head, work, mode.value, first, first_cpu, eager_s * 1e3, compiled_s * 1e3, eager_s / compiled_s]]
    table[-1].append(counters["stats"]["unique_graphs"] - graphs)
    composed.never_end(module.model.eval())
    compiled.eval()
    for label, settings in (
        ("greedy", DecodingConfig(method="greedy", max_len=size.decode_len)),
        ("beam 3", DecodingConfig(method="beam", beam_size=3, max_len=size.decode_len)),
    ):
        graphs = counters["stats"]["unique_graphs"]

        def decode(decoder: torch.nn.Module, settings: DecodingConfig = settings) -> Callable[[], object]:
            return lambda: _decode(decoder, features, settings, args)

        first, first_cpu, eager_s, compiled_s = compare(decode(eager), decode(compiled), args)
        work = f"{label}, {IMAGES} images x {size.decode_len} words"
        cells = [first, first_cpu, eager_s * 1e3, compiled_s * 1e3, eager_s / compiled_s]
        table.append([*head, work, mode.value, *cells, counters["stats"]["unique_graphs"] - graphs])
    return table


@torch.no_grad()
def _decode(
    decoder: torch.nn.Module, features: torch.Tensor, settings: DecodingConfig, args: argparse.Namespace
) -> Generation:
    """Decode with static shapes, as on CUDA (every word computed: the same work each call)."""
    with composed.autocast(args):
        return decode(decoder, features, settings, static_shapes=True)


def main(argv: list[str] | None = None) -> None:
    """Print the eager-against-compiled table."""
    parser = options.make_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--compile",
        choices=[mode.value for mode in Compile if mode != Compile.off],
        default=None,
        help="how to compile (default: reduce-overhead on CUDA, default elsewhere)",
    )
    args = options.parse(parser, argv)
    mode = Compile(args.compile or ("reduce-overhead" if args.device.type == "cuda" else "default"))
    sizes = [composed.setup("demo", args, attention) for attention in ("soft", "hard")]
    machine.print_environment("Compiled decoder step", args, [size.describe() for size in sizes])
    with machine.timed_section():
        table = [row for size in sizes for row in rows(size, mode, args)]
        tables.print_table("The decoder's step compiled against eager", COLUMNS, table)


if __name__ == "__main__":
    main()
