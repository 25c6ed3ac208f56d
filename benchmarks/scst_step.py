"""Self-critical training step and its reward: the share of a step that CIDEr-D takes, demo and COCO sizes.

A step is what SCST training runs per batch of cached features (``CaptionerModule.self_critical_terms``):
the grid normalisation, k = 5 captions sampled per image for the whole batch at once, CIDEr-D of each
against its image's references (and the greedy captions' for the greedy baseline), the self-critical
loss, backward and Adam. The reward is timed inside the step. The references are random captions in
the size of the dataset's training split (demo: 3,000 images over the demo's vocabulary; COCO: 113,287
Karpathy training images over a Zipf-distributed vocabulary), five per image; "table s" is the one-off
build of their CIDEr-D tables (document frequencies and reference vectors). Models have random weights
and never emit <end>, so every caption runs ``max_len`` words: the most work for both the rollout and
the reward.

    python benchmarks/scst_step.py                   # CPU: --quick by default (COCO batch of 8 images)
    python benchmarks/scst_step.py --device cuda
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import common
from captioner.data.shapes import ShapesSpec
from captioner.data.vocab import Vocabulary
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
    "others %",
]
SAMPLES = 5
REFERENCE_LENGTH = (8, 16)  # words per random reference caption, inclusive range
CORPUS = {"demo": ShapesSpec().n_train, "coco": 113_287, "tiny": 50}  # training images


@dataclass
class Stopwatch:
    """Wall-clock seconds spent inside the wrapped function (the device synchronised around each call)."""

    device: torch.device
    seconds: float = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            common.synchronize(self.device)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            common.synchronize(self.device)
            self.seconds += time.perf_counter() - start
            return result

        return timed


def vocabulary(size: common.Size) -> Vocabulary:
    """``size.vocab_size`` ids: the four specials and words w4, w5, ..."""
    return Vocabulary([f"w{i}" for i in range(len(Vocabulary.SPECIALS), size.vocab_size)])


def random_references(images: int, vocab: Vocabulary, seed: int = 0) -> list[list[list[str]]]:
    """Five random captions per image over the vocabulary's words, the frequent ones likelier (Zipf)."""
    generator = torch.Generator().manual_seed(seed)
    words = vocab.itos[len(Vocabulary.SPECIALS) :]
    weights = 1.0 / torch.arange(1, len(words) + 1, dtype=torch.float64)
    low, high = REFERENCE_LENGTH
    lengths = torch.randint(low, high + 1, (images * 5,), generator=generator)
    drawn = torch.multinomial(weights, int(lengths.sum()), replacement=True, generator=generator).tolist()
    captions, start = [], 0
    for length in lengths.tolist():
        captions.append([words[i] for i in drawn[start : start + length]])
        start += length
    return [captions[i : i + 5] for i in range(0, len(captions), 5)]


def build_module(size: common.Size, mode: str, baseline: str, args: argparse.Namespace) -> CaptionerModule:
    """The training module of ``size`` with the SCST objective (no trainer: its step is called directly)."""
    module = CaptionerModule(
        vocabulary(size),
        attention=mode,
        encoder={"name": size.encoder, "weights": None, "stage": None, "grid": size.grid, "trainable_stages": 0},
        feature_norm=True,
        decoder={
            "embed_dim": size.embed_dim,
            "hidden_dim": size.hidden_dim,
            "attention_dim": size.attention_dim,
            "dropout": size.dropout,
        },
        decoding={"max_len": size.steps},
        objective="scst",
        scst={"samples": SAMPLES, "baseline": baseline},
    )
    common.never_end(module.model)
    return module.to(args.device).train()


def row(
    size: common.Size,
    mode: str,
    baseline: str,
    cider: CiderD,
    build_seconds: float,
    images: int,
    args: argparse.Namespace,
) -> list[object]:
    """Time the SCST step of one configuration and the reward inside it."""
    module = build_module(size, mode, baseline, args)
    stopwatch = Stopwatch(args.device)
    cider.score_ids = stopwatch.wrap(CiderD.score_ids.__get__(cider))
    module.cider = cider
    batch = {
        "features": common.random_features(size, images, args.device),
        "indices": torch.randint(0, len(cider), (images,), device=args.device),
    }
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        with common.autocast(args):
            loss = module.self_critical_terms(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    stopwatch.seconds = 0.0
    with common.OtherLoad() as others:
        timing = common.measure(step, args, warmup=0)
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
        others.percent,
    ]


def main(argv: list[str] | None = None) -> None:
    """Print the SCST step table."""
    args = common.parse(common.make_parser(__doc__.split("\n")[0]), argv)
    sizes = common.sizes(args)
    common.print_environment(
        "SCST step",
        args,
        [size.describe() for size in sizes]
        + [
            f"{SAMPLES} captions sampled per image, each as long as the size's captions (it never ends early)",
            "'reward %': CIDEr-D's share of the step's wall time; 'max/min': slowest / fastest timed step; "
            "'others %': share of the cores other processes kept busy (above ~10 % the row is slowed)",
        ],
    )
    with common.timed_section():
        rows = []
        for size in sizes:
            vocab = vocabulary(size)
            references = random_references(CORPUS[size.name], vocab)
            start = time.perf_counter()
            cider = CiderD(references, words=vocab.itos, device=args.device)
            common.synchronize(args.device)
            build_seconds = time.perf_counter() - start
            for mode in ("soft", "hard"):
                for baseline in ("mean", "greedy"):
                    rows.append(row(size, mode, baseline, cider, build_seconds, size.batch, args))
        common.print_table("SCST step: rollout + CIDEr-D reward + self-critical loss + backward + Adam", COLUMNS, rows)


if __name__ == "__main__":
    main()
