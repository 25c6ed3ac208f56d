"""Unusable models and arguments of ``captioner caption``: every bad model file (missing, corrupt, a pickle that
runs code, a newer or altered bundle, ...) and every bad or ignored option is one line on stderr and exit 2, never
a traceback, and nothing is written."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from captioner import cli
from captioner.cli import options
from captioner.data.vocab import Vocabulary
from cli_helpers import QUICK, WORDS, one_error_line
from conftest import tampered


class _RunsCode:
    """Unpickling this would call os.makedirs: a stand-in for a pickle that runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker),)


def _swap_two_words(raw: dict) -> None:
    words = raw["vocab"]["words"]
    words[-1], words[-2] = words[-2], words[-1]


def _other_vocabulary(raw: dict) -> None:
    bigger = Vocabulary([*WORDS, "purple"])
    raw["vocab"], raw["vocab_fingerprint"] = bigger.to_dict(), bigger.fingerprint()


BAD_MODELS: dict[str, tuple[Callable[[str, Path], None] | None, str]] = {
    "missing": (None, "model file not found"),
    "folder without a bundle": (lambda bundle, path: path.mkdir(), "is a folder without bundle.pt"),
    "garbage bytes": (lambda bundle, path: path.write_bytes(b"PK" + os.urandom(4096)), "truncated or corrupt"),
    "text": (lambda bundle, path: path.write_text("hello"), "is not a model file"),
    "truncated": (lambda bundle, path: path.write_bytes(Path(bundle).read_bytes()[:50_000]), "truncated or corrupt"),
    "pickle that runs code": (
        lambda bundle, path: torch.save({"x": _RunsCode(path.with_suffix(".ran"))}, path),
        "refused",
    ),
    "a tensor": (
        lambda bundle, path: torch.save(torch.zeros(3), path),
        "neither a captioner bundle nor a training checkpoint",
    ),
    "newer bundle": (
        lambda bundle, path: tampered(bundle, path, lambda raw: raw.update(version=99)),
        "bundle version 99 is newer",
    ),
    "altered vocabulary": (lambda bundle, path: tampered(bundle, path, _swap_two_words), "the vocabulary was altered"),
    "other vocabulary": (
        lambda bundle, path: tampered(bundle, path, _other_vocabulary),
        "the vocabulary has 15 words but the decoder.embedding weights have 14 rows",
    ),
    "other config": (
        lambda bundle, path: tampered(bundle, path, lambda raw: raw["config"]["decoder"].update(hidden_dim=32)),
        "shape mismatch",
    ),
    "no image size": (
        lambda bundle, path: tampered(bundle, path, lambda raw: raw.pop("preprocess")),
        "has no preprocessing settings",
    ),
    "foreign checkpoint": (
        lambda bundle, path: torch.save({"pytorch-lightning_version": "2.4.0", "state_dict": {}}, path),
        'has no "captioner" entry',
    ),
}


@pytest.mark.parametrize("kind", list(BAD_MODELS))
def test_a_bad_model_file_is_one_line_and_exit_2(kind, bundles, inputs, tmp_path, capsys):
    make, reason = BAD_MODELS[kind]
    path = tmp_path / "model.pt"
    if make is not None:
        make(bundles["soft"], path)
    assert cli.main(["caption", inputs[1][0], "--model", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    one_error_line(err, path, reason)
    assert not path.with_suffix(".ran").exists()  # the pickled call never ran


@pytest.mark.parametrize(
    "option, message",
    [
        (["--beam-size", "0"], "--beam-size=0 must be in [1, 32]"),
        (["--max-len", "0"], "--max-len=0 must be in [1, 100]"),
        (["--batch-size", "0"], "--batch-size=0 must be >= 1"),
        (["--workers", "-1"], "--workers=-1 must be >= 0"),
        (["--method", "sample", "--temperature", "0"], "--temperature=0.0 must be in [1e-06, 100.0]"),
        (["--min-len", "20"], "--min-len=20 must be < --max-len=20"),
        (["--no-repeat-ngram-size", "-1"], "--no-repeat-ngram-size=-1 must be in [0, 100]"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: CUDA is not available on this machine; use --device cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
        (["--device", "gpu7"], "--device 'gpu7' is not a device; use auto, cpu, cuda or cuda:N"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(option, message, bundles, inputs, capsys):
    assert cli.main(["caption", inputs[1][0], "--model", bundles["soft"], *option]) == 2
    assert capsys.readouterr() == ("", f"error: {message}\n")


@pytest.mark.parametrize(
    "option, message",
    [
        (["--method", "greedy", "--beam-size", "5"], "--beam-size goes with --method beam or --method diverse; this "
         "command decodes with --method greedy"),
        (["--temperature", "0.5"], "--temperature goes with --method sample; this command decodes with --method beam "
         "(the default)"),
        (["--method", "beam", "--seed", "1"], "--seed goes with --method sample; this command decodes with --method "
         "beam (the default)"),
        (["--method", "sample", "--length-penalty", "1"], "--length-penalty goes with --method beam or --method "
         "diverse; this command decodes with --method sample"),
        (["--groups", "3"], "--groups goes with --method diverse; this command decodes with --method beam (the "
         "default)"),
        (["--method", "greedy", "--n-best", "2"], "--n-best goes with --method beam or --method diverse; this command "
         "decodes with --method greedy"),
        (["--top-p", "0.9"], "--top-p goes with --method sample; this command decodes with --method beam (the "
         "default)"),
        (["--method", "sample", "--top-k", "-1"], "--top-k=-1 must be in [0, 1000000]"),
        (["--n-best", "4"], "--n-best=4 must be <= --beam-size=3: a beam search keeps --beam-size captions"),
        (["--method", "diverse", "--beam-size", "4"], "--beam-size=4 must be a multiple of --groups=3: diverse beam "
         "search shares the beams out evenly"),
    ],
)  # fmt: skip
def test_an_option_the_method_ignores_is_refused(option, message, bundles, inputs, capsys):
    assert cli.main(["caption", inputs[1][0], "--model", bundles["soft"], *option]) == 2
    assert capsys.readouterr() == ("", f"error: {message}\n")


def test_out_without_image_info_says_what_it_is_for(bundles, inputs, tmp_path, capsys):
    image = inputs[1][0]
    assert cli.main(["caption", image, "--model", bundles["soft"], "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr() == (
        "",
        "error: --out goes with --image-info (the COCO image list whose results file --out receives); the "
        "captions of IMAGE arguments are printed on stdout: redirect it to keep them (> captions.tsv)\n",
    )
    assert cli.main(["caption", image, "--model", bundles["soft"], "--images", "x", "--force"]) == 2
    assert capsys.readouterr().err.startswith("error: --images, --force go with --image-info")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["evaluate", "server", "gallery", "overlay"])
def test_an_out_that_cannot_be_written_is_refused_before_the_model_loads(
    command, bundles, shapes, tmp_path, monkeypatch, capsys
):
    """Not after an evaluation or a test set captioned for hours: the folder of --out takes no file (here a file
    stands where it would go, as a read-only mount or another user's folder refuses it)."""
    taken = tmp_path / "taken"
    taken.write_text("a file where --out wants a folder")
    out = taken / "results"
    image = sorted((shapes / "images" / "test").glob("*.png"))[0]
    info = tmp_path / "image_info_test2014.json"
    info.write_text(json.dumps({"images": [{"id": 1, "file_name": image.name}]}))
    args = {
        "evaluate": ["evaluate", "--shapes", str(shapes), "--split", "test", "--out", str(out)],
        "server": ["caption", "--image-info", str(info), "--images", str(image.parent), "--out", str(out)],
        "gallery": ["attend", str(image.parent), "--out", str(out)],
        "overlay": ["attend", str(image), "--out", f"{out}.png"],
    }[command]
    monkeypatch.setattr(options, "load", lambda *_: pytest.fail("the model was loaded"))
    assert cli.main([*args, "--model", bundles["soft"], *QUICK]) == 2
    one_error_line(capsys.readouterr().err, f"--out {out}", f"{taken} cannot be written (Not a directory)")
