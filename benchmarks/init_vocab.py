"""What ``init_vocab=grow`` changes when a model is fine-tuned on captions with words it never saw: the demo's
bundle (trained on the built-in shapes) fine-tuned on the cluttered scenes (``experiment=scenes``), issue 46's case.

Two tables:

1. The share of the scenes' training words read as ``<unk>`` by the bundle's vocabulary (``init_vocab=keep``) and
   by the grown one (``init_vocab=grow``), for training splits of several sizes. The captions are generated
   without drawing an image and read as the data module reads them (``word_counts``, ``Vocabulary.grow`` and
   ``Vocabulary.unknown`` with ``experiment=scenes``' data settings).
2. A short fine-tune with each setting, run as a user runs it (``python train.py experiment=scenes
   init_from=<bundle> init_vocab=...``, the same seed): the share that run logs when training starts, its final
   validation scores (``metrics.json``: beam 3, as ``captioner evaluate`` decodes) and how many of its validation
   captions use a word the bundle lacked. The runs share the scenes' feature cache (the frozen stages are the
   bundle's either way), so the first run builds it.

    python benchmarks/init_vocab.py --bundle outputs/train/runs/<demo run>/bundle.pt
    python benchmarks/init_vocab.py --bundle <bundle> --epochs 2 --n-train 400   # a shorter fine-tune
    python benchmarks/init_vocab.py --bundle <bundle> --epochs 0                 # the shares only

Timings are not the point (the machine may be shared); the scores of so short a fine-tune are a first look, not
a converged comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
from pathlib import Path

from hydra.utils import instantiate

from captioner.bundle import load_trained
from captioner.config import DataConfig, TrainConfig, from_dict
from captioner.data.cluttered import make_cluttered_scene
from captioner.data.vocab import Vocabulary, tokenize, word_counts
from captioner.training.metrics import CIDER, PROGRESS, VAL, final, metric
from composed import compose_config
from tables import print_table
from train_process import run_train

SHARE = re.compile(r"training captions: ([\d,]+) of ([\d,]+) words \(([\d.]+)%\) read as <unk>")
SETTINGS = ("keep", "grow")


def unknown_shares(bundle: Vocabulary, sizes: list[int], data: DataConfig) -> list[list[object]]:
    """Per training split size: its words, how many (and which share) each setting reads as ``<unk>``, and the
    words ``grow`` adds (by the ``data`` settings' rule)."""
    spec = instantiate(data.source).spec
    rows = []
    for size in sizes:
        sized = dataclasses.replace(spec, n_train=size)
        counts = word_counts(c for i in range(size) for c in make_cluttered_scene(sized, "train", i).captions)
        grown = bundle.grow(counts, data.min_word_count, data.max_vocab)
        missing = {name: vocab.unknown(counts).total() for name, vocab in zip(SETTINGS, (bundle, grown))}
        total = counts.total()
        rows.append(
            [
                size,
                total,
                *(f"{missing[name]:,} ({missing[name] / total:.1%})" for name in SETTINGS),
                len(grown) - len(bundle),
                ", ".join(f"{w} ({n:,})" for w, n in bundle.unknown(counts).most_common(5)),
            ]
        )
    return rows


def fine_tune(bundle: Path, setting: str, args: argparse.Namespace, out: Path) -> dict[str, object]:
    """Run ``train.py`` with ``init_vocab=setting``; the share it logged, its final scores and its validation
    captions' use of the words the bundle lacked."""
    run = out / setting
    overrides = [
        "experiment=scenes",
        f"init_from={bundle}",
        f"init_vocab={setting}",
        f"data.source.n_train={args.n_train}",
        f"trainer.max_epochs={args.epochs}",
        "test=false",
        "logger=csv",
        "callbacks.samples=null",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={run}",
        *args.overrides,
    ]
    found = run_train(overrides, SHARE)
    metrics = json.loads((run / "metrics.json").read_text())
    captions = json.loads((run / "val_captions.json").read_text())
    known = set(load_trained(bundle).vocab.itos)
    new = [sum(w not in known for w in tokenize(c["caption"])) for c in captions]
    return {
        "unk": f"{found[1]} of {found[2]} ({found[3]}%)",
        "vocab": len(load_trained(run / "bundle.pt").vocab),
        "bleu4": metrics[final(metric(VAL, PROGRESS))],
        "cider": metrics[final(metric(VAL, CIDER))],
        "captions": f"{sum(n > 0 for n in new):,} of {len(captions):,}",
        "words": f"{sum(new):,} of {sum(len(tokenize(c['caption'])) for c in captions):,}",
    }


def main(argv: list[str] | None = None) -> None:
    """Print the shares, then (``--epochs`` > 0) the fine-tunes' figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True, help="the demo's bundle.pt (python train.py)")
    parser.add_argument("--sizes", default="64,1600", help="training split sizes of table 1 (default: 64,1600)")
    parser.add_argument("--epochs", type=int, default=2, help="fine-tuning epochs per setting; 0: none (default: 2)")
    parser.add_argument("--n-train", type=int, default=1600, help="training images of the fine-tune (default: 1600)")
    parser.add_argument("--out", type=Path, help="keep the runs' folders here (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="more train.py overrides (key=value) for both runs")
    args = parser.parse_args(argv)
    vocab = load_trained(args.bundle).vocab
    data = from_dict(TrainConfig, compose_config("scenes")).data
    print(f"## init_vocab: keep or grow, the bundle {args.bundle} ({len(vocab)} tokens) on experiment=scenes")
    print_table(
        "Training words read as <unk>",
        ["training images", "words", "keep: <unk>", "grow: <unk>", "words grow adds", "most frequent missing"],
        unknown_shares(vocab, [int(size) for size in args.sizes.split(",")], data),
    )
    print(f"\n- grow admits the words seen at least data.min_word_count={data.min_word_count} times")
    if args.epochs == 0:
        return
    with tempfile.TemporaryDirectory(prefix="init-vocab-") as scratch:
        out = args.out or Path(scratch)
        runs = {setting: fine_tune(args.bundle.resolve(), setting, args, out) for setting in SETTINGS}
    print_table(
        f"Fine-tuned {args.epochs} epoch(s) on {args.n_train} training images; validation (beam 3)",
        ["init_vocab", "<unk> at start", "tokens", "BLEU-4", "CIDEr-D", "captions with a new word", "new words"],
        [[name, *run.values()] for name, run in runs.items()],
    )


if __name__ == "__main__":
    main()
