"""Why training's validation BLEU and ``captioner evaluate``'s differ for one trained model, one split.

Training's validation decodes the feature cache (the encoder's frozen stages' output, stored in fp16) with
``model.decoding`` (greedy); ``captioner evaluate`` decodes the images with captioning's settings (beam
search). This script scores the same model on the same split every way that separates the two, one change
per row:

    python benchmarks/validation_agreement.py outputs/train/runs/<run>    # a run folder (its bundle.pt)

Rows: the BLEU-4 in the run's metrics.json; for greedy and for captioning's beam search, the fp16 cache as
training reads it, an fp32 cache and the images (the frozen stages in fp32, no cache), with the number of
captions the cache's fp16 changes; the images through ``captioner evaluate``'s code
(``evaluation.report.evaluate_split``) with greedy decoding and with its default; the trained stages with
BatchNorm in train mode. The seconds are wall time on whatever else the machine runs (images read included).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from captioner.config import DecodingConfig
from captioner.data.dataset import build_transform
from captioner.data.images import load_rgb
from captioner.data.vocab import UNK_ID, tokenize
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.evaluation.report import evaluate_split
from captioner.inference import LoadedModel, load_model
from captioner.run_files import BUNDLE_NAME, CONFIG_FILE, METRICS_FILE
from captioner.training.metrics import PROGRESS, final, metric

BATCH = 125  # the demo's eval_batch_size


def split_records(run: Path, split: str) -> list:
    """The records of ``split`` of the run's dataset (its config.yaml's data.source)."""
    config = OmegaConf.load(run / CONFIG_FILE)
    source = instantiate(config.data.source, _convert_="all")
    source.prepare()
    return source.records(split)


def decode_all(
    loaded: LoadedModel, records: list, features_of: Callable[[torch.Tensor], torch.Tensor], **decode
) -> dict[int, list[str]]:
    """Greedy (or ``decode``) captions of ``records``: images preprocessed as in training, ``features_of``
    turning a batch of them into what ``generate_from_features`` takes."""
    model, vocab = loaded.model, loaded.vocab
    transform = build_transform(loaded.image_size, train=False)
    settings = DecodingConfig(**decode)
    captions: dict[int, list[str]] = {}
    for start in range(0, len(records), BATCH):
        chunk = records[start : start + BATCH]
        images = torch.stack([transform(load_rgb(r.image_path)) for r in chunk])
        with torch.no_grad():
            generation, _ = model.generate_from_features(features_of(images), decoding=settings, unk_id=UNK_ID)
        for row, record in enumerate(chunk):
            captions[record.image_id] = vocab.decode(generation.tokens[row].tolist())
    return captions


def bleu4(records: list, captions: dict[int, list[str]]) -> float:
    """Corpus BLEU-4 (nltk, as training and evaluate score) of ``captions`` against ``records``' references."""
    references = {r.image_id: [tokenize(c) for c in r.captions] for r in records}
    return corpus_bleu_scores(references, captions)["bleu4"]


def main(argv: list[str] | None = None) -> None:
    """Print one Markdown table: each way of scoring, its BLEU-4, and its difference to the images' greedy."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a training run's folder (bundle.pt, config.yaml, metrics.json)")
    parser.add_argument("--split", default="val")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    loaded = load_model(args.run / BUNDLE_NAME)
    model = loaded.model.eval()
    records = split_records(args.run, args.split)

    def cache(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda images: model.encode(images)[0].to(dtype).float()  # stored in dtype, read as fp32

    rows: list[tuple[str, float]] = []
    logged = json.loads((args.run / METRICS_FILE).read_text()).get(final(metric(args.split, PROGRESS)))
    if logged is not None:
        rows.append(("the run's metrics.json (its final validation of the exported checkpoint)", logged))
    captions: dict[tuple[str, str], dict[int, list[str]]] = {}
    method = DecodingConfig.captioning().method.value
    for decoding in ("greedy", method):
        for name, features_of in (
            ("fp16 cache", cache(torch.float16)),
            ("fp32 cache", cache(torch.float32)),
            ("images (no cache)", lambda images: model.encode(images)[0]),
        ):
            started = time.perf_counter()
            captions[name, decoding] = decode_all(loaded, records, features_of, method=decoding)
            seconds = time.perf_counter() - started
            rows.append((f"{name}, {decoding} ({seconds:.0f} s)", bleu4(records, captions[name, decoding])))
        differ = sum(
            captions["fp16 cache", decoding][i] != captions["fp32 cache", decoding][i] for i in captions[name, decoding]
        )
        rows.append((f"{decoding}: captions that differ between the fp16 and the fp32 cache", differ))
    with tempfile.TemporaryDirectory() as out:
        greedy_only = DecodingConfig.captioning(method="greedy")  # as `captioner evaluate --method greedy`
        greedy, _ = evaluate_split(loaded, records, Path(out), BATCH, coco=False, decoding=greedy_only)
        default, _ = evaluate_split(loaded, records, Path(out), BATCH, coco=False)
    rows.append(("captioner evaluate --method greedy", greedy["bleu"]["bleu4"]))
    rows.append((f"captioner evaluate (its default: {method})", default["bleu"]["bleu4"]))
    model.encoder.train()  # frozen stages stay in eval mode; the trained ones use batch statistics
    train_mode = decode_all(loaded, records, lambda images: model.encode(images)[0], method="greedy")
    rows.append(("images, greedy, trained stages' BatchNorm in train mode", bleu4(records, train_mode)))
    model.eval()
    images = bleu4(records, captions["images (no cache)", "greedy"])
    print(f"{args.run} ({args.split}: {len(records)} images)\n")
    print("| scored as | BLEU-4 | minus images, greedy |\n|---|---|---|")
    for name, value in rows:
        if isinstance(value, int):
            print(f"| {name} | {value} of {len(records)} | |")
        else:
            print(f"| {name} | {value:.4f} | {value - images:+.4f} |")


if __name__ == "__main__":
    main()
