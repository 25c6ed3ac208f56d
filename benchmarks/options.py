"""The options every benchmark script takes, and their defaults that depend on the device."""

from __future__ import annotations

import argparse

import torch

from clock import MatmulRate
from composed import QUICK_BATCH


def make_parser(description: str) -> argparse.ArgumentParser:
    """The options every script takes: device, precision, channels-last, --tiny/--quick and iteration counts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32, or bf16 autocast as Lightning's bf16-mixed (default: fp32)",
    )
    parser.add_argument("--channels-last", action="store_true", help="run the CNN in channels-last memory format")
    parser.add_argument("--tiny", action="store_true", help="a tiny demo model, one iteration: a smoke test")
    parser.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"COCO training batches of {QUICK_BATCH} images instead of the recipe's 32, fewer repeats "
        "(default: on for CPU, off for GPU)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="intra-op CPU threads (default: torch's, one per core)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default: 1)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs, the median is reported (default: 2 quick, 5 otherwise)"
    )
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and resolve the defaults that depend on the device; seed torch; probe the device's matmul rate
    (``args.matmul``)."""
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.quick is None:
        args.quick = args.device.type == "cpu"
    if args.tiny:
        args.warmup, args.repeats = 0, 1
    elif args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.matmul = MatmulRate.probe(args)
    return args
