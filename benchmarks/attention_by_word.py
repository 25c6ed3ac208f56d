"""Does each colour and shape word look at the object it names? Per word, on the built-in dataset.

    python benchmarks/attention_by_word.py outputs/train/runs/<run> [--split test] [--threshold 0.5]

Captions every image of the split with the run's bundle (greedy), finds the "colour shape" phrases that
name an object of the image, and measures the attention mass of the colour word and of the shape word
inside that object's box (``box_coverage`` on the model's grid: the cell area the box covers). Attention
correctness (the training metric) pools all boxes of a shape label; this separates two circles of
different colours. Position words ("top", "left") name no box and are not measured.

Prints, by scene size: the phrases naming an object that is there, the median mass of their colour and
shape words, the share of those words with more than ``--threshold`` of their attention on the object,
and the share of images whose every measured word does (every object named right, too). Then the images
of each size whose weakest measured word is strongest, for choosing an overlay to show.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from pycocotools.coco import COCO

from captioner import load_model
from captioner.config import DecodingConfig
from captioner.data.readers import Box, coco_box
from captioner.data.shapes import COLOURS, SHAPES
from captioner.evaluation.correctness import box_coverage
from captioner.inference import caption_images

Phrase = tuple[int, int, Box]  # (step of the colour word, step of the shape word, the object's box)


def phrases(words: list[str], objects: dict[tuple[str, str], Box]) -> tuple[list[Phrase], int]:
    """The caption's "colour shape" phrases that name an object of the image, and how many name none."""
    found, wrong = [], 0
    for step, (colour, shape) in enumerate(zip(words, words[1:])):
        if colour in COLOURS and shape in SHAPES:
            if (colour, shape) in objects:
                found.append((step, step + 1, objects[(colour, shape)]))
            else:
                wrong += 1
    return found, wrong


def main(argv: list[str] | None = None) -> None:
    """Print the per-word figures for the run named in ``argv`` (the command line when None)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (its bundle.pt) or a bundle")
    parser.add_argument("--data", type=Path, default=Path("data/shapes"), help="the generated shapes dataset")
    parser.add_argument("--split", default="test")
    parser.add_argument("--threshold", type=float, default=0.5, help="attention mass that counts as 'on it'")
    parser.add_argument("--show", type=int, default=3, help="images listed per scene size")
    args = parser.parse_args(argv)

    loaded = load_model(args.run)
    with contextlib.redirect_stdout(sys.stderr):  # pycocotools reports its loading on stdout
        coco = COCO(str(args.data / "annotations" / f"instances_{args.split}.json"))
    ids = sorted(coco.imgs)
    paths = [str(args.data / "images" / args.split / coco.imgs[i]["file_name"]) for i in ids]
    with torch.inference_mode():
        results = caption_images(loaded, paths, decoding=DecodingConfig.captioning(method="greedy"))

    by_size: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for image_id, result in zip(ids, results):
        image = coco.imgs[image_id]
        objects = {}  # (colour, shape) -> its box
        for ann in coco.imgToAnns[image_id]:
            shape = coco.cats[ann["category_id"]]["name"]
            objects[(ann["colour"], shape)] = coco_box(ann["bbox"], shape, image["width"], image["height"])
        found, wrong = phrases(result.words, objects)
        masses = [
            float(result.alphas[step].double() @ box_coverage(box, result.grid))
            for colour_step, shape_step, box in found
            for step in (colour_step, shape_step)
        ]
        stats = by_size[len(objects)]
        stats["masses"].extend(masses)
        stats["wrong"].append(wrong)
        stats["found"].append(len(found))
        all_named = wrong == 0 and len(found) == len(objects)
        stats["every"].append(all_named and all(m > args.threshold for m in masses))
        stats["weakest"].append((min(masses) if all_named and masses else 0.0, image["file_name"], result.caption))

    print(f"{args.run} ({args.split}, greedy): colour and shape words' attention inside the object they name")
    print(
        f"| shapes | images | phrases naming an object / not | median mass | words > {args.threshold} "
        f"| images with every word > {args.threshold} |"
    )
    print("|---|---|---|---|---|---|")
    for size in sorted(by_size):
        stats = by_size[size]
        masses = stats["masses"]
        on = sum(m > args.threshold for m in masses) / max(1, len(masses))
        print(
            f"| {size} | {len(stats['every'])} | {sum(stats['found'])} / {sum(stats['wrong'])} "
            f"| {statistics.median(masses) if masses else 0.0:.3f} | {on:.3f} "
            f"| {sum(stats['every']) / len(stats['every']):.3f} |"
        )
    for size in sorted(by_size):
        best = sorted(by_size[size]["weakest"], reverse=True)[: args.show]
        for weakest, name, caption in best:
            print(f"{size} shapes: {name} weakest word {weakest:.3f}: {caption}")


if __name__ == "__main__":
    main()
