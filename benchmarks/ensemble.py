"""Trained models alone and as one ensemble: BLEU-4 and CIDEr-D on the validation and test splits.

    python benchmarks/ensemble.py outputs/train/runs/<seed0> outputs/train/runs/<seed1> outputs/train/runs/<seed2>

Every row is scored by ``captioner evaluate``'s code (``evaluation.report.evaluate_split``) on the images of the
runs' dataset (their config.yaml's ``data.source``, which must be the same), decoded as each model's run decoded
its final scores (the ensemble: as the first run's; ``--method`` and ``--beam-size`` replace that). Columns: nltk
corpus BLEU-4 (the README's), coco-caption's BLEU-4 and CIDEr-D (pycocoevalcap's ``Cider``, which is CIDEr-D;
"n/a" without Java), and the seconds the row took on whatever else the machine runs. The last rows are the mean
of the models alone and their ensemble (the mean of their log-probabilities at every word).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf
from validation_agreement import split_records

from captioner.config import captioning_settings
from captioner.evaluation.report import evaluate_split
from captioner.inference import LoadedModel, load_model
from captioner.run_files import CONFIG_FILE
from tables import print_table

SPLITS = ("val", "test")


def scores(loaded: LoadedModel, records: dict[str, list], batch_size: int, coco: bool) -> list[float]:
    """nltk BLEU-4, coco BLEU-4 and CIDEr-D (``coco``) on each split, in turn, and the seconds all took."""
    row, start = [], time.perf_counter()
    for split in SPLITS:
        with tempfile.TemporaryDirectory() as out:
            metrics, _ = evaluate_split(loaded, records[split], Path(out), batch_size, workers=0, coco=coco)
        suite = metrics.get("coco_caption")
        coco = suite if isinstance(suite, dict) else {}
        row += [metrics["bleu"]["bleu4"], coco.get("Bleu_4", float("nan")), coco.get("CIDEr", float("nan"))]
    return [*row, time.perf_counter() - start]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="training run folders (their bundle.pt and config.yaml)")
    parser.add_argument("--method", choices=("greedy", "beam"), help="decoding method (default: the runs')")
    parser.add_argument("--beam-size", type=int, help="beam width (default: the runs')")
    parser.add_argument("--batch-size", type=int, default=125, help="images decoded together (default: 125)")
    parser.add_argument("--no-coco", action="store_true", help="nltk BLEU-4 only (no Java: faster)")
    args = parser.parse_args(argv)
    sources = [OmegaConf.to_container(OmegaConf.load(run / CONFIG_FILE).data.source) for run in args.runs]
    if any(source != sources[0] for source in sources[1:]):
        sys.exit(f"error: the runs were trained on different datasets: {sources}")
    records = {split: split_records(args.runs[0], split) for split in SPLITS}
    given = {key: value for key, value in (("method", args.method), ("beam_size", args.beam_size)) if value}

    def decoding(loaded: LoadedModel) -> LoadedModel:
        return dataclasses.replace(loaded, decoding=captioning_settings(given, base=loaded.decoding))

    rows = []
    for run in args.runs:
        rows.append([run.name, *scores(decoding(load_model(run)), records, args.batch_size, not args.no_coco)])
    alone = [sum(row[i] for row in rows) / len(rows) for i in range(1, len(rows[0]))]
    rows.append([f"mean of the {len(args.runs)} alone", *alone[:-1], float("nan")])
    ensemble = decoding(load_model(args.runs))
    rows.append([f"ensemble of the {len(args.runs)}", *scores(ensemble, records, args.batch_size, not args.no_coco)])
    columns = ["model"] + [f"{split} {name}" for split in SPLITS for name in ("BLEU-4", "coco BLEU-4", "CIDEr-D")]
    print(
        f"{len(records['val'])} val and {len(records['test'])} test images; decoding {ensemble.decoding}; "
        "BLEU-4: nltk corpus BLEU (the README's); coco: pycocoevalcap's BLEU-4 and CIDEr-D"
    )
    print_table("models alone and as an ensemble", [*columns, "seconds"], rows)
    print("the ensemble: the normalised mean of the models' log-probabilities at every word (captioner.model.ensemble)")


if __name__ == "__main__":
    main()
