"""Evaluate a model on a dataset split: decode every image once, score, write results, metrics and the
scores of each image as JSON."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from captioner.config import (
    CAPTIONING_BATCH_SIZE,
    CAPTIONING_WORKERS,
    DecodingConfig,
    HardInference,
    ImageDecoding,
    to_dict,
)
from captioner.data.dataset import Skipped
from captioner.data.readers import Record
from captioner.data.vocab import tokenize
from captioner.errors import DataError
from captioner.evaluation.bleu import corpus_bleu_scores, image_bleu_scores
from captioner.evaluation.cococaption import SPICE_NOTE, coco_caption_scores, java_available
from captioner.evaluation.correctness import AttentionCorrectness
from captioner.evaluation.results import SCALE, write_metrics, write_results
from captioner.fileio import write_json
from captioner.inference import LoadedEnsemble, LoadedModel, caption_files
from captioner.run_files import METRICS_FILE

RESULTS_FILE = "results.json"
PER_IMAGE_FILE = "per_image.json"


def evaluate_split(
    loaded: LoadedModel,
    records: Sequence[Record],
    out_dir: Path,
    batch_size: int = CAPTIONING_BATCH_SIZE,
    workers: int = CAPTIONING_WORKERS,
    coco: bool = True,
    progress: bool = False,
    decoding: DecodingConfig | None = None,
    max_pixels: int | None = None,
    decode: ImageDecoding = ImageDecoding.auto,
) -> tuple[dict, list[Skipped]]:
    """Decode ``records``; write ``results.json`` (COCO server format), ``metrics.json`` and ``per_image.json``.

    Every image is decoded once and scored against all its references: nltk BLEU-1..4 always (the
    project's ``bleu1``..``bleu4``), the coco-caption suite when ``coco`` and Java is present (named as
    ``COCOEvalCap`` names them: ``Bleu_1``..``Bleu_4``, ``METEOR``, ``ROUGE_L``, ``CIDEr``), attention
    correctness where records have boxes. ``per_image.json`` lists every decoded image, sorted by id, with
    its file, caption, references and the same scores for it alone (``COCOEvalCap.imgToEval``'s), to sort
    and read the worst captions. Unreadable images are left out (counted in ``skipped_images``). Returns the
    metrics, with a printable ``table`` (scores are fractions in [0, 1]), and the unreadable images.
    An ensemble's metrics name its models (``ensemble``). ``decoding``: how (None: the model's,
    ``loaded.decoding``); ``max_pixels``: the pixel limit of an image file (``load_rgb``; None: Pillow's);
    ``decode``: where the images are decoded (``caption_files``). Raises DataError when there are no records or
    none could be decoded.
    """
    decoding = loaded.decoding if decoding is None else decoding
    if not records:
        raise DataError("the split has no images to evaluate")
    by_path = {r.image_path: r for r in records}
    captions: dict[int, list[str]] = {}
    correctness = AttentionCorrectness()
    skipped: list[Skipped] = []
    for result in caption_files(loaded, list(by_path), batch_size, workers, progress, decoding, max_pixels, decode):
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
    write_results(out_dir / RESULTS_FILE, hypotheses)
    scored = [r for r in records if r.image_id in captions]
    references = {r.image_id: [tokenize(c) for c in r.captions] for r in scored}
    metrics: dict = {"scale": SCALE, "images": len(scored), "skipped_images": len(skipped)}
    metrics["decoding"] = to_dict(decoding)
    if isinstance(loaded, LoadedEnsemble):  # the models whose log-probabilities were averaged
        metrics["ensemble"] = [str(member.source) for member in loaded.members]
    if (read := loaded.model.decoder.hard_read) is not None:
        metrics["hard_inference"] = str(read)
    metrics["bleu"] = corpus_bleu_scores(references, captions)
    per_image = {
        r.image_id: {
            "image_id": r.image_id,
            "file": r.image_path,
            "caption": hypotheses[r.image_id],
            "references": list(r.captions),
        }
        for r in scored
    }
    for image_id, scores in image_bleu_scores(references, captions).items():
        per_image[image_id].update(scores)
    if coco and java_available():
        suite, suite_per_image = coco_caption_scores({r.image_id: list(r.captions) for r in scored}, hypotheses)
        metrics["coco_caption"] = suite
        metrics["spice"] = SPICE_NOTE
        for image_id, scores in suite_per_image.items():
            per_image[image_id].update(scores)
    elif coco:
        metrics["coco_caption"] = "skipped: Java was not found (pycocoevalcap needs java on PATH)"
    if correctness.words:
        metrics["attention_correctness"] = correctness.compute()
    write_metrics(out_dir / METRICS_FILE, metrics)
    write_json(out_dir / PER_IMAGE_FILE, [per_image[i] for i in sorted(per_image)])
    metrics["table"] = format_table(metrics, out_dir)
    return metrics, skipped


def format_table(metrics: dict, out_dir: Path) -> str:
    """The metrics as aligned lines, scale stated."""
    scored = f"{metrics['images']} image{'' if metrics['images'] == 1 else 's'} scored"
    lines = [
        f"{scored} ({metrics['skipped_images']} skipped: missing or unreadable); "
        f"scores on the 0-1 scale (x100 for the paper's tables; CIDEr may exceed 1)"
    ]
    if "ensemble" in metrics:
        lines.append(
            f"  decoded by the ensemble of {len(metrics['ensemble'])} models: {', '.join(metrics['ensemble'])}"
        )
    if "hard_inference" in metrics:
        lines.append(f"  decoded with {HardInference(metrics['hard_inference']).describe()}")
    lines += [f"  nltk {name.upper():<10} {value:.4f}" for name, value in metrics["bleu"].items()]
    suite = metrics.get("coco_caption")
    if isinstance(suite, dict):
        lines += [f"  coco {name:<10} {value:.4f}" for name, value in suite.items()]
        lines.append('  coco SPICE      skipped (it needs a download; see "spice" in metrics.json)')
    elif suite:
        lines.append(f"  coco-caption: {suite}")
    if "attention_correctness" in metrics:
        ac = metrics["attention_correctness"]
        lines.append(
            f"  attention correctness {ac['mean_mass']:.3f} over {ac['words']} object words "
            f"(uniform attention would give {ac['uniform_mass']:.3f})"
        )
    lines.append(f"results:   {out_dir / RESULTS_FILE}")
    lines.append(f"metrics:   {out_dir / METRICS_FILE}")
    lines.append(f"per image: {out_dir / PER_IMAGE_FILE}")
    return "\n".join(lines)
