"""Cross-entropy vs self-critical training on the built-in demo: BLEU-4, CIDEr-D and repeated bigrams.

Train, fine-tune with SCST, then compare the two runs' models (their ``bundle.pt``)::

    python train.py                                                         # cross-entropy
    python train.py experiment=demo_scst ckpt_path=outputs/train/runs/<run>  # SCST from it
    python benchmarks/scst_demo.py outputs/train/runs/<run> outputs/demo_scst/runs/<run>

Each model captions every image of the split (validation by default) greedily and with beam search;
each decoding is scored with corpus BLEU-4 (nltk, as validation logs it) and CIDEr-D against all
references, and the share of captions that repeat a bigram is counted: a metric can be bought with
degenerate captions ("a red circle and a red circle"), which this column would show.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from captioner.config import DecodingConfig
from captioner.data.shapes import shapes_records
from captioner.data.vocab import tokenize
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.evaluation.cider import corpus_cider_d
from captioner.inference import caption_files, load_model


def repeats_a_bigram(words: list[str]) -> bool:
    """True when some bigram occurs twice in the caption."""
    bigrams = list(zip(words, words[1:]))
    return len(set(bigrams)) < len(bigrams)


def score(captions: dict[int, list[str]], references: dict[int, list[list[str]]]) -> dict[str, float]:
    """BLEU-4, CIDEr-D, the share of captions repeating a bigram and the mean caption length."""
    return {
        "bleu4": corpus_bleu_scores(references, captions)["bleu4"],
        "cider": corpus_cider_d(references, captions),
        "repeats": sum(map(repeats_a_bigram, captions.values())) / len(captions),
        "length": sum(map(len, captions.values())) / len(captions),
    }


def main(argv: list[str] | None = None) -> None:
    """Print the table for the run folders (or bundle files) named in ``argv`` (the command line when None)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders holding bundle.pt, or bundle files")
    parser.add_argument("--data", type=Path, default=Path("data/shapes"), help="the generated shapes dataset")
    parser.add_argument("--split", default="val", help="the split to caption (default: val)")
    parser.add_argument("--beam-size", type=int, default=3, help="the beam search's width (default: 3)")
    args = parser.parse_args(argv)

    records = shapes_records(args.data, args.split)
    references = {r.image_id: [tokenize(c) for c in r.captions] for r in records}
    image_ids = {r.image_path: r.image_id for r in records}
    decodings = {
        "greedy": DecodingConfig.captioning(method="greedy"),
        f"beam {args.beam_size}": DecodingConfig.captioning(method="beam", beam_size=args.beam_size),
    }
    print(
        f"{len(records)} {args.split} images; BLEU-4: nltk corpus BLEU against all references; CIDEr-D: "
        "pycocoevalcap's CIDEr on the same tokens, document frequencies from these references\n"
    )
    print("| model | decoding | BLEU-4 | CIDEr-D | captions repeating a bigram | mean length |")
    print("|---|---|---|---|---|---|")
    human = [ref for refs in references.values() for ref in refs]
    print(
        f"| references | written | | | {sum(map(repeats_a_bigram, human)) / len(human):.1%} "
        f"| {sum(map(len, human)) / len(human):.1f} |"
    )
    for run in args.runs:
        loaded = load_model(run / "bundle.pt" if run.is_dir() else run)
        label = run.parent.parent.name if run.is_dir() else run.name  # outputs/<task>/runs/<run>: the task
        for name, decode in decodings.items():
            captions = {image_ids[c.path]: c.words for c in caption_files(loaded, list(image_ids), decoding=decode)}
            row = score(captions, references)
            print(
                f"| {label} | {name} | {row['bleu4']:.3f} | {row['cider']:.3f} | {row['repeats']:.1%} "
                f"| {row['length']:.1f} |"
            )


if __name__ == "__main__":
    main()
