"""Does self-attention over the grid help? The demo with 0 blocks, 1 absolute, 1 relative, 2 relative blocks.

    python benchmarks/self_attention_ablation.py                      # 5 cross-entropy epochs per variant
    python benchmarks/self_attention_ablation.py --epochs 11 --scst-after 5   # the full demo recipe

Each variant is trained by ``python train.py experiment=demo`` (a subprocess, seed 0, the same data and
feature cache) into ``<out>/<variant>``; a variant whose ``bundle.pt`` is already there is not retrained.
Each model then captions the validation split greedily at the image size it was trained at (96 px: a
12x12 grid) and at others (80 px: 10x10, 112 px: 14x14; the same scenes, resized), scored with BLEU-4
(nltk, as validation logs it) and attention correctness (the attention mass inside the named shape's
box). The training step (the trained CNN stage, feature norm, blocks and decoder from the cached frozen
features, loss, backward, Adam) is timed on one random demo batch, the variants interleaved so they share
the machine's load alike.

At the COCO size (``experiment=coco_soft``: ResNet-101's 14x14x2048 grid, the 512-wide decoder) it times
one block's forward and backward against the decoder's training step on cached features, random weights.
``--tiny --parts coco`` times that on the tiny demo instead: a smoke test of the timing code.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import clock
import composed
import machine
import options
import tables
from captioner.config import SelfAttentionConfig
from captioner.data.shapes import shapes_records
from captioner.evaluation.report import evaluate_split
from captioner.inference import load_model
from captioner.model.self_attention import GridSelfAttention

ROOT = Path(__file__).resolve().parents[1]
# name -> model.self_attention overrides
VARIANTS = {
    "0 blocks": {"blocks": 0},
    "1 absolute": {"blocks": 1, "positional": "absolute"},
    "1 relative": {"blocks": 1, "positional": "relative"},
    "2 relative": {"blocks": 2, "positional": "relative"},
}
TRAINED_SIZE = 96  # the demo's image size (conf/data/shapes.yaml): a 12x12 layer2 grid


def folder_name(variant: str) -> str:
    return variant.replace(" ", "_")


def variant_overrides(variant: str) -> list[str]:
    """``variant``'s ``model.self_attention`` settings as overrides."""
    return [f"model.self_attention.{key}={value}" for key, value in VARIANTS[variant].items()]


def train_command(variant: str, args: argparse.Namespace) -> list[str]:
    """The ``python train.py`` command that trains ``variant`` into its folder."""
    overrides = variant_overrides(variant)
    if args.scst_after is None:
        overrides.append("model.objective=cross_entropy")
    else:
        overrides.append(f"model.scst.after_epochs={args.scst_after}")
    return [
        sys.executable,
        "train.py",
        "experiment=demo",
        f"seed={args.seed}",
        f"trainer.max_epochs={args.epochs}",
        "test=false",
        f"hydra.run.dir={args.out / folder_name(variant)}",
        *overrides,
        *args.override,
    ]


def train_all(args: argparse.Namespace) -> dict[str, float]:
    """Train the variants without a ``bundle.pt`` yet, ``args.jobs`` at a time (the cores shared out among
    them); returns each one's wall seconds (nan: trained before)."""
    todo = [v for v in VARIANTS if not (args.out / folder_name(v) / "bundle.pt").is_file()]
    threads = str(max(1, (os.cpu_count() or 1) // args.jobs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads}
    walls = {variant: float("nan") for variant in VARIANTS}
    for first in range(0, len(todo), args.jobs):
        running = {}
        for variant in todo[first : first + args.jobs]:
            command = train_command(variant, args)
            print(f"- training {variant} ({threads} threads): {' '.join(command[1:])}", flush=True)
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            running[variant] = (process, time.perf_counter())
        for variant, (process, start) in running.items():
            if process.wait():
                raise SystemExit(f"error: training {variant} failed (see {args.out / folder_name(variant)}/train.log)")
            walls[variant] = time.perf_counter() - start
    return walls


def evaluate(variant: str, image_size: int, args: argparse.Namespace) -> tuple[float, float]:
    """Greedy BLEU-4 and attention correctness of ``variant``'s model on the validation split at ``image_size``."""
    run = args.out / folder_name(variant)
    loaded = dataclasses.replace(load_model(run / "bundle.pt"), image_size=image_size)
    records = shapes_records(ROOT / "data" / "shapes", "val")
    metrics, _ = evaluate_split(loaded, records, run / f"eval_{image_size}px", batch_size=125, coco=False)
    return metrics["bleu"]["bleu4"], metrics["attention_correctness"]["mean_mass"]


def demo_steps(args: argparse.Namespace) -> dict[str, tuple[float, int, int]]:
    """Per variant: the median training step seconds on one random demo batch from the feature cache (the trained
    CNN stage, feature norm, blocks, decoder, loss, backward, Adam), the trainable and the blocks' parameters."""
    steps, counts = {}, {}
    for variant in VARIANTS:
        size = composed.setup("demo", args, overrides=variant_overrides(variant))
        model, steps[variant], _ = composed.model_train_step(size, args, "features")
        blocks = model.self_attention.parameters() if model.self_attention is not None else []
        counts[variant] = (
            sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in blocks),
        )
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeats):  # interleaved: each variant sees the same load
        for variant, step in steps.items():
            times[variant].extend(clock.measure(step, args, warmup=1, repeats=1).runs)
    return {v: (sorted(times[v])[len(times[v]) // 2], *counts[v]) for v in VARIANTS}


def coco_costs(args: argparse.Namespace) -> list[list[object]]:
    """One block's forward+backward vs the decoder's training step at the COCO size, on cached features."""
    overrides = [f"data.batch_size={args.coco_batch}", *variant_overrides("0 blocks")]
    size = composed.setup("demo" if args.tiny else "coco_soft", args, overrides=overrides)
    _, decoder_step, _ = composed.model_train_step(size, args, "features")
    height, width, _ = composed.grid_shape(size)
    features = composed.random_grid(size, size.batch, args.device)  # (B, L, C)
    rows = []
    decoder = clock.measure(decoder_step, args, warmup=1, repeats=args.repeats).median
    rows.append(["decoder step (0 blocks)", features.shape[1], 1000 * decoder, 1.0, 0])
    for positional in ("absolute", "relative"):
        config = SelfAttentionConfig(blocks=1, positional=positional)
        block = GridSelfAttention(features.size(-1), config).to(args.device).train()
        with torch.no_grad():
            block.gamma.fill_(0.5)  # an open gate: the gradient reaches every projection

        def block_pass(block: GridSelfAttention = block) -> None:
            block.zero_grad(set_to_none=True)
            block(features, (height, width)).square().mean().backward()

        seconds = clock.measure(block_pass, args, warmup=1, repeats=args.repeats).median
        params = sum(p.numel() for p in block.parameters())
        rows.append(
            [f"1 {positional} block, forward+backward", features.shape[1], 1000 * seconds, seconds / decoder, params]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = options.make_parser(__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="trainer.max_epochs of each run (default: 5)")
    parser.add_argument(
        "--scst-after",
        type=int,
        default=None,
        help="model.scst.after_epochs: cross-entropy epochs before SCST (default: cross-entropy only; the demo: 5)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="trainings at once (default: 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "self_attention_ablation")
    parser.add_argument("--sizes", type=int, nargs="+", default=[80, 112], help="other image sizes to evaluate at")
    parser.add_argument("--coco-batch", type=int, default=8, help="images per COCO-size step (the recipe: 32)")
    parser.add_argument(
        "--parts", nargs="+", choices=("demo", "coco"), default=["demo", "coco"], help="what to run (default: both)"
    )
    parser.add_argument("override", nargs="*", help="more train.py overrides for every variant")
    args = options.parse(parser, argv)
    args.out = args.out.resolve()
    recipe = "cross-entropy only" if args.scst_after is None else f"{args.scst_after} cross-entropy epochs, then SCST"
    machine.print_environment(
        "Self-attention over the grid: the demo",
        args,
        [
            f"python train.py experiment=demo seed={args.seed} trainer.max_epochs={args.epochs} ({recipe})",
            f"runs in {args.out}",
        ],
    )
    with machine.timed_section():
        if "demo" in args.parts:
            demo_table(args)
        if "coco" in args.parts:
            costs = coco_costs(args)
            name = "the tiny demo" if args.tiny else "COCO size (experiment=coco_soft, 14x14x2048 grid)"
            tables.print_table(
                f"{name}, {args.coco_batch} images x 5 captions, {args.device.type}",
                ["what", "L", "ms", "vs decoder step", "params"],
                costs,
            )


def demo_table(args: argparse.Namespace) -> None:
    """Train what is missing, evaluate at every size, time the steps; print the table."""
    walls = train_all(args)
    grids = {size: size // 8 for size in [TRAINED_SIZE, *args.sizes]}  # resnet18 layer2: stride 8
    scores = {(v, s): evaluate(v, s, args) for v in VARIANTS for s in grids}
    steps = demo_steps(args)
    columns = ["variant", "params (blocks)"]
    for cells in grids.values():
        columns += [f"BLEU-4 {cells}x{cells}", f"att. corr. {cells}x{cells}"]
    columns += ["step ms", "step vs 0 blocks", "train wall s"]
    rows = []
    for variant in VARIANTS:
        seconds, trainable, blocks = steps[variant]
        row: list[object] = [variant, f"{trainable:,} ({blocks:,})"]
        for size in grids:
            row += list(scores[(variant, size)])
        row += [1000 * seconds, seconds / steps["0 blocks"][0], walls[variant]]
        rows.append(row)
    tables.print_table(f"demo, trained at {TRAINED_SIZE} px (12x12), validation split, greedy", columns, rows)


if __name__ == "__main__":
    main()
