"""Self-critical training step and its reward: the share of a step that CIDEr-D takes, demo and COCO sizes.

A step is what SCST training runs per batch of cached features (``CaptionerModule.self_critical_terms``):
the grid normalisation, k = 5 captions sampled per image for the whole batch at once, CIDEr-D of each
against its image's references (and the greedy captions' for the greedy baseline), the self-critical
loss, backward and Adam. The reward is timed inside the step. The references are random captions in
the size of the dataset's training split (demo: 3,000 images over the demo's vocabulary; COCO: 113,287
Karpathy training images over a Zipf-distributed vocabulary), five per image; "table s" is the one-off
build of their CIDEr-D tables (document frequencies and reference vectors). Models have random weights
and never emit <end>, so every caption runs ``max_len`` words: the most work for both the rollout and
the reward. The modules are the ``coco_soft``/``coco_hard`` experiments' and the demo's with
``model.objective=scst``, built as ``train.py`` builds them.

    python benchmarks/scst_step.py                   # CPU: --quick by default (COCO batch of 8 images)
    python benchmarks/scst_step.py --device cuda
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import clock
import composed
import machine
import options
import tables
from captioner.data.vocab import SPECIALS, Vocabulary
from captioner.evaluation.cider import CiderD
from captioner.training.module import CaptionerModule

COLUMNS = [
    "size",
    "attention",
    "baseline",
    "images x samples",
    "corpus images",
    "table s",
    "ms/step",
    "max/min",
    "reward ms",
    "reward %",
    *clock.FLOP_COLUMNS,
    "others %",
]
SAMPLES = 5
REFERENCE_LENGTH = (8, 16)  # words per random reference caption, inclusive range
KARPATHY_TRAIN = 113_287  # COCO's training images with Karpathy's splits (restval included)


@dataclass
class Stopwatch:
    """Wall-clock seconds spent inside the wrapped function (the device synchronised around each call)."""

    device: torch.device
    seconds: float = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            clock.synchronize(self.device)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            clock.synchronize(self.device)
            self.seconds += time.perf_counter() - start
            return result

        return timed


def random_references(images: int, vocab: Vocabulary, seed: int = 0) -> list[list[list[str]]]:
    """Five random captions per image over the vocabulary's words, the frequent ones likelier (Zipf)."""
    generator = torch.Generator().manual_seed(seed)
    words = vocab.itos[len(SPECIALS) :]
    weights = 1.0 / torch.arange(1, len(words) + 1, dtype=torch.float64)
    low, high = REFERENCE_LENGTH
    lengths = torch.randint(low, high + 1, (images * 5,), generator=generator)
    drawn = torch.multinomial(weights, int(lengths.sum()), replacement=True, generator=generator).tolist()
    captions, start = [], 0
    for length in lengths.tolist():
        captions.append([words[i] for i in drawn[start : start + length]])
        start += length
    return [captions[i : i + 5] for i in range(0, len(captions), 5)]


def corpus_images(size: composed.Setup) -> int:
    """The experiment's training images: the shapes source's ``n_train``, or COCO's Karpathy train."""
    return size.cfg["data"]["source"].get("n_train", KARPATHY_TRAIN)


def build_module(name: str, attention: str, baseline: str, args: argparse.Namespace) -> CaptionerModule:
    """The training module of experiment ``name`` with the SCST objective (no trainer: its step is called
    directly), in train mode, never ending a caption."""
    overrides = ["model.objective=scst", f"model.scst.samples={SAMPLES}", f"model.scst.baseline={baseline}"]
    module = composed.build_module(composed.setup(name, args, attention, overrides), args)
    composed.never_end(module.model)
    return module.train()


def row(
    size: composed.Setup, baseline: str, cider: CiderD, build_seconds: float, args: argparse.Namespace
) -> list[object]:
    """Time the SCST step of one configuration (a training batch of ``size``) and the reward inside it."""
    mode, images = size.model.attention.value, size.batch
    module = build_module("demo" if args.tiny else size.name, mode, baseline, args)
    stopwatch = Stopwatch(args.device)
    cider.score_ids = stopwatch.wrap(CiderD.score_ids.__get__(cider))
    module.cider = cider
    batch = {
        "features": composed.random_features(module.model, size, images, args.device),
        "indices": torch.randint(0, len(cider), (images,), device=args.device),
    }
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        with composed.autocast(args):
            loss = module.self_critical_terms(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    flops = clock.count_flops(step)
    for _ in range(args.warmup):
        step()
    stopwatch.seconds = 0.0
    with machine.OtherLoad() as others:
        timing = clock.measure(step, args, warmup=0)
    reward = stopwatch.seconds / args.repeats
    return [
        size.name,
        mode,
        baseline,
        f"{images} x {SAMPLES}",
        len(cider),
        build_seconds,
        timing.median * 1e3,
        timing.spread,
        reward * 1e3,
        100 * reward / timing.median,
        *clock.flop_cells(flops, timing.median, args),
        others.percent,
    ]


def main(argv: list[str] | None = None) -> None:
    """Print the SCST step table."""
    args = options.parse(options.make_parser(__doc__.split("\n")[0]), argv)
    soft, hard = composed.setups(args, "soft"), composed.setups(args, "hard")
    machine.print_environment(
        "SCST step",
        args,
        [size.describe() for size in soft]
        + [
            f"{SAMPLES} captions sampled per image, each as long as the size's captions (it never ends early)",
            "'reward %': CIDEr-D's share of the step's wall time; 'max/min': slowest / fastest timed step; "
            "'others %': share of the cores other processes kept busy (above ~10 % the row is slowed)",
        ],
    )
    with machine.timed_section():
        rows = []
        for pair in zip(soft, hard):
            vocab = pair[0].vocab
            references = random_references(corpus_images(pair[0]), vocab)
            start = time.perf_counter()
            cider = CiderD(references, words=vocab.itos, device=args.device)
            clock.synchronize(args.device)
            build_seconds = time.perf_counter() - start
            for size in pair:
                for baseline in ("mean", "greedy"):
                    rows.append(row(size, baseline, cider, build_seconds, args))
        tables.print_table("SCST step: rollout + CIDEr-D reward + self-critical loss + backward + Adam", COLUMNS, rows)


if __name__ == "__main__":
    main()
