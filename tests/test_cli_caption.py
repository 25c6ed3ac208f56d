"""``captioner caption`` on images: every mode and format Pillow reads captioned, each bad file one line on stderr
(exit 1) while the good ones are still captioned; the TSV and JSON-lines output; the decoding options (beam, n-gram
blocking, a seeded sample); a run folder as --model; --max-pixels for a large image."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys

import pytest
from PIL import Image

import captioner
from captioner import cli
from cli_helpers import MAX_LEN, QUICK, SHAPE_WORDS, before_summary, noise, one_error_line


def test_caption_a_folder_of_every_kind_of_file(bundles, inputs, tmp_path, capsys):
    folder, good, bad = inputs
    missing = str(tmp_path / "missing.jpg")
    code = cli.main(
        ["caption", str(folder), missing, "--model", bundles["soft"], "--max-len", MAX_LEN, "--batch-size", "4"]
    )
    out, err = capsys.readouterr()
    assert code == 1
    rows = [line.split("\t") for line in out.splitlines()]
    assert [row[0] for row in rows] == good  # every good file once, in order; the text file is not an image name
    assert all(len(row[1].split()) == 3 and set(row[1].split()) <= set(SHAPE_WORDS) for row in rows)
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) == len(bad) + 2
    for path, reason in {**bad, missing: "file not found"}.items():
        named = [line for line in lines if line.startswith(f"error: {path}: ")]
        assert len(named) == 1 and reason in named[0], (path, lines)
    assert re.fullmatch(
        rf"summary: {len(good)} captioned, {len(bad) + 1} failed, 1 skipped \(files in folders that are not "
        rf"images, e\.g\. {re.escape(str(folder / 'notes.txt'))}\), \d+\.\d images/s",
        lines[-1],
    )


def test_json_lines_and_decoding_options(bundles, inputs, capsys):
    good = inputs[1][:4]
    common = ["caption", *good, "--model", bundles["soft"], *QUICK, "--json"]
    assert cli.main([*common, "--method", "greedy"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["path"] for row in rows] == good
    for row in rows:
        assert set(row) == {"path", "caption", "score", "tokens"}
        assert row["caption"] == " ".join(row["tokens"]) and len(row["tokens"]) == 3
        assert isinstance(row["score"], float) and row["score"] < 0  # a summed log-probability
    assert cli.main([*common, "--method", "beam", "--beam-size", "1"]) == 0
    beam = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["tokens"] for row in beam] == [row["tokens"] for row in rows]  # a beam of one is greedy
    assert [row["score"] for row in beam] == pytest.approx([row["score"] for row in rows], abs=1e-3)


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_no_repeat_ngram_size_stops_square_square_square(method, bundles, inputs, capsys):
    common = [
        "caption",
        *inputs[1][:4],
        "--model",
        bundles["soft"],
        *QUICK,
        "--method",
        method,
    ]
    assert cli.main(common) == 0
    free = [line.split("\t")[1].split() for line in capsys.readouterr().out.splitlines()]
    assert any(len(set(words)) < len(words) for words in free)  # the shape words repeat
    assert cli.main([*common, "--no-repeat-ngram-size", "1", "--min-len", "2"]) == 0
    blocked = [line.split("\t")[1].split() for line in capsys.readouterr().out.splitlines()]
    assert len(blocked) == 4 and all(len(set(words)) == len(words) == 3 for words in blocked)


def test_tsv_fields_are_escaped_and_json_has_a_record_for_every_input(bundles, tmp_path, capsys):
    odd = tmp_path / "tab\there\nnewline back\\slash.png"
    noise((20, 20)).save(odd)
    missing, empty = tmp_path / "missing.png", tmp_path / "empty"
    empty.mkdir()
    common = ["--model", bundles["soft"], *QUICK]
    assert cli.main(["caption", str(odd), *common]) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()  # one line for the image, two fields
    path, caption = line.split("\t")
    assert path == str(odd).replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
    assert path.encode().decode("unicode_escape") == str(odd) and len(caption.split()) == 3
    before_summary(err, captioned=1, failed=0)

    assert cli.main(["caption", str(odd), str(missing), str(empty), str(tmp_path / "*.gif"), *common, "--json"]) == 1
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row for row in rows if "error" in row] == [
        {"path": str(empty), "error": "folder holds no image files"},
        {"path": str(tmp_path / "*.gif"), "error": "no file matches this pattern"},
        {"path": str(missing), "error": "file not found"},
    ]
    assert [row["path"] for row in rows if "caption" in row] == [str(odd)]
    assert len(before_summary(err, captioned=1, failed=3)) == 3  # each failure also named on stderr


def test_a_file_name_that_is_not_utf8_is_printed_as_its_bytes(bundles, tmp_path, monkeypatch):
    """On a terminal whose encoding is strict UTF-8 (a desktop's en_US.UTF-8 locale) a Latin-1 name from an old
    archive is printed byte for byte, as ls and find print it, so that the path on the line opens the file."""
    latin = tmp_path / os.fsdecode(b"caf\xe9.png")
    noise((20, 20)).save(latin)
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert cli.main(["caption", str(tmp_path), "--model", bundles["soft"], *QUICK]) == 0
    stdout.flush()
    path, caption = stdout.buffer.getvalue().rstrip(b"\n").split(b"\t")
    assert path == os.fsencode(latin) and len(caption.split()) == int(MAX_LEN)


def test_sampling_takes_a_seed(bundles, inputs, capsys):
    args = ["caption", *inputs[1][:6], "--model", bundles["soft"], "--method", "sample", "--workers", "0"]
    captions = []
    for seed in ("1", "1", "2"):
        assert cli.main([*args, "--seed", seed, "--temperature", "3"]) == 0
        captions.append([line.split("\t")[1] for line in capsys.readouterr().out.splitlines()])
    assert captions[0] == captions[1] and len(captions[0]) == 6
    assert captions[0] != captions[2]


def test_model_takes_a_run_folder(bundles, inputs, tmp_path, capsys):
    run = tmp_path / "runs" / "2026-01-01_00-00-00"
    run.mkdir(parents=True)
    shutil.copy(bundles["soft"], run / "bundle.pt")
    image = inputs[1][0]
    common = [image, *QUICK, "--method", "greedy"]
    assert cli.main(["caption", *common, "--model", str(run)]) == 0
    from_folder = capsys.readouterr().out
    assert cli.main(["caption", *common, "--model", str(run / "bundle.pt")]) == 0
    assert from_folder == capsys.readouterr().out and from_folder.startswith(image)
    (run / "bundle.pt").unlink()
    assert cli.main(["caption", *common, "--model", str(run)]) == 2
    one_error_line(capsys.readouterr().err, run, "is a folder without bundle.pt")
    (run / "FAILED").write_text("RuntimeError: CUDA out of memory.\n")  # as a run that failed leaves it
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert cli.main(["caption", *common, "--model", str(run)]) == 2
    assert capsys.readouterr().err == (
        f"error: {run}: this run failed (RuntimeError: CUDA out of memory.), so it has no bundle.pt; give a run "
        f"that finished, or one of its checkpoints ({run / 'checkpoints' / 'last.ckpt'})\n"
    )
    (run / "FAILED").unlink()
    (run / "STOPPED").write_text("training stopped by SIGINT at epoch 0, step 3; ...\n")  # as a Ctrl-C'd run leaves it
    assert cli.main(["caption", *common, "--model", str(run)]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {run}: this run was stopped (training stopped by SIGINT at epoch 0, step 3; ...), so it has no "
        "bundle.pt; give a run that finished, or one of its checkpoints"
    )


def test_max_pixels_lets_a_large_image_through(bundles, tmp_path, monkeypatch, capsys):
    image = tmp_path / "large.png"
    noise((60, 50)).save(image)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2_000)
    args = ["caption", str(image), "--model", bundles["soft"], "--workers", "0"]
    assert cli.main(args) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: {image}: image too large: 60x50 is 3,000 pixels, over the limit of 2,000, refused as a possible "
        "decompression bomb; for a file you trust raise the limit with --max-pixels N (max_pixels=N in Python)"
    )
    assert cli.main([*args, "--max-pixels", "3000"]) == 0
    assert capsys.readouterr().out.startswith(f"{image}\t")
    assert cli.main([*args, "--max-pixels", "0"]) == 2
    assert capsys.readouterr().err == "error: --max-pixels=0 must be >= 1\n"


def test_a_model_decodes_as_its_run_did_unless_an_option_or_keyword_says_otherwise(tmp_path, capsys):
    from captioner import load_model
    from captioner.bundle import save_bundle
    from captioner.config import DecodingConfig
    from conftest import SMALL_IMAGE_SIZE, net_v1, never_ending_captioner

    model, vocab, config = never_ending_captioner(SHAPE_WORDS)  # every caption max_len words long
    image = tmp_path / "photo.png"
    noise((40, 30)).save(image)
    own = DecodingConfig(method="beam", beam_size=2, max_len=4)  # how its run decoded its final scores
    bundle = tmp_path / "model.pt"
    save_bundle(bundle, model, vocab, net_v1(config), {"image_size": SMALL_IMAGE_SIZE}, own)

    def words(*options: str) -> int:
        assert cli.main(["caption", str(image), "--model", str(bundle), "--workers", "0", *options]) == 0
        return len(capsys.readouterr().out.split("\t")[1].split())

    assert words() == 4 and words("--max-len", "2") == 2 and words("--method", "greedy") == 4
    loaded = load_model(bundle)
    assert loaded.decoding == own
    assert len(loaded.caption(image).words) == 4 and len(loaded.caption(image, max_len=3).words) == 3
    assert cli.main(["caption", str(image), "--model", str(bundle), "--min-len", "5"]) == 2  # over its own max_len
    assert capsys.readouterr().err.splitlines() == ["error: --min-len=5 must be < --max-len=4"]


def test_min_len_is_checked_against_the_model_s_own_max_len_and_before_loading_only_against_every_model(
    tmp_path, capsys
):
    from captioner import load_model
    from captioner.bundle import save_bundle
    from captioner.config import DecodingConfig
    from conftest import SMALL_IMAGE_SIZE, net_v1, never_ending_captioner

    model, vocab, config = never_ending_captioner(SHAPE_WORDS)  # every caption max_len words long
    image = tmp_path / "photo.png"
    noise((40, 30)).save(image)
    bundle = tmp_path / "model.pt"
    own = DecodingConfig(method="beam", beam_size=2, max_len=24)  # as experiment=scenes writes
    save_bundle(bundle, model, vocab, net_v1(config), {"image_size": SMALL_IMAGE_SIZE}, own)
    assert len(load_model(bundle).caption(image, min_len=21).words) == 24
    assert cli.main(["caption", str(image), "--model", str(bundle), "--workers", "0", "--min-len", "21"]) == 0
    assert len(capsys.readouterr().out.split("\t")[1].split()) == 24
    missing = str(tmp_path / "missing.pt")  # what no model accepts is refused before the model is read
    for options, message in (
        (["--min-len", "5", "--max-len", "4"], "--min-len=5 must be < --max-len=4"),
        (["--min-len", "100"], "--min-len=100 must be < --max-len=100"),
    ):
        assert cli.main(["caption", str(image), "--model", missing, *options]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("method", ["beam", "diverse"])
def test_n_best_captions_in_json_in_tsv_and_in_the_api(method, bundles, inputs, capsys):
    good = inputs[1][:2]
    common = ["caption", *good, "--model", bundles["soft"], *QUICK, "--method", method, "--beam-size", "4"]
    common += ["--groups", "2", "--diversity", "2"] if method == "diverse" else []
    assert cli.main([*common, "--json"]) == 0
    one_best = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all("n_best" not in row for row in one_best)
    assert cli.main([*common, "--json", "--n-best", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["path"] for row in rows] == good
    for row, alone in zip(rows, one_best):
        listed = row["n_best"]
        assert len(listed) == 3 and listed[0]["caption"] == row["caption"] == alone["caption"]
        assert listed[0]["score"] == row["score"] and [one["score"] for one in listed] == sorted(
            [one["score"] for one in listed], reverse=True
        )
        assert all(one["caption"] == " ".join(one["tokens"]) and len(one["tokens"]) == 3 for one in listed)
        assert len({one["caption"] for one in listed}) == 3
    assert cli.main([*common, "--n-best", "3"]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert lines == [[row["path"], one["caption"]] for row in rows for one in row["n_best"]]  # best first
    settings = dict(method=method, beam_size=4, max_len=3, n_best=3)
    if method == "diverse":
        settings.update(groups=2, diversity=2.0)
    captioned = captioner.load_model(bundles["soft"]).caption(good, **settings)
    for result, row in zip(captioned, rows):
        assert [one.caption for one in result.n_best] == [one["caption"] for one in row["n_best"]]
        assert [round(one.score, 4) for one in result.n_best] == [one["score"] for one in row["n_best"]]
