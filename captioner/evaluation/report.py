"""Evaluate a model on a dataset split: decode every image once, score, write results and metrics JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from captioner.data.dataset import Skipped
from captioner.data.readers import Record
from captioner.data.vocab import tokenize
from captioner.errors import DataError
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.evaluation.cococaption import SPICE_NOTE, coco_caption_scores, java_available
from captioner.evaluation.correctness import AttentionCorrectness
from captioner.evaluation.results import SCALE, write_metrics, write_results
from captioner.inference import caption_files
from captioner.model.captioner import LoadedModel


def evaluate_split(loaded: LoadedModel, records: Sequence[Record], out_dir: Path, batch_size: int = 32,
                   workers: int = 0, coco: bool = True, progress: bool = False, **decode
                   ) -> tuple[dict, list[Skipped]]:
    """Decode ``records`` and write ``results.json`` (COCO server format) and ``metrics.json`` to ``out_dir``.

    Every image is decoded once and scored against all its references: nltk BLEU-1..4 always, the
    coco-caption suite when ``coco`` and Java is present, attention correctness where records have
    boxes. Unreadable images are left out (counted in ``skipped_images``). Returns the metrics, with a
    printable ``table`` (scores are fractions in [0, 1]), and the unreadable images.
    Raises DataError when there are no records or none could be decoded.
    """
    if not records:
        raise DataError("the split has no images to evaluate")
    by_path = {r.image_path: r for r in records}
    captions: dict[int, list[str]] = {}
    correctness = AttentionCorrectness()
    skipped: list[Skipped] = []
    for result in caption_files(loaded, list(by_path), batch_size, workers, progress, **decode):
        if isinstance(result, Skipped):
            skipped.append(result)
            continue
        record = by_path[result.path]
        captions[record.image_id] = result.words
        if record.boxes:
            correctness.update(record.image_id, result.words, result.alphas, result.grid, record.boxes)
    if not captions:
        raise DataError(f"none of the {len(by_path)} images could be decoded")
    hypotheses = {i: " ".join(w) for i, w in captions.items()}
    write_results(out_dir / "results.json", hypotheses)
    scored = [r for r in records if r.image_id in captions]
    metrics: dict = {"scale": SCALE, "images": len(scored), "skipped_images": len(skipped),
                     "decoding": decode}
    metrics["bleu"] = corpus_bleu_scores({r.image_id: [tokenize(c) for c in r.captions] for r in scored},
                                         captions)
    if coco and java_available():
        metrics["coco_caption"] = coco_caption_scores({r.image_id: list(r.captions) for r in scored}, hypotheses)
        metrics["spice"] = SPICE_NOTE
    elif coco:
        metrics["coco_caption"] = "skipped: Java was not found (pycocoevalcap needs java on PATH)"
    if correctness.words:
        metrics["attention_correctness"] = correctness.compute()
    write_metrics(out_dir / "metrics.json", metrics)
    metrics["table"] = format_table(metrics, out_dir)
    return metrics, skipped


def format_table(metrics: dict, out_dir: Path) -> str:
    """The metrics as aligned lines, scale stated."""
    lines = [f"{metrics['images']} images ({metrics['skipped_images']} unreadable, skipped); "
             f"scores on the 0-1 scale (x100 for the paper's tables; CIDEr may exceed 1)"]
    lines += [f"  nltk {name.upper():<10} {value:.4f}" for name, value in metrics["bleu"].items()]
    suite = metrics.get("coco_caption")
    if isinstance(suite, dict):
        lines += [f"  coco {name:<10} {value:.4f}" for name, value in suite.items()]
        lines.append("  coco SPICE      skipped (it needs a download; see \"spice\" in metrics.json)")
    elif suite:
        lines.append(f"  coco-caption: {suite}")
    if "attention_correctness" in metrics:
        ac = metrics["attention_correctness"]
        lines.append(f"  attention correctness {ac['mean_mass']:.3f} over {ac['words']} object words "
                     f"(uniform attention would give {ac['uniform_mass']:.3f})")
    lines.append(f"results: {out_dir / 'results.json'}")
    lines.append(f"metrics: {out_dir / 'metrics.json'}")
    return "\n".join(lines)
