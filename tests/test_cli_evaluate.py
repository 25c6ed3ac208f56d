"""``captioner evaluate``: COCO results, labelled metrics and per-image scores on a shapes dataset, an unreadable
image reported and the others evaluated; what hard attention read; a missing dataset or misplaced --images refused
in one line; attention correctness, or why there is none; the coco-caption suite when Java is there; a training
checkpoint evaluates like its bundle."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from nltk.translate.bleu_score import sentence_bleu

from captioner import cli
from captioner.data.vocab import tokenize
from captioner.evaluation.cococaption import java_available
from captioner.inference import load_model
from cli_helpers import QUICK, SHAPE_WORDS, WORDS, one_error_line
from conftest import run_train, write_bundle


def _load_results(annotations: Path, results: Path):
    """pycocotools' own check of a results file (its prints silenced)."""
    from pycocotools.coco import COCO

    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(annotations)).loadRes(str(results))


def test_evaluate_writes_coco_results_and_labelled_metrics(bundles, shapes, tmp_path, monkeypatch, capsys):
    data = tmp_path / "shapes"
    shutil.copytree(shapes, data)
    broken = sorted((data / "images" / "test").glob("*.png"))[0]
    broken.write_bytes(broken.read_bytes()[:200])
    monkeypatch.setattr("captioner.evaluation.report.java_available", lambda: False)
    out = tmp_path / "eval"
    args = [
        "evaluate",
        "--model",
        bundles["soft"],
        "--shapes",
        str(data),
        "--split",
        "test",
        "--out",
        str(out),
        "--method",
        "greedy",
        *QUICK,
    ]
    assert cli.main(args) == 1  # an unreadable test image: reported, the others evaluated
    stdout, err = capsys.readouterr()
    one_error_line(err, broken, "truncated or corrupt")
    results = _load_results(data / "annotations" / "captions_test.json", out / "results.json")
    expected_ids = {int(p.stem) for p in (data / "images" / "test").glob("*.png")} - {int(broken.stem)}
    assert set(results.getImgIds()) == expected_ids
    assert all(set(ann["caption"].split()) <= set(SHAPE_WORDS) for ann in results.dataset["annotations"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["scale"].startswith("0-1") and metrics["images"] == 5 and metrics["skipped_images"] == 1
    assert sorted(metrics["bleu"]) == ["bleu1", "bleu2", "bleu3", "bleu4"]
    assert 0.0 < metrics["bleu"]["bleu1"] <= 1.0  # shape names are in the references
    assert metrics["coco_caption"].startswith("skipped: Java was not found")
    correctness = metrics["attention_correctness"]
    assert correctness["words"] > 0 and 0.0 <= correctness["mean_mass"] <= 1.0
    assert "0-1 scale" in stdout and "nltk BLEU4" in stdout and "attention correctness" in stdout
    per_image = json.loads((out / "per_image.json").read_text())
    assert [row["image_id"] for row in per_image] == sorted(expected_ids)
    captions = {ann["image_id"]: ann["caption"] for ann in results.dataset["annotations"]}
    references = json.loads((data / "annotations" / "captions_test.json").read_text())["annotations"]
    for row in per_image:
        assert set(row) == {"image_id", "file", "caption", "references", "bleu1", "bleu2", "bleu3", "bleu4"}
        assert row["caption"] == captions[row["image_id"]] and Path(row["file"]).stem == f"{row['image_id']:06d}"
        assert sorted(row["references"]) == sorted(a["caption"] for a in references if a["image_id"] == row["image_id"])
        expected = sentence_bleu([tokenize(r) for r in row["references"]], row["caption"].split(), weights=(1.0,))
        assert row["bleu1"] == pytest.approx(expected) and 0.0 <= row["bleu4"] <= row["bleu1"] <= 1.0
    assert max(row["bleu1"] for row in per_image) > 0.0
    assert "per image:" in stdout
    assert cli.main(args) == 2 and "pass --force" in capsys.readouterr().err
    (out / "metrics.json").unlink()
    assert cli.main([*args, "--force"]) == 1  # its own files replaced (the unreadable image reported again)
    assert json.loads((out / "metrics.json").read_text())["images"] == 5
    capsys.readouterr()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.json").write_text("mine")  # the user's file where evaluate would write its own
    at = args.index("--out") + 1
    assert cli.main([*args[:at], str(mine), *args[at + 1 :], "--force"]) == 2
    assert "was not written by captioner" in capsys.readouterr().err and (mine / "metrics.json").read_text() == "mine"


def test_evaluate_says_what_hard_attention_read(bundles, shapes, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("captioner.evaluation.report.java_available", lambda: False)
    common = ["evaluate", "--shapes", str(shapes), "--split", "val", "--method", "greedy", *QUICK]
    metrics = {}
    for mode in ("argmax", "expectation", None):
        out = tmp_path / str(mode)
        chosen = [] if mode is None else ["--hard-inference", mode]
        assert cli.main([*common, "--model", bundles["hard"], "--out", str(out), *chosen]) == 0
        stdout = capsys.readouterr().out
        metrics[mode] = json.loads((out / "metrics.json").read_text())
        read = "the most likely location" if mode != "expectation" else "the expected context"
        assert f"decoded with hard attention reading {read} ({mode or 'argmax'})" in stdout
    assert metrics["argmax"]["hard_inference"] == "argmax" and metrics[None]["hard_inference"] == "argmax"
    assert metrics["expectation"]["hard_inference"] == "expectation"
    assert metrics[None]["bleu"] == metrics["argmax"]["bleu"]  # the bundle's own mode is argmax
    soft = tmp_path / "soft"
    assert cli.main([*common, "--model", bundles["soft"], "--out", str(soft), "--hard-inference", "argmax"]) == 2
    message = f"--hard-inference argmax: {bundles['soft']} uses soft attention; the option chooses what a hard"
    assert capsys.readouterr().err.startswith(f"error: {message}") and not soft.exists()
    evaluated = cli.main([*common, "--model", bundles["soft"], "--out", str(soft)])
    assert evaluated == 0 and "hard_inference" not in json.loads((soft / "metrics.json").read_text())
    assert "hard attention" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "dataset, message",
    [
        ([], "give exactly one dataset"),
        (["--karpathy", "split.json"], "--images is required with --karpathy and --coco-captions"),
        (
            ["--shapes", "nowhere"],
            "--shapes nowhere: no generated shapes dataset there (meta.json is missing); python train.py generates "
            "it in data/shapes on first use, captioner shapes --out nowhere generates it there",
        ),
        (["--coco-captions", "captions.json", "--images", "nowhere"], "--coco-captions captions.json: file not found"),
    ],
)
def test_evaluate_refuses_a_missing_dataset(dataset, message, bundles, tmp_path, capsys):
    assert cli.main(["evaluate", "--model", bundles["soft"], *dataset, "--out", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, "", message)


def test_evaluate_says_the_images_are_not_where_images_points(bundles, shapes, tmp_path, capsys):
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    captions = shapes / "annotations" / "captions_test.json"
    common = ["--model", bundles["soft"], "--images", str(empty), "--out", str(tmp_path / "out")]
    for dataset in (["--coco-captions", str(captions)], ["--image-info", str(captions)]):
        assert cli.main(["evaluate", *dataset, *common]) == 2
        err = capsys.readouterr().err.splitlines()[-1]  # --image-info first says it writes the server's file
        assert re.fullmatch(
            rf"error: --images {empty}: (test|captions_test\.json): 0 of 6 images found under {empty} "
            rf"\(e\.g\. {empty}/\d+\.png\); point --images at the folder that holds them",
            err,
        ), err
    assert not (tmp_path / "out").exists()


def test_instances_without_attention_correctness_say_why(bundles, shapes, tmp_path, capsys):
    colours = str(write_bundle(tmp_path / "colours.pt", WORDS, favoured=("red", "blue", "green")))
    annotations = shapes / "annotations"
    dataset = [
        *("--coco-captions", str(annotations / "captions_test.json"), "--images", str(shapes / "images" / "test")),
        *("--instances", str(annotations / "instances_test.json"), "--no-coco", *QUICK, "--method", "greedy"),
    ]
    assert cli.main(["evaluate", "--model", bundles["soft"], *dataset, "--out", str(tmp_path / "shapes")]) == 0
    out, err = capsys.readouterr()
    assert "attention correctness" in out and err == ""  # the shape words name the boxes' categories
    assert cli.main(["evaluate", "--model", colours, *dataset, "--out", str(tmp_path / "colours")]) == 0
    out, err = capsys.readouterr()
    assert "attention correctness" not in out
    assert err == (
        f"note: --instances {annotations / 'instances_test.json'}: no attention correctness, since no generated "
        "caption names an object category of its 6 images with boxes\n"
    )


@pytest.mark.slow
@pytest.mark.skipif(not java_available(), reason="the coco-caption suite needs java")
def test_evaluate_runs_the_coco_caption_suite(bundles, shapes, tmp_path, capsys):
    out = tmp_path / "eval"
    assert (
        cli.main(
            [
                "evaluate",
                "--model",
                bundles["soft"],
                "--shapes",
                str(shapes),
                "--out",
                str(out),
                "--method",
                "greedy",
                *QUICK,
            ]
        )
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    suite = metrics["coco_caption"]  # COCOEvalCap's names, beside nltk's "bleu" section
    assert list(suite) == ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"]
    assert suite["Bleu_1"] == pytest.approx(metrics["bleu"]["bleu1"], abs=0.01)  # same words, PTB-tokenised
    assert "SPICE is not computed" in metrics["spice"]
    assert "coco METEOR" in capsys.readouterr().out
    per_image = json.loads((out / "per_image.json").read_text())
    assert len(per_image) == 6 and all(set(suite) <= set(row) for row in per_image)
    assert max(row["CIDEr"] for row in per_image) > min(row["CIDEr"] for row in per_image) >= 0.0


@pytest.mark.slow
def test_evaluate_a_training_checkpoint_like_its_bundle(shapes, tmp_path, capsys):
    overrides = [
        f"data.source.root={shapes}",
        "data.source.n_train=20",
        "data.source.n_val=6",
        "data.source.n_test=6",
        "data.image_size=64",
        "data.feature_cache=null",
        "data.num_workers=0",
        "data.batch_size=10",
        "data.eval_batch_size=6",
        "model.decoder.embed_dim=16",
        "model.decoder.hidden_dim=16",
        "model.decoder.attention_dim=16",
        "trainer.max_epochs=1",
        "test=false",
        f"paths.log_dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "logger=csv",
        "trainer.enable_progress_bar=false",
    ]
    proc = run_train(overrides)
    bundle = Path(re.search(r"^inference bundle: +(.+)$", proc.stdout, re.MULTILINE).group(1))
    checkpoint = bundle.parent / "checkpoints" / "last.ckpt"
    from_checkpoint, from_bundle = load_model(checkpoint), load_model(bundle)
    assert from_checkpoint.image_size == from_bundle.image_size == 64  # data.image_size travels with the model
    assert from_checkpoint.vocab == from_bundle.vocab and from_checkpoint.config == from_bundle.config
    for name, model in (("checkpoint", checkpoint), ("bundle", bundle)):
        assert (
            cli.main(
                [
                    "evaluate",
                    "--model",
                    str(model),
                    "--shapes",
                    str(shapes),
                    "--out",
                    str(tmp_path / name),
                    "--no-coco",
                    "--method",
                    "greedy",
                    "--workers",
                    "0",
                ]
            )
            == 0
        )
    capsys.readouterr()
    results = [(tmp_path / name / "results.json").read_text() for name in ("checkpoint", "bundle")]
    assert results[0] == results[1] and len(json.loads(results[0])) == 6
