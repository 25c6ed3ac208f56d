"""Does the built-in dataset need attention? Scores runs' validation captions by the number of shapes.

Train the same model twice, attending and reading only the mean feature, then compare::

    python train.py                        # soft attention
    python train.py model.scorer=mean      # no attention: every word reads the mean feature
    python benchmarks/attention_ablation.py outputs/train/runs/<soft run> outputs/train/runs/<mean run>

For each run folder (its ``val_captions.json``) and each scene size (one, two, three shapes) it prints
corpus BLEU-4 against the five references, and how many "colour shape" phrases of the captions name a
shape that is in the image (precision), and how many of the image's shapes are named (recall). BLEU
rewards the caption templates, which need no attention; the colour-shape binding of a scene with
several shapes is what the mean feature loses.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import defaultdict
from pathlib import Path

from pycocotools.coco import COCO

from captioner.data.shapes import COLOURS, SHAPES, shapes_records
from captioner.data.vocab import tokenize
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.fileio import read_json

Shape = tuple[str, str]  # (colour, shape)


def scene_shapes(instances_file: Path) -> dict[int, set[Shape]]:
    """The (colour, shape) pairs of every image of a shapes instances file."""
    with contextlib.redirect_stdout(sys.stderr):  # pycocotools reports its loading on stdout
        coco = COCO(str(instances_file))
    shapes: dict[int, set[Shape]] = defaultdict(set)
    for ann in coco.dataset["annotations"]:
        shapes[ann["image_id"]].add((ann["colour"], coco.cats[ann["category_id"]]["name"]))
    return shapes


def named_shapes(words: list[str]) -> list[Shape]:
    """The "colour shape" phrases of a tokenised caption, in order."""
    return [(a, b) for a, b in zip(words, words[1:]) if a in COLOURS and b in SHAPES]


def score(captions: dict[int, list[str]], references: dict[int, list[list[str]]],
          shapes: dict[int, set[Shape]]) -> dict[int, dict[str, float]]:
    """Per scene size: images, BLEU-4, precision and recall of the named shapes."""
    table = {}
    for size in sorted({len(s) for s in shapes.values()}):
        ids = [i for i in captions if len(shapes[i]) == size]
        if not ids:
            continue
        named = {i: named_shapes(captions[i]) for i in ids}
        right = sum(shape in shapes[i] for i in ids for shape in named[i])
        said = sum(len(named[i]) for i in ids)
        found = sum(len(shapes[i] & set(named[i])) for i in ids)
        table[size] = {"images": len(ids),
                       "bleu4": corpus_bleu_scores(references, {i: captions[i] for i in ids})["bleu4"],
                       "precision": right / said if said else 0.0,
                       "recall": found / sum(len(shapes[i]) for i in ids)}
    return table


def main(argv: list[str] | None = None) -> None:
    """Print the table for the run folders named in ``argv`` (the command line when None)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders holding val_captions.json")
    parser.add_argument("--data", type=Path, default=Path("data/shapes"), help="the generated shapes dataset")
    parser.add_argument("--split", default="val", help="the split the captions are of")
    args = parser.parse_args(argv)

    shapes = scene_shapes(args.data / "annotations" / f"instances_{args.split}.json")
    references = {r.image_id: [tokenize(c) for c in r.captions] for r in shapes_records(args.data, args.split)}

    print("| run | shapes | images | BLEU-4 | named shapes present (precision) | shapes named (recall) |")
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        captions = {row["image_id"]: tokenize(row["caption"]) for row in read_json(run / "val_captions.json")}
        for size, row in score(captions, references, shapes).items():
            print(f"| {run.name} | {size} | {row['images']} | {row['bleu4']:.3f} | {row['precision']:.3f} "
                  f"| {row['recall']:.3f} |")


if __name__ == "__main__":
    main()
