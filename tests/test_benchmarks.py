"""Smoke tests of benchmarks/: every script runs on the tiny configuration and prints its tables, and the
benchmarked sizes are the experiments users train.

Benchmarks are not tests: nothing here looks at a time. The only values checked are counts that
do not depend on the machine (how many images the encoder sees, FLOPs) and the composed configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import ROOT, TINY, compose_cfg, net_v1, subprocess_env, tiny_overrides, write_bundle, write_run

BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = (
    "counters",
    "machine",
    "peak",
    "options",
    "composed",
    "tables",
    "clock",
    "train_step",
    "captioning",
    "data_loading",
    "feature_cache",
    "profile_ops",
    "fused_attention",
    "attention_ablation",
    "attention_by_word",
    "scst_step",
    "scst_demo",
    "gallery",
    "self_attention_ablation",
    "gpu_check",
    "validation_agreement",
    "hard_attention_gradient",
    "ensemble",
    "scoring_kinds",
    "beam_kernels",
)


@pytest.fixture
def run_tiny(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., str]]:
    """``run_tiny(script, *extra)``: the script's ``main(["--tiny", "--threads", "1", *extra])`` in this
    process (no second torch import), as ``python benchmarks/<script>.py --tiny`` runs it; returns its output.

    One thread: on a shared machine two threads of tiny operators spend most of their time waiting for each other.
    """
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their neighbours (composed.py, clock.py, ...)

    def run(script: str, *extra: str) -> str:
        importlib.import_module(script).main(["--tiny", "--threads", "1", *extra])
        stdout = capsys.readouterr().out
        assert stdout.startswith("## ") and "- device: cpu" in stdout, stdout
        assert "- load average at end" in stdout or not hasattr(os, "getloadavg"), stdout
        return stdout

    yield run
    for name in SCRIPTS:  # they are not the test suite's modules
        sys.modules.pop(name, None)


def table(stdout: str, title: str, rows: int) -> list[dict[str, str]]:
    """The ``rows`` rows of the Markdown table printed under ``### title``, as column -> cell."""
    assert f"### {title}\n" in stdout, stdout
    lines = stdout.split(f"### {title}\n", 1)[1].strip().splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    body = [line for line in lines[2 : 2 + rows] if line.startswith("|")]
    assert len(body) == rows and not any(line.startswith("|") for line in lines[2 + rows : 3 + rows]), stdout
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in body]


def test_train_step_runs_and_the_encoder_sees_each_image_once(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("train_step")
    rows = table(stdout, "Training step: encoder + decoder + loss + backward + Adam", 5)
    assert [(row["attention"], row["input"]) for row in rows] == [
        ("soft", "images"),
        ("soft", "cached features"),
        ("hard", "images"),
        ("hard", "cached features"),
        ("soft", "images, per caption"),
    ]
    # 2 images with 5 captions each: the CNN sees 2 images per step, 10 in the per-caption layout, 0 from the cache
    assert [row["CNN images/step"] for row in rows] == ["2", "0", "2", "0", "10"]
    assert all(row["images x captions"] == "2 x 10" for row in rows)
    # FLOPs are counted, not timed: the cache saves the frozen stem's, the per-caption layout runs the CNN 5x
    soft_images, soft_cached, hard_images, hard_cached, per_caption = (float(row["GFLOP"]) for row in rows)
    assert 0 < soft_cached < soft_images < per_caption and (hard_images, hard_cached) == (soft_images, soft_cached)
    rows = table(stdout, "Decoder-only training step given features", 4)
    layouts = [(row["attention"], row["captions"]) for row in rows]
    assert layouts == [(a, c) for a in ("soft", "hard") for c in ("K per image", "gathered")]


def test_beam_kernels_counts_the_operators_of_one_call_that_compute(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("beam_kernels", "--top", "5")
    (row,) = table(stdout, "Beam search (beam 3), batch 1: operators that compute (a GPU kernel each)", 1)
    assert (row["size"], row["beam"], row["words"]) == ("tiny", "3", "4")  # never ending: every word decoded
    assert float(row["kernels/word"]) == pytest.approx(int(row["kernels/call"]) / 4, rel=1e-2)
    top = table(stdout, "tiny: the 5 commonest operators", 5)
    assert all(not row["operator"].startswith(("aten.view", "aten.t", "aten.select")) for row in top)  # views
    assert sum(int(row["per call"]) for row in top) < int(row["kernels/call"])


def test_kernel_counter_counts_what_computes_not_views(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    counters = importlib.import_module("counters")
    sys.modules.pop("counters")  # not the test suite's module
    x = torch.randn(3, 4)
    with counters.KernelCounter() as counted:
        y = (x.t().unsqueeze(0).view(4, 3) + 1).sum()  # three views, an add, a sum
        y.mul_(2)
    assert dict(counted.kernels) == {"aten.add": 1, "aten.sum": 1, "aten.mul_": 1}


def test_captioning_runs_and_the_encoder_sees_each_image_once(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("captioning")
    rows = table(stdout, "Captioning throughput (images to captions)", 5)
    assert [row["pipeline"] for row in rows] == [
        "encoder alone",
        "encoder + greedy",
        "encoder + beam 3",
        "encoder + beam 5",
        "Captioner.generate(beam 3), one call",
    ]
    assert all(row["CNN images"] == "2" for row in rows)  # once per image, whatever the beam size
    assert [row["words"] for row in rows[1:4]] == ["4", "4", "4"]  # <end> suppressed: always max_len words
    rows = table(stdout, "Beam search (beam 3) from features against the batch size", 2)
    assert [row["batch"] for row in rows] == ["1", "2"]
    # the same Python work at every batch size: no loop over images, no host read per step
    assert rows[0]["torch calls/call"] == rows[1]["torch calls/call"]
    assert rows[0]["host reads/call"] == rows[1]["host reads/call"]


def test_data_loading_runs(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("data_loading", "--workers", "0", "1")
    rows = table(stdout, "Data loading against the training step", 10)
    assert [(row["source"], row["workers"]) for row in rows] == [
        ("JPEG 640x480 -> 64 px", "0 (main process)"),
        ("JPEG 640x480 -> 64 px", "1"),
        ("JPEG 640x480 -> 64 px, decoded on cpu", "0 (main process)"),  # data.decode=device
        ("JPEG 640x480 -> 64 px, decoded on cpu", "1"),
        ("shards of the JPEGs -> 64 px", "0 (main process)"),
        ("shards of the JPEGs -> 64 px", "1"),
        ("shards of the JPEGs -> 64 px, decoded on cpu", "0 (main process)"),
        ("shards of the JPEGs -> 64 px, decoded on cpu", "1"),
        # the demo trains layer2, so its cache holds layer1's map: 16x16x64 at 64 px
        ("fp16 cache 256x64", "0 (main process)"),
        ("fp16 cache 256x64", "1"),
    ]


def test_feature_cache_runs_and_measures_each_build(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("feature_cache")
    rows = table(stdout, "Peak memory of a feature cache build", 2)
    assert [(row["experiment"], row["images"], row["chunk (images)"]) for row in rows] == [
        ("tiny", "3", "125"),  # the demo's eval batch: one chunk
        ("tiny", "7", "125"),
    ]
    assert rows[0]["cached per image"] == "256 x 64"  # layer1's 16x16x64 map at 64 px
    assert all(float(row["peak RSS MiB"].replace(",", "")) > float(row["added MiB"]) > 0 for row in rows)


def test_gallery_runs_every_stage_and_both_commands(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("gallery")
    rows = table(stdout, "Gallery stages, per image", 7)
    assert [row["stage"] for row in rows] == [
        "caption", "decode", "shade", "sheet", "strip", "pages and copies", "total"
    ]  # fmt: skip
    assert all(row["images"] == "4" and row["words"] == "3" for row in rows)  # never-ending captions: 3 words
    rows = table(stdout, "Drawing one image, per piece", 6)
    assert [row["piece"] for row in rows] == [
        "shade", "sheet picture", "sheet JPEG (memory)", "strip picture", "strip JPEG (memory)", "files: sheet + strip"
    ]  # fmt: skip
    assert all(row["words"] == "3" and float(row["ms/image"].replace(",", "")) > 0 for row in rows)
    rows = table(stdout, "Whole commands", 2)
    assert [row["command"] for row in rows] == ["captioner caption", "captioner attend"]
    assert rows[0]["vs caption"] == "1"


@pytest.mark.parametrize("experiment", ["demo", "coco_soft", "coco_hard"])
def test_benchmarked_sizes_are_the_experiments_as_train_py_composes_them(
    monkeypatch: pytest.MonkeyPatch, experiment: str
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    composed = importlib.import_module("composed")
    attention = "hard" if experiment == "coco_hard" else "soft"
    trained = composed.compose_config(experiment)
    for quick in (False, True):
        args = argparse.Namespace(tiny=False, quick=quick, channels_last=False)
        size = composed.setup(experiment, args, attention)
        # the model as trained but for random weights; the data as trained but for --quick's COCO batch
        assert size.cfg["model"] == {**trained["model"], "encoder": {**trained["model"]["encoder"], "weights": None}}
        batch = 8 if quick and experiment != "demo" else trained["data"]["batch_size"]
        assert size.cfg["data"] == {**trained["data"], "batch_size": batch}
    if experiment == "demo":  # what `python train.py` trains: the demo experiment is the default config
        plain = composed.compose_config(None)
        assert (plain["model"], plain["data"]) == (trained["model"], trained["data"])
        assert len(size.vocab) == 4 + 44  # the specials and the training captions' words seen 5 times or more
    else:
        assert len(size.vocab) == 4 + 10_000  # data.max_vocab words


def test_profile_runs(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("profile_ops")
    assert "### training step, soft, 2 images x 10 captions" in stdout
    assert "### decoder-only training step, soft, 2 images x 10 captions" in stdout
    assert "### beam search, beam 3, 2 images from features" in stdout
    assert stdout.count("Self CPU time total") == 3


def test_fused_attention_times_both_reads_and_profiles_each(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("fused_attention", "--rows", "40")
    rows = table(stdout, "Decoder-only training step, the attention read eager and fused", 2)
    assert [(row["read"], row["step"], row["images x captions"]) for row in rows] == [
        ("eager", "eager", "2 x 10"), ("fused", "eager", "2 x 10")
    ]  # fmt: skip
    assert rows[0]["vs eager read"] == "" and float(rows[1]["vs eager read"]) > 0
    assert "### decoder-only training step, fused read, eager, tiny, 2 images" in stdout
    assert stdout.count("Self CPU time total") == 2 and "CompiledFunctionBackward" in stdout  # the read's backward


def test_self_attention_ablation_times_the_blocks_against_the_decoder_step(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("self_attention_ablation", "--parts", "coco", "--coco-batch", "2")
    rows = table(stdout, "the tiny demo, 2 images x 5 captions, cpu", 3)
    assert [row["what"] for row in rows] == [
        "decoder step (0 blocks)", "1 absolute block, forward+backward", "1 relative block, forward+backward"
    ]  # fmt: skip
    assert all(row["L"] == "64" for row in rows) and rows[0]["params"] == "0"  # the tiny demo's 8x8 grid
    assert int(rows[2]["params"].replace(",", "")) > int(rows[1]["params"].replace(",", "")) > 0  # + relative bias
    ablation, options = (importlib.import_module(name) for name in ("self_attention_ablation", "options"))
    args = options.parse(options.make_parser(""), ["--tiny", "--threads", "1"])
    steps = ablation.demo_steps(args)  # the demo part's timing, without its four training runs
    assert list(steps) == list(ablation.VARIANTS)
    assert steps["0 blocks"][2] == 0 < steps["1 absolute"][2] < steps["1 relative"][2] < steps["2 relative"][2]
    assert all(seconds > 0 and trainable > blocks for seconds, trainable, blocks in steps.values())


@pytest.mark.parametrize("script", ["train_step", "captioning"])
def test_gpu_options_run_on_cpu(run_tiny: Callable[..., str], script: str) -> None:
    # the options a GPU run uses (bf16 autocast, channels-last CNN) take the same code path on the CPU
    stdout = run_tiny(script, "--precision", "bf16", "--channels-last")
    assert "- precision bf16, channels-last True" in stdout
    # 5 rows in the first table of each, 2 in captioning's second, 4 in train_step's (two layouts of captions)
    assert stdout.count("\n| tiny ") == {"train_step": 9, "captioning": 7}[script]


def test_attention_ablation_scores_named_shapes_by_scene_size(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from captioner.fileio import read_json, write_json

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    ablation = importlib.import_module("attention_ablation")
    shapes = ablation.scene_shapes(ablation.read_instances(tiny_shapes / "annotations" / "instances_val.json"))
    first_reference = {}
    for ann in read_json(tiny_shapes / "annotations" / "captions_val.json")["annotations"]:
        first_reference.setdefault(ann["image_id"], ann["caption"])
    runs = {"copies": first_reference, "red_circle": {i: "a red circle" for i in first_reference}}
    for name, captions in runs.items():
        (tmp_path / name).mkdir()
        write_json(tmp_path / name / "val_captions.json", [{"image_id": i, "caption": c} for i, c in captions.items()])
    ablation.main([str(tmp_path / name) for name in runs] + ["--data", str(tiny_shapes)])
    sys.modules.pop("attention_ablation")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()[2:]]
    cells = {(run, int(size)): [float(x) for x in rest] for run, size, *rest in rows if size != "all"}
    overall = {run: (int(images), float(bleu4)) for run, size, images, bleu4, *_ in rows if size == "all"}
    sizes = sorted({len(s) for s in shapes.values()})
    assert sorted(cells) == sorted((run, size) for run in [*runs, "perfect content"] for size in sizes)
    assert overall["copies"] == (len(first_reference), 1.0)
    assert 0.5 < overall["perfect content"][1] < 1.0  # right shapes, but not the references' order or wording
    assert all(cells[("perfect content", size)][2:] == [1.0, 1.0] for size in sizes)
    for size in sizes:
        ids = [i for i in first_reference if len(shapes[i]) == size]
        images, bleu4, precision, _ = cells[("copies", size)]
        assert images == len(ids) and bleu4 == 1.0 and precision == 1.0  # a reference names only what is there
        images, _, precision, recall = cells[("red_circle", size)]
        with_red_circle = sum(("red", "circle") in shapes[i] for i in ids)
        assert precision == pytest.approx(with_red_circle / len(ids), abs=5e-4)
        assert recall == pytest.approx(with_red_circle / (size * len(ids)), abs=5e-4)


def test_attention_by_word_measures_each_named_objects_words_in_its_own_box(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from captioner.data.readers import Box

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    by_word = importlib.import_module("attention_by_word")
    red, blue = Box("circle", 0.0, 0.0, 0.5, 0.5), Box("circle", 0.5, 0.5, 1.0, 1.0)
    objects = {("red", "circle"): red, ("blue", "circle"): blue}
    words = "a blue circle and a red circle and a green square".split()
    assert by_word.phrases(words, objects) == ([(1, 2, blue), (5, 6, red)], 1)  # green square: not there
    run = write_run(tmp_path / "run", None)  # an untrained model's bundle
    by_word.main([str(run), "--data", str(tiny_shapes)])
    sys.modules.pop("attention_by_word")
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert sum(int(row[1]) for row in rows[1:]) == 24  # every test image, by scene size
    for row in rows[1:]:
        assert 0.0 <= float(row[4]) <= 1.0 and 0.0 <= float(row[5]) <= 1.0


def test_validation_agreement_scores_a_run_every_way(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from omegaconf import OmegaConf

    from captioner.fileio import write_json
    from captioner.run_files import CONFIG_FILE, METRICS_FILE

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    run = write_run(tmp_path / "run", None)  # an untrained model's bundle
    OmegaConf.save(compose_cfg(tiny_overrides(tiny_shapes, tmp_path), tmp_path), run / CONFIG_FILE, resolve=True)
    write_json(run / METRICS_FILE, {"final/val/bleu4": 0.25})
    importlib.import_module("validation_agreement").main([str(run)])
    sys.modules.pop("validation_agreement")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run} (val: 24 images)"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    assert [re.sub(r" \(\d+ s\)$", "", row[0]) for row in rows[1:]] == [  # without the decodings' seconds
        "the run's metrics.json (its final validation of the exported checkpoint)",
        "fp16 cache, greedy",
        "fp32 cache, greedy",
        "images (no cache), greedy",
        "greedy: captions that differ between the fp16 and the fp32 cache",
        "fp16 cache, beam",
        "fp32 cache, beam",
        "images (no cache), beam",
        "beam: captions that differ between the fp16 and the fp32 cache",
        "captioner evaluate --method greedy",
        "captioner evaluate (its default: beam)",
        "images, greedy, trained stages' BatchNorm in train mode",
    ]
    assert rows[1][1] == "0.2500" and rows[5][1].endswith(" of 24") and rows[9][1].endswith(" of 24")
    assert all(0.0 <= float(row[1]) <= 1.0 for row in rows[1:] if "differ" not in row[0])


def test_scoring_kinds_scores_one_model_every_way(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One bundle, the dataset named by train.py's overrides: val and test, greedy and beam 3, each scored by
    nltk, coco-caption and our CIDEr-D; a bundle outside a run folder, without overrides, is refused."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    words = ["a", "red", "blue", "circle", "square", "triangle"]
    bundle = write_bundle(tmp_path / "bundle.pt", words, favoured=["a", "red", "circle"])  # 20 words, never ending
    data = [f"data.source.root={tiny_shapes}", *(f"data.source.{k}={v}" for k, v in dataclasses.asdict(TINY).items())]
    scoring = importlib.import_module("scoring_kinds")
    with pytest.raises(SystemExit, match="no config.yaml of its run"):
        scoring.main([str(bundle)])
    scoring.main([str(bundle), *data])
    title = f"{bundle}: one model scored every way (at most 20 words; 0-1 scale)"
    rows = table(capsys.readouterr().out, title, 4)
    assert [(row["split"], row["decoding"]) for row in rows] == [
        ("val (24 images)", "greedy"),
        ("val (24 images)", "beam 3"),
        ("test (24 images)", "greedy"),
        ("test (24 images)", "beam 3"),
    ]
    for row in rows:  # the captions and references hold no punctuation: both tokenisations give the same words
        assert row["nltk BLEU-4"] == row["coco BLEU-4"] and row["coco CIDEr"] == row["CIDEr-D (ours)"], row
        assert 0.0 <= float(row["mean image BLEU-4"]) <= 1.0 and 0.0 <= float(row["coco METEOR"]) <= 1.0, row
        assert float(row["coco CIDEr"]) > 0.0, row  # "a", "red" and "circle" are words of the references
        assert row["mean words"] == "20", row


def test_hard_attention_gradient_resamples_each_estimator(
    tiny_shapes: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    data = [f"data.source.root={tiny_shapes}", *(f"data.source.{k}={v}" for k, v in dataclasses.asdict(TINY).items())]
    tiny = ["data.batch_size=2", "data.num_workers=0", *(f"model.decoder.{k}_dim=16" for k in ("embed", "hidden"))]
    importlib.import_module("hard_attention_gradient").main(["--resamples", "2", *data, *tiny])
    sys.modules.pop("hard_attention_gradient")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("one demo batch: 2 images, 10 captions; 2 resamples per estimator;")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    assert [row[0] for row in rows] == ["estimator", "sequence", "word", "suffix", "gumbel"]
    assert all(-1.0 <= float(row[1]) <= 1.0 and float(row[2]) > 0 for row in rows[1:])


def test_scst_step_times_the_reward_inside_the_step(run_tiny: Callable[..., str]) -> None:
    stdout = run_tiny("scst_step")
    rows = table(stdout, "SCST step: rollout + CIDEr-D reward + self-critical loss + backward + Adam", 4)
    assert [(row["attention"], row["baseline"]) for row in rows] == [
        ("soft", "mean"),
        ("soft", "greedy"),
        ("hard", "mean"),
        ("hard", "greedy"),
    ]
    assert all(row["images x samples"] == "2 x 5" and 0 < float(row["reward %"]) < 100 for row in rows)


def test_scst_demo_compares_models_on_bleu_cider_and_repeated_bigrams(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from captioner.bundle import save_bundle
    from captioner.data.vocab import Vocabulary
    from captioner.model.captioner import build_captioner

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    demo = importlib.import_module("scst_demo")
    assert demo.repeats_a_bigram("a red circle and a red square".split())
    assert not demo.repeats_a_bigram("a red circle and a blue circle".split())
    config = {
        "encoder": {"name": "resnet18", "weights": None, "grid": 2},
        "decoder": {"embed_dim": 8, "hidden_dim": 8, "attention_dim": 8},
    }
    vocab = Vocabulary(["a", "red", "circle"])
    net = net_v1(config)
    model = build_captioner(net, len(vocab))
    save_bundle(tmp_path / "random.pt", model, vocab, net, {"image_size": 64})
    demo.main([str(tmp_path / "random.pt"), "--data", str(tiny_shapes)])
    sys.modules.pop("scst_demo")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("24 val images")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    assert [row[:2] for row in rows] == [
        ["model", "decoding"],
        ["references", "written"],
        ["random.pt", "greedy"],
        ["random.pt", "beam 3"],
    ]
    assert all(float(row[2]) >= 0 and float(row[3]) >= 0 for row in rows[2:])


def test_gpu_check_lists_its_parts_and_refuses_a_machine_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_check = importlib.import_module("gpu_check")
    sys.modules.pop("gpu_check")  # not the test suite's module
    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    assert all(f"  {title} ({limit} s)" in listed for title, _, limit in gpu_check.PARTS) and len(gpu_check.PARTS) == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().err == "error: gpu_check needs a CUDA device and torch sees none on this machine\n"


def test_ensemble_scores_each_run_alone_and_their_ensemble(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from omegaconf import OmegaConf

    from captioner.run_files import CONFIG_FILE

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    runs = [write_run(tmp_path / name, None) for name in ("one", "two")]  # untrained models of one vocabulary
    for run in runs:
        OmegaConf.save(compose_cfg(tiny_overrides(tiny_shapes, tmp_path), tmp_path), run / CONFIG_FILE, resolve=True)
    importlib.import_module("ensemble").main([*map(str, runs), "--method", "greedy", "--no-coco"])
    stdout = capsys.readouterr().out
    assert stdout.startswith("24 val and 24 test images; decoding DecodingConfig(method=<DecodeMethod.greedy")
    rows = table(stdout, "models alone and as an ensemble", 5)
    ensembles = [f"ensemble of the 2, mean of {kind}" for kind in ("log-probabilities", "probabilities")]
    assert [row["model"] for row in rows] == ["one", "two", "mean of the 2 alone", *ensembles]
    assert all(0.0 <= float(row["val BLEU-4"]) <= 1.0 and row["test CIDEr-D"] == "n/a" for row in rows)
    assert all(0 <= float(row["val words"]) <= 20 and 0 <= float(row["test % shapes named"]) <= 100 for row in rows)
    title = "where an ensemble's captions part from its members' (per-image nltk BLEU-4 on the images it parts)"
    apart = table(stdout, title, 4)
    assert [(row["ensemble"], row["split"]) for row in apart] == [(e, s) for e in ensembles for s in ("val", "test")]
    for row in apart:  # every image is either one of the members' captions or counted apart
        assert 0.0 <= float(row["% a member's caption"]) <= 100.0, row
        assert round(24 * (1 - float(row["% a member's caption"]) / 100)) == int(row["images apart"]), row


def test_init_vocab_counts_the_words_each_setting_reads_as_unk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bundle = write_bundle(tmp_path / "shapes.pt", ["a", "red", "circle", "and"])
    importlib.import_module("init_vocab").main(["--bundle", str(bundle), "--epochs", "0", "--sizes", "8,16"])
    sys.modules.pop("init_vocab")
    (small, large) = table(capsys.readouterr().out, "Training words read as <unk>", 2)
    assert (small["training images"], large["training images"]) == ("8", "16")
    for row in (small, large):
        keep, grow = (float(row[f"{name}: <unk>"].split("(")[1].rstrip("%)")) for name in ("keep", "grow"))
        assert keep > 50 > grow and int(row["words grow adds"]) > 5  # the scenes' words, most seen 5 times or more


def test_named_shapes_right_is_the_precision_and_recall_of_the_captions_colour_shape_phrases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    ensemble = importlib.import_module("ensemble")
    images = [
        {"image_id": 1, "caption": "a red circle and a blue square"},  # both right
        {"image_id": 2, "caption": "a red square and a green circle"},  # one colour bound to the other's shape
    ]
    shapes = {1: {("red", "circle"), ("blue", "square")}, 2: {("red", "circle"), ("green", "square")}}
    assert ensemble.named_shapes_right(images, shapes) == (pytest.approx(100 * 2 / 4), pytest.approx(100 * 2 / 4))
    shapes[1].add(("blue", "triangle"))  # a shape no caption names: recall only
    assert ensemble.named_shapes_right(images, shapes) == (pytest.approx(50.0), pytest.approx(100 * 2 / 5))
    right, named = ensemble.named_shapes_right(images, None)  # not a shapes set
    assert right != right and named != named


def test_each_hand_mutation_names_source_that_occurs_once_and_tests_that_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/mutations.py (docs/testing.md's table) mutates text that is in the package once, and lists tests
    that are collected: code that moved or a test renamed fails here, not silently in the table."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    mutations = importlib.import_module("mutations")
    assert len(mutations.MUTATIONS) == 7
    for mutation in mutations.MUTATIONS:
        assert mutations.occurrences(mutation) == 1, mutation
        for test in mutation.tests + mutation.slow:
            file, name = test.split("::")
            assert re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.M), test
    documented = (ROOT / "docs" / "testing.md").read_text()
    assert all(f"`{mutation.name}`" in documented for mutation in mutations.MUTATIONS)


@pytest.mark.slow
def test_the_coco_shaped_set_trains_under_ddp_with_its_unreadable_images_counted(tmp_path: Path) -> None:
    """gpu_check's DDP part, on two gloo processes: a user's captions file with 5 to 7 captions per image and cut
    files trains through train.py, K = 5 captions per image, the unreadable images skipped and named."""
    import csv
    from collections import Counter

    overrides = ["--train", "40", "--val", "8", "--test", "8", "trainer=ddp_cpu", "data.batch_size=8", "test=false"]
    overrides += [f"paths.log_dir={tmp_path / 'logs'}", f"paths.cache_dir={tmp_path / 'cache'}", "data.num_workers=0"]
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "coco_shaped.py"), str(tmp_path / "set"), *overrides],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with (tmp_path / "set" / "captions.csv").open(encoding="utf-8") as rows:
        counts = Counter(Counter(row["image"] for row in csv.DictReader(rows)).values())
    assert counts == {5: 34, 6: 11, 7: 11}  # 56 images: 5 + (0, 0, 1, 0, 2)[i % 5] captions
    output = proc.stdout + proc.stderr
    assert "data.captions_per_image=5, the most common caption count of the training images (24 of 40)" in output
    cut = {f"{i + 1:06d}.png" for i in (1, 14, 27)}  # the training images coco_shaped.py cut short
    skipped = set(re.findall(r"images/train/(\d{6}\.png) \(truncated or corrupt image data", output))
    assert skipped == cut, skipped
    assert re.search(r"validation BLEU .*\n  BLEU-1 0\.\d+", output)
    assert "It is recommended to use `self.log(" not in output  # every rank logs the same scores: no warning
