"""Evaluate a model on a dataset split: decode every image once, score, write results and metrics JSON."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import torch

from captioner.data.dataset import Skipped
from captioner.data.readers import Record
from captioner.data.vocab import Vocabulary, tokenize
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.evaluation.cococaption import SPICE_NOTE, coco_caption_scores, java_available
from captioner.evaluation.correctness import AttentionCorrectness
from captioner.evaluation.results import SCALE, write_metrics, write_results
from captioner.inference import caption_files


def evaluate_split(model: torch.nn.Module, vocab: Vocabulary, image_size: int, records: Sequence[Record],
                   device: torch.device, batch_size: int, workers: int, out_dir: Path, coco: bool = True,
                   **decode) -> dict:
    """Decode ``records`` and write ``results.json`` (COCO server format) and ``metrics.json`` to ``out_dir``.

    Returns the metrics, with a printable ``table``. Scores are fractions in [0, 1].
    """
    by_path = {r.image_path: r for r in records}
    captions: dict[int, list[str]] = {}
    correctness = AttentionCorrectness()
    skipped: list[Skipped] = []
    for result in caption_files(model, vocab, image_size, list(by_path), device, batch_size, workers,
                                progress=len(by_path) >= 64 and sys.stderr.isatty(), **decode):
        if isinstance(result, Skipped):
            skipped.append(result)
            continue
        record = by_path[result.path]
        captions[record.image_id] = result.words
        if record.boxes:
            correctness.update(result.words, result.alphas, result.grid, record.boxes)
    scored = [r for r in records if r.image_id in captions]
    metrics: dict = {"scale": SCALE, "images": len(scored),
                     "skipped_images": len(skipped), "decoding": decode}
    metrics["bleu"] = corpus_bleu_scores({r.image_id: [tokenize(c) for c in r.captions] for r in scored},
                                         captions)
    if coco and java_available():
        metrics["coco_caption"] = coco_caption_scores({r.image_id: list(r.captions) for r in scored},
                                                      {i: " ".join(w) for i, w in captions.items()})
        metrics["spice"] = SPICE_NOTE
    elif coco:
        metrics["coco_caption"] = "skipped: Java was not found (pycocoevalcap needs java on PATH)"
    if correctness.words:
        metrics["attention_correctness"] = correctness.compute()
    write_results(out_dir / "results.json", {i: " ".join(w) for i, w in captions.items()})
    write_metrics(out_dir / "metrics.json", metrics)
    for item in skipped:
        print(f"error: {item.path}: {item.reason}", file=sys.stderr)
    metrics["table"] = format_table(metrics, out_dir)
    return metrics


def format_table(metrics: dict, out_dir: Path) -> str:
    """The metrics as aligned lines, scale stated."""
    lines = [f"{metrics['images']} images ({metrics['skipped_images']} unreadable, skipped); "
             f"scores are fractions in [0, 1]"]
    lines += [f"  nltk {name.upper():<10} {value:.4f}" for name, value in metrics["bleu"].items()]
    suite = metrics.get("coco_caption")
    if isinstance(suite, dict):
        lines += [f"  coco {name:<10} {value:.4f}" for name, value in suite.items()]
        lines.append(f"  coco SPICE      skipped ({metrics['spice']})")
    elif suite:
        lines.append(f"  coco-caption: {suite}")
    if "attention_correctness" in metrics:
        ac = metrics["attention_correctness"]
        lines.append(f"  attention correctness {ac['mean_mass']:.3f} over {ac['words']} object words")
    lines.append(f"results: {out_dir / 'results.json'}")
    lines.append(f"metrics: {out_dir / 'metrics.json'}")
    return "\n".join(lines)
