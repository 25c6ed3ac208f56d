"""Trained models alone and as one ensemble: BLEU-4 and CIDEr-D on the validation and test splits, and where the
ensemble's captions part from its members'.

    python benchmarks/ensemble.py outputs/train/runs/<seed0> outputs/train/runs/<seed1> outputs/train/runs/<seed2>

Every row is scored by ``captioner evaluate``'s code (``evaluation.report.evaluate_split``) on the images of the
runs' dataset (their config.yaml's ``data.source``, which must be the same), decoded as each model's run decoded
its final scores (the ensemble: as the first run's; ``--method`` and ``--beam-size`` replace that). Columns: nltk
corpus BLEU-4 (the README's), coco-caption's BLEU-4 and CIDEr-D (pycocoevalcap's ``Cider``, which is CIDEr-D;
"n/a" without Java), the mean caption length, and on a shapes set (its instances files) the share of the
"colour shape" phrases that name a shape of the image and the share of the images' shapes named; then the seconds
the row took on whatever else the machine runs.
The last rows are the mean of the models alone and their ensembles, one per way of averaging (``--means``: the
normalised mean of the log-probabilities at every word, or of the probabilities).

The second table says, per ensemble and split, how often its caption is word for word one of its members', and
on the images where it is none of theirs, its per-image BLEU-4 against the members' mean and best there.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attention_ablation
from attention_ablation import Shape
from omegaconf import OmegaConf
from validation_agreement import split_records

from captioner.config import EnsembleMean, captioning_settings
from captioner.evaluation.report import PER_IMAGE_FILE, evaluate_split
from captioner.fileio import read_json
from captioner.inference import LoadedModel, load_model
from captioner.run_files import CONFIG_FILE
from tables import print_table

SPLITS = ("val", "test")
MEANS = {EnsembleMean.log: "log-probabilities", EnsembleMean.prob: "probabilities"}

# One model's (or ensemble's) decoding of a split: image id -> (caption, its own BLEU-4).
Captions = dict[int, tuple[str, float]]


def scores(
    loaded: LoadedModel, records: dict[str, list], shapes: dict[str, dict[int, set[Shape]]], batch_size: int, coco: bool
) -> tuple[list[float], dict[str, Captions]]:
    """Per split in turn nltk BLEU-4, coco BLEU-4 and CIDEr-D (``coco``), the mean words of a caption and its
    named shapes' precision and recall (``named_shapes_right``; ``shapes``: each split's scenes, where the set has
    them), then the seconds all took; and each split's captions."""
    row, captions, start = [], {}, time.perf_counter()
    for split in SPLITS:
        with tempfile.TemporaryDirectory() as out:
            metrics, _ = evaluate_split(loaded, records[split], Path(out), batch_size, workers=0, coco=coco)
            images = read_json(Path(out) / PER_IMAGE_FILE)
        captions[split] = {image["image_id"]: (image["caption"], image["bleu4"]) for image in images}
        suite = metrics.get("coco_caption")
        suite = suite if isinstance(suite, dict) else {}
        words = statistics.mean(len(caption.split()) for caption, _ in captions[split].values())
        row += [metrics["bleu"]["bleu4"], suite.get("Bleu_4", float("nan")), suite.get("CIDEr", float("nan"))]
        row += [words, *named_shapes_right(images, shapes.get(split))]
    return [*row, time.perf_counter() - start], captions


def named_shapes_right(images: list[dict], shapes: dict[int, set[Shape]] | None) -> tuple[float, float]:
    """Of the "colour shape" phrases the captions (``per_image.json``'s entries) name, the share (%) that are shapes
    of their image, and the share of the images' shapes named (nan, nan without ``shapes``: not a shapes set)."""
    if shapes is None:
        return float("nan"), float("nan")
    named = {image["image_id"]: attention_ablation.named_shapes(image["caption"].split()) for image in images}
    said = sum(len(phrases) for phrases in named.values())
    right = sum(shape in shapes[i] for i, phrases in named.items() for shape in phrases)
    found = sum(len(shapes[i] & set(phrases)) for i, phrases in named.items())
    return 100.0 * right / max(said, 1), 100.0 * found / max(sum(len(shapes[i]) for i in named), 1)


def scenes(root: Path) -> dict[str, dict[int, set[Shape]]]:
    """Each split's (colour, shape) pairs per image, from the dataset's instances files (none: not a shapes set)."""
    files = {split: root / "annotations" / f"instances_{split}.json" for split in SPLITS}
    return {
        split: attention_ablation.scene_shapes(attention_ablation.read_instances(file))
        for split, file in files.items()
        if file.is_file()
    }


def agreement(ensemble: Captions, members: list[Captions]) -> list[object]:
    """How often ``ensemble``'s caption is one of ``members``' (%), the images where it is none of theirs, and
    there its mean per-image BLEU-4, the members' mean and the best member's (by its BLEU-4 on those images)."""
    apart = [i for i, (caption, _) in ensemble.items() if all(member[i][0] != caption for member in members)]
    if not apart:
        return [100.0, 0, float("nan"), float("nan"), float("nan")]
    own = statistics.mean(ensemble[i][1] for i in apart)
    alone = [statistics.mean(member[i][1] for i in apart) for member in members]
    return [100.0 * (1 - len(apart) / len(ensemble)), len(apart), own, statistics.mean(alone), max(alone)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="training run folders (their bundle.pt and config.yaml)")
    parser.add_argument("--method", choices=("greedy", "beam"), help="decoding method (default: the runs')")
    parser.add_argument("--beam-size", type=int, help="beam width (default: the runs')")
    parser.add_argument("--batch-size", type=int, default=125, help="images decoded together (default: 125)")
    parser.add_argument("--no-coco", action="store_true", help="nltk BLEU-4 only (no Java: faster)")
    parser.add_argument(
        "--means", nargs="+", choices=list(MEANS), default=list(MEANS), help="the ensembles' averages (default: both)"
    )
    args = parser.parse_args(argv)
    sources = [OmegaConf.to_container(OmegaConf.load(run / CONFIG_FILE).data.source) for run in args.runs]
    if any(source != sources[0] for source in sources[1:]):
        sys.exit(f"error: the runs were trained on different datasets: {sources}")
    records = {split: split_records(args.runs[0], split) for split in SPLITS}
    shapes = scenes(Path(root)) if (root := sources[0].get("root")) else {}
    given = {key: value for key, value in (("method", args.method), ("beam_size", args.beam_size)) if value}
    coco = not args.no_coco

    def decoding(loaded: LoadedModel) -> LoadedModel:
        return dataclasses.replace(loaded, decoding=captioning_settings(given, base=loaded.decoding))

    rows, members = [], []
    for run in args.runs:
        row, captions = scores(decoding(load_model(run)), records, shapes, args.batch_size, coco)
        rows.append([run.name, *row])
        members.append(captions)
    alone = [sum(row[i] for row in rows) / len(rows) for i in range(1, len(rows[0]))]
    rows.append([f"mean of the {len(args.runs)} alone", *alone[:-1], float("nan")])
    apart = []
    for mean in map(EnsembleMean, args.means):
        ensemble = decoding(load_model(args.runs, mean=mean))
        row, captions = scores(ensemble, records, shapes, args.batch_size, coco)
        name = f"ensemble of the {len(args.runs)}, mean of {MEANS[mean]}"
        rows.append([name, *row])
        apart += [[name, split, *agreement(captions[split], [m[split] for m in members])] for split in SPLITS]
    columns = ["model"] + [
        f"{split} {name}"
        for split in SPLITS
        for name in ("BLEU-4", "coco BLEU-4", "CIDEr-D", "words", "% shapes right", "% shapes named")
    ]
    print(
        f"{len(records['val'])} val and {len(records['test'])} test images; decoding {ensemble.decoding}; "
        "BLEU-4: nltk corpus BLEU (the README's); coco: pycocoevalcap's BLEU-4 and CIDEr-D"
    )
    print_table("models alone and as an ensemble", [*columns, "seconds"], rows)
    print_table(
        "where an ensemble's captions part from its members' (per-image nltk BLEU-4 on the images it parts)",
        ["ensemble", "split", "% a member's caption", "images apart", "BLEU-4 there", "members' mean", "best member"],
        apart,
    )


if __name__ == "__main__":
    main()
