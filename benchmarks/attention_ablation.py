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

A last row, "perfect content", scores captions written from the ground truth with one fixed template
("a red circle in the top left corner"; "a red circle and a blue square"; "a red circle, a blue square
and a green triangle", shapes in reading order): what a captioner that never errs about the shapes
reaches. The references order the shapes at random and vary their templates, so it is well below 1.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import defaultdict
from pathlib import Path

from pycocotools.coco import COCO

from captioner.data.scenes import COLOURS, SHAPES, position_phrase
from captioner.data.shapes import shapes_records
from captioner.data.vocab import tokenize
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.fileio import read_json

Shape = tuple[str, str]  # (colour, shape)


def read_instances(instances_file: Path) -> COCO:
    """The shapes instances file through pycocotools."""
    with contextlib.redirect_stdout(sys.stderr):  # pycocotools reports its loading on stdout
        return COCO(str(instances_file))


def scene_shapes(coco: COCO) -> dict[int, set[Shape]]:
    """The (colour, shape) pairs of every image."""
    shapes: dict[int, set[Shape]] = defaultdict(set)
    for ann in coco.dataset["annotations"]:
        shapes[ann["image_id"]].add((ann["colour"], coco.cats[ann["category_id"]]["name"]))
    return shapes


def perfect_captions(coco: COCO) -> dict[int, list[str]]:
    """Tokenised captions written from the ground truth with one template per scene size (see above)."""
    captions = {}
    for image_id, image in coco.imgs.items():
        placed = []
        for ann in coco.imgToAnns[image_id]:
            x, y, w, h = ann["bbox"]
            cell = 3 * min(2, int(3 * (y + h / 2) / image["height"])) + min(2, int(3 * (x + w / 2) / image["width"]))
            placed.append((cell, f"{ann['colour']} {coco.cats[ann['category_id']]['name']}"))
        names = [name for _, name in sorted(placed)]
        if len(names) == 1:
            text = f"a {names[0]} {position_phrase(sorted(placed)[0][0])}"
        else:
            text = ", ".join(f"a {name}" for name in names[:-1]) + f" and a {names[-1]}"
        captions[image_id] = tokenize(text)
    return captions


def named_shapes(words: list[str]) -> list[Shape]:
    """The "colour shape" phrases of a tokenised caption, in order."""
    return [(a, b) for a, b in zip(words, words[1:]) if a in COLOURS and b in SHAPES]


def score(
    captions: dict[int, list[str]], references: dict[int, list[list[str]]], shapes: dict[int, set[Shape]]
) -> dict[int, dict[str, float]]:
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
        table[size] = {
            "images": len(ids),
            "bleu4": corpus_bleu_scores(references, {i: captions[i] for i in ids})["bleu4"],
            "precision": right / said if said else 0.0,
            "recall": found / sum(len(shapes[i]) for i in ids),
        }
    return table


def main(argv: list[str] | None = None) -> None:
    """Print the table for the run folders named in ``argv`` (the command line when None)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders holding val_captions.json")
    parser.add_argument("--data", type=Path, default=Path("data/shapes"), help="the generated shapes dataset")
    parser.add_argument("--split", default="val", help="the split the captions are of")
    args = parser.parse_args(argv)

    coco = read_instances(args.data / "annotations" / f"instances_{args.split}.json")
    shapes = scene_shapes(coco)
    references = {r.image_id: [tokenize(c) for c in r.captions] for r in shapes_records(args.data, args.split)}

    print("| run | shapes | images | BLEU-4 | named shapes present (precision) | shapes named (recall) |")
    print("|---|---|---|---|---|---|")
    runs = [
        (run.name, {row["image_id"]: tokenize(row["caption"]) for row in read_json(run / "val_captions.json")})
        for run in args.runs
    ]
    for name, captions in [*runs, ("perfect content", perfect_captions(coco))]:
        for size, row in score(captions, references, shapes).items():
            print(
                f"| {name} | {size} | {row['images']} | {row['bleu4']:.3f} | {row['precision']:.3f} "
                f"| {row['recall']:.3f} |"
            )
        print(f"| {name} | all | {len(captions)} | {corpus_bleu_scores(references, captions)['bleu4']:.3f} | | |")


if __name__ == "__main__":
    main()
