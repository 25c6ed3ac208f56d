"""One trained model scored every way a paper or a reimplementation may score it: nltk corpus BLEU-4 against
coco-caption's BLEU-4 and CIDEr, greedy against beam search, the val split against the test split.

    python benchmarks/scoring_kinds.py outputs/train/runs/<run>                  # the run's own dataset
    python benchmarks/scoring_kinds.py bundle.pt data.source.n_train=300 data.source.n_val=50 data.source.n_test=50
    python benchmarks/scoring_kinds.py outputs/scenes/runs/<run> experiment=scenes

The dataset: with Hydra overrides, the one ``python train.py <overrides>`` trains on (``data.source``); without,
that of the model's run (the config.yaml of its folder). Every row decodes the split once, through ``captioner
evaluate``'s code (``evaluation.report.evaluate_split``, the model's own decoding settings with the row's method),
and reads all its scores from that one decoding:

- nltk BLEU-4: ``evaluation.bleu``, what training validates with: corpus BLEU of the project's tokens (lower case,
  punctuation dropped), n-gram matches and lengths pooled over the split, no smoothing;
- coco BLEU-4, METEOR, CIDEr: ``evaluation.cococaption`` (pycocoevalcap, the scorer of the paper's table and of the
  COCO server): the same captions PTB-tokenised, BLEU pooled over the split as well;
- CIDEr-D (ours): ``evaluation.cider``, the validation's and SCST's CIDEr-D, on the project's tokens;
- mean image BLEU-4: the mean over images of each image's own nltk BLEU-4 (unsmoothed), what averaging sentence
  BLEU gives instead of corpus BLEU.

All on the 0-1 scale (x100 for the paper's tables).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import OmegaConf

import composed
from captioner.config import DecodingConfig, captioning_settings
from captioner.data.readers import Record
from captioner.data.sources import Source
from captioner.data.vocab import tokenize
from captioner.evaluation.cider import corpus_cider_d
from captioner.evaluation.report import PER_IMAGE_FILE, evaluate_split
from captioner.fileio import read_json
from captioner.inference import LoadedModel, load_model
from captioner.run_files import CONFIG_FILE
from tables import print_table

SPLITS = ("val", "test")
COLUMNS = [
    "split", "decoding", "nltk BLEU-4", "coco BLEU-4", "coco METEOR", "coco CIDEr", "CIDEr-D (ours)",
    "mean image BLEU-4", "mean words",
]  # fmt: skip


def dataset_source(model: Path, overrides: list[str]) -> Source:
    """The dataset's source: ``python train.py <overrides>``'s, or with no overrides that of the run ``model`` is
    (its folder, or its bundle.pt or a checkpoint in its checkpoints/: the config.yaml beside them)."""
    if overrides:
        data = composed.compose_config(None, overrides)["data"]
    else:
        folders = [model] if model.is_dir() else [model.parent, model.parent.parent]
        config = next((folder / CONFIG_FILE for folder in folders if (folder / CONFIG_FILE).is_file()), None)
        if config is None:
            raise SystemExit(f"{model}: no {CONFIG_FILE} of its run; name its dataset with train.py's overrides")
        data = OmegaConf.to_container(OmegaConf.load(config).data, resolve=True)
    source = instantiate(data["source"], _convert_="all")
    source.prepare()
    return source


def score_row(loaded: LoadedModel, records: list[Record], decoding: DecodingConfig) -> list[object]:
    """The scores of one decoding of ``records`` (the columns after split and decoding; scores to 4 decimals)."""
    with tempfile.TemporaryDirectory() as out:
        metrics, skipped = evaluate_split(loaded, records, Path(out), decoding=decoding)
        per_image = read_json(Path(out) / PER_IMAGE_FILE, "per-image scores")
    if skipped or not isinstance(metrics.get("coco_caption"), dict):
        raise SystemExit(f"{len(skipped)} images skipped; coco-caption: {metrics.get('coco_caption')}")
    suite = metrics["coco_caption"]
    references = {image["image_id"]: [tokenize(c) for c in image["references"]] for image in per_image}
    captions = {image["image_id"]: image["caption"].split() for image in per_image}
    scores = [
        metrics["bleu"]["bleu4"],
        suite["Bleu_4"],
        suite["METEOR"],
        suite["CIDEr"],
        corpus_cider_d(references, captions),
        sum(image["bleu4"] for image in per_image) / len(per_image),
    ]
    return [*(f"{score:.4f}" for score in scores), sum(map(len, captions.values())) / len(captions)]


def main(argv: list[str] | None = None) -> None:
    """Print the table of the model and dataset named in ``argv`` (the command line when None)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a training run's folder, its bundle.pt, or a checkpoint")
    parser.add_argument("overrides", nargs="*", help="train.py's overrides naming the dataset (default: the run's)")
    parser.add_argument("--beam-size", type=int, default=3, help="the beam rows' width (default: 3)")
    args = parser.parse_args(argv)
    source = dataset_source(args.model, args.overrides)
    loaded = load_model(args.model)
    decodings = {
        "greedy": captioning_settings({"method": "greedy"}, base=loaded.decoding),
        f"beam {args.beam_size}": captioning_settings(
            {"method": "beam", "beam_size": args.beam_size}, base=loaded.decoding
        ),
    }
    rows = []
    for split in SPLITS:
        records = source.records(split)
        for name, decoding in decodings.items():
            rows.append([f"{split} ({len(records)} images)", name, *score_row(loaded, records, decoding)])
    limit = f"at most {loaded.decoding.max_len} words"
    print_table(f"{args.model}: one model scored every way ({limit}; 0-1 scale)", COLUMNS, rows)
    print(
        "\nnltk: the project's tokens, corpus BLEU; coco: pycocoevalcap on PTB tokens; CIDEr-D (ours): validation's "
        "and SCST's, on the project's tokens; mean image BLEU-4: the mean of each image's own nltk BLEU-4"
    )


if __name__ == "__main__":
    main()
