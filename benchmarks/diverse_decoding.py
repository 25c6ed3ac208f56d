"""How far diverse beam search parts a model's n-best captions, and what it costs in BLEU: one trained model, one
split, beam search against diverse beam search at several penalties, top-k / nucleus sampling beside them.

    python benchmarks/diverse_decoding.py outputs/train/runs/<run> [--split test] [--beams 6] [--groups 3]

Per row: BLEU-4 of the one-best captions (nltk corpus BLEU, as training and ``captioner evaluate`` score), the
mean BLEU-4 of the n-best lists' captions rank by rank (every rank's captions scored as one corpus), and per image
the distinct words across its n-best list and its distinct captions (beam and diverse rows: the ``--beams`` best of
each image). The seconds are wall time on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import OmegaConf

from captioner.data.vocab import tokenize
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.inference import load_model
from captioner.run_files import CONFIG_FILE
from tables import print_table

DIVERSITIES = (0.0, 0.5, 1.0, 2.0)  # lambda of the diverse rows
SAMPLING = ({"top_k": 3}, {"top_p": 0.8}, {})  # the sampling rows' cuts (seed 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a training run's folder (its bundle.pt and config.yaml)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--beams", type=int, default=6, help="beams per image, and captions in each n-best list")
    parser.add_argument("--groups", type=int, default=3, help="the diverse rows' groups")
    args = parser.parse_args()
    source = instantiate(OmegaConf.load(args.run / CONFIG_FILE).data.source, _convert_="all")
    source.prepare()
    records = source.records(args.split)
    references = {record.image_id: [tokenize(caption) for caption in record.captions] for record in records}
    model = load_model(args.run)
    paths = [record.image_path for record in records]
    beams = dict(beam_size=args.beams, n_best=args.beams)
    settings = {"beam search": dict(method="beam", **beams)}
    for diversity in DIVERSITIES:
        name = f"diverse, {args.groups} groups, diversity {diversity}"
        settings[name] = dict(method="diverse", groups=args.groups, diversity=diversity, **beams)
    for cut in SAMPLING:
        name = "sample" + "".join(f", {key.replace('_', '-')} {value}" for key, value in cut.items())
        settings[name] = dict(method="sample", seed=0, **cut)
    rows = []
    for name, options in settings.items():
        started = time.perf_counter()
        results = model.caption(paths, batch_size=len(paths), **options)
        seconds = time.perf_counter() - started
        lists = [result.n_best or [result] for result in results]  # (images, n) captions, best first
        ids = [record.image_id for record in records]
        one_best = corpus_bleu_scores(references, {i: r.words for i, r in zip(ids, results)})["bleu4"]
        ranks = min(len(listed) for listed in lists)
        by_rank = [
            corpus_bleu_scores(references, {i: listed[rank].words for i, listed in zip(ids, lists)})["bleu4"]
            for rank in range(ranks)
        ]
        words = sum(len({w for one in listed for w in one.words}) for listed in lists) / len(lists)
        captions = sum(len({one.caption for one in listed}) for listed in lists) / len(lists)
        rows.append([name, one_best, sum(by_rank) / ranks, words, captions, seconds])
    print_table(
        f"{args.run.name}, {args.split} ({len(records)} images), {args.beams} beams, n-best {args.beams}",
        ["decoding", "BLEU-4 (1-best)", "mean BLEU-4 of the n-best ranks", "distinct words / image",
         "distinct captions / image", "seconds"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
