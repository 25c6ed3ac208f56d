"""The ``captioner`` command: caption, attend and evaluate. Every bad input, model file and argument is
one line on stderr with the documented exit status (1: some image failed, 2: unusable model or
argument), never a traceback; the good images are still captioned."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from nltk.translate.bleu_score import sentence_bleu
from PIL import Image

from captioner import __version__, cli
from captioner.cli.inputs import expand_inputs
from captioner.config import ShapesSpec
from captioner.data.shapes import generate_shapes
from captioner.data.vocab import Vocabulary, tokenize
from captioner.evaluation.cococaption import java_available
from captioner.inference import load_model
from captioner.viz import sheet
from conftest import ROOT, Links, run_train, tampered, write_bundle

WORDS = ["a", "red", "blue", "green", "circle", "square", "triangle", "left", "of", "above"]
SHAPE_WORDS = ("circle", "square", "triangle")
MAX_LEN = "3"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, str]:
    """Untrained bundles (soft and hard attention) whose captions never end and only name shapes: exactly
    --max-len words, and object words for attention correctness."""
    folder = tmp_path_factory.mktemp("bundles")
    return {
        mode: str(write_bundle(folder / f"{mode}.pt", WORDS, mode, favoured=SHAPE_WORDS)) for mode in ("soft", "hard")
    }


# ------------------------------------------------------------------------------------------ inputs
def _noise(size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    return Image.effect_noise(size, 60).convert(mode)


def _saver(size: tuple[int, int], mode: str = "RGB", **options) -> Callable[[Path], None]:
    return lambda path: _noise(size, mode).save(path, **options)


def _array(values: np.ndarray) -> Callable[[Path], None]:
    return lambda path: Image.fromarray(values).save(path)


def _two_frames(path: Path) -> None:
    _noise((30, 20)).save(path, save_all=True, append_images=[Image.new("RGB", (30, 20), (255, 0, 0))])


def _exif_rotated(path: Path) -> None:
    image = _noise((40, 20))
    exif = image.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    image.save(path, exif=exif.tobytes())


def _transparent_palette(path: Path) -> None:
    _noise((16, 16)).convert("P").save(path, transparency=0)


def _truncated_jpeg(path: Path) -> None:
    buffer = io.BytesIO()
    _noise((64, 64)).save(buffer, "JPEG")
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])


def _bomb(path: Path) -> None:
    """A 60-byte PNG that claims 30000 x 30000 pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


# Every mode and format Pillow reads, odd sizes; bad files interleaved (name -> maker, or (maker, reason)).
GOOD: dict[str, Callable[[Path], None]] = {
    "01_grey.png": _saver((32, 24), "L"),
    "02_bilevel.png": _saver((32, 24), "1"),
    "04_grey_alpha.png": _saver((32, 24), "LA"),
    "05_palette.png": _saver((32, 24), "P"),
    "07_palette_transparent.png": _transparent_palette,
    "08_rgba.png": _saver((32, 24), "RGBA"),
    "10_cmyk.jpg": _saver((32, 24), "CMYK"),
    "11_16bit.png": _array(np.arange(600, dtype=np.uint16).reshape(20, 30) * 100),
    "13_int32.tif": _array(np.arange(600, dtype=np.int32).reshape(20, 30) * 1000),
    "14_float.tif": _array(np.linspace(0, 1, 600, dtype=np.float32).reshape(20, 30)),
    "16_progressive.jpg": _saver((64, 48), progressive=True, quality=80),
    "17_photo.webp": _saver((48, 32)),
    "18_animated.gif": _two_frames,
    "19_pages.tif": _two_frames,
    "20_exif_rotated.jpg": _exif_rotated,
    "21_one_pixel.png": _saver((1, 1)),
    "22_thin.png": _saver((3, 500)),
    "23_very_wide.jpg": _saver((2000, 6)),
    "24_wide.PNG": _saver((120, 40)),
    "25_bitmap.bmp": _saver((20, 20)),
}
BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "03_text.jpg": (lambda path: path.write_text("these are not the pixels you are looking for"), "not an image file"),
    "06_empty.png": (lambda path: path.write_bytes(b""), "file is empty"),
    "09_truncated.jpg": (_truncated_jpeg, "truncated or corrupt image data"),
    "15_bomb.png": (_bomb, "decompression bomb"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[str], dict[str, str]]:
    """A folder of good and bad images (and a text file a folder scan skips): (folder, good paths in
    order, bad path -> reason)."""
    folder = tmp_path_factory.mktemp("inputs") / "photos"
    folder.mkdir()
    for name, make in GOOD.items():
        make(folder / name)
    for name, (make, _) in BAD.items():
        make(folder / name)
    (folder / "notes.txt").write_text("not an image, and not named like one")
    return folder, [str(folder / name) for name in sorted(GOOD)], {str(folder / n): r for n, (_, r) in BAD.items()}


def _before_summary(err: str, captioned: int, failed: int, skipped: int = 0) -> list[str]:
    """The lines of ``err`` before its closing summary line, which must give these counts."""
    *lines, last = err.splitlines()
    assert re.fullmatch(
        rf"summary: {captioned} captioned, {failed} failed, {skipped} skipped( \(.*\))?, \d+\.\d images/s", last
    ), last
    return lines


def _one_error_line(err: str, path: object, reason: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and str(path) in lines[0] and reason in lines[0], lines[0]


# ------------------------------------------------------------------------------------------ caption
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
    common = ["caption", *good, "--model", bundles["soft"], "--max-len", MAX_LEN, "--workers", "0", "--json"]
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
        "--max-len",
        MAX_LEN,
        "--workers",
        "0",
        "--method",
        method,
    ]
    assert cli.main(common) == 0
    free = [line.split("\t")[1].split() for line in capsys.readouterr().out.splitlines()]
    assert any(len(set(words)) < len(words) for words in free)  # the shape words repeat
    assert cli.main([*common, "--no-repeat-ngram-size", "1", "--min-len", "2"]) == 0
    blocked = [line.split("\t")[1].split() for line in capsys.readouterr().out.splitlines()]
    assert len(blocked) == 4 and all(len(set(words)) == len(words) == 3 for words in blocked)


def test_globs_and_a_progress_bar_for_many_images(bundles, inputs, monkeypatch, capsys):
    folder = inputs[0]
    args = ["caption", str(folder / "0*.png"), "--model", bundles["soft"], "--max-len", "1", "--workers", "0"]
    monkeypatch.setattr(cli.parser, "PROGRESS_MIN_IMAGES", 3)
    assert cli.main(args) == 1  # 06_empty.png matches the pattern too
    assert "captioning" not in capsys.readouterr().err  # stderr is no terminal here: no progress bar in a log
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(args) == 1
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [
        str(folder / name)
        for name in (
            "01_grey.png",
            "02_bilevel.png",
            "04_grey_alpha.png",
            "05_palette.png",
            "07_palette_transparent.png",
            "08_rgba.png",
        )
    ]
    assert "captioning" in err and "7/7" in err
    assert cli.main([*args, "--no-progress"]) == 1
    assert "captioning" not in capsys.readouterr().err
    assert cli.main(["caption", str(folder / "*.jpeg"), "--model", bundles["soft"]]) == 1
    error = capsys.readouterr().err
    assert _before_summary(error, captioned=0, failed=1) == [
        f"error: {folder / '*.jpeg'}: no file matches this pattern"
    ]


def test_expand_inputs(tmp_path):
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    for name in ("a/2.jpg", "a/deep/1.PNG", "a/readme.md", "b.gif"):
        (tmp_path / name).write_bytes(b"x")
    found = expand_inputs(
        [str(tmp_path / "a"), str(tmp_path / "*.gif"), str(tmp_path / "empty"), str(tmp_path / "gone.jpg")]
    )
    assert found.paths == [
        str(tmp_path / "a/2.jpg"),
        str(tmp_path / "a/deep/1.PNG"),
        str(tmp_path / "b.gif"),
        str(tmp_path / "gone.jpg"),
    ]  # a named file is kept: loading it says what is wrong
    assert [(e.path, e.reason) for e in found.errors] == [(str(tmp_path / "empty"), "folder holds no image files")]
    assert found.skipped == [str(tmp_path / "a/readme.md")]  # counted, and named in the summary


def test_console_script_streams_and_exit_status(bundles, inputs, tmp_path):
    good, missing = inputs[1][0], str(tmp_path / "missing.png")
    script = Path(sys.executable).parent / "captioner"
    proc = subprocess.run(
        [str(script), "caption", good, missing, "--model", bundles["soft"], "--max-len", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert [line.split("\t")[0] for line in proc.stdout.splitlines()] == [good]
    assert _before_summary(proc.stderr, captioned=1, failed=1) == [f"error: {missing}: file not found"]


def test_a_dash_reads_image_paths_from_standard_input(bundles, inputs, tmp_path, monkeypatch, capsys):
    folder, good, _ = inputs
    missing = str(tmp_path / "missing.png")
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{good[1]}\n\n{missing}\r\n{good[2]}\n"))
    code = cli.main(
        [
            "caption",
            good[0],
            "-",
            str(folder / "24_wide.PNG"),
            "--model",
            bundles["soft"],
            "--max-len",
            "1",
            "--workers",
            "0",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1  # the missing file named on standard input
    assert [line.split("\t")[0] for line in out.splitlines()] == [
        good[0],
        good[1],
        good[2],
        str(folder / "24_wide.PNG"),
    ]
    assert _before_summary(err, captioned=4, failed=1) == [f"error: {missing}: file not found"]
    assert cli.main(["caption", "-", "-", "--model", bundles["soft"]]) == 2
    assert "given more than once" in capsys.readouterr().err


def test_paths_piped_into_the_command(bundles, inputs):
    good = inputs[1][:2]
    proc = subprocess.run(
        [sys.executable, "-m", "captioner.cli", "caption", "-", "--model", bundles["soft"], "--max-len", "2"],
        input="\n".join(good) + "\n",
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert [line.split("\t")[0] for line in proc.stdout.splitlines()] == good


def test_version_and_help_show_every_default_in_plain_text(capsys):

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"captioner {__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in {"": parser, **commands}.items():
        assert cli.main([name, "--help"] if name else ["--help"]) == 0
        text = capsys.readouterr().out
        assert "`" not in text, (name, text)  # no reStructuredText markup
        flat = " ".join(text.split())
        for action in sub._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                shown = f"(default: {action.default})"
                assert shown in flat, (name, action.option_strings, shown)
    assert "(default: 0.0)" in " ".join(commands["caption"].format_help().split())  # a zero default too


def test_model_takes_a_run_folder(bundles, inputs, tmp_path, capsys):
    run = tmp_path / "runs" / "2026-01-01_00-00-00"
    run.mkdir(parents=True)
    shutil.copy(bundles["soft"], run / "bundle.pt")
    image = inputs[1][0]
    common = [image, "--max-len", MAX_LEN, "--workers", "0", "--method", "greedy"]
    assert cli.main(["caption", *common, "--model", str(run)]) == 0
    from_folder = capsys.readouterr().out
    assert cli.main(["caption", *common, "--model", str(run / "bundle.pt")]) == 0
    assert from_folder == capsys.readouterr().out and from_folder.startswith(image)
    (run / "bundle.pt").unlink()
    assert cli.main(["caption", *common, "--model", str(run)]) == 2
    _one_error_line(capsys.readouterr().err, run, "is a folder without bundle.pt")
    (run / "FAILED").write_text("RuntimeError: CUDA out of memory.\n")  # as a run that failed leaves it
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert cli.main(["caption", *common, "--model", str(run)]) == 2
    assert capsys.readouterr().err == (
        f"error: {run}: this run failed (RuntimeError: CUDA out of memory.), so it has no bundle.pt; give a run "
        f"that finished, or one of its checkpoints ({run / 'checkpoints' / 'last.ckpt'})\n"
    )


def test_python_m_captioner_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "captioner", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert (proc.returncode, proc.stdout) == (0, f"captioner {__version__}\n"), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "captioner", "caption"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "the following arguments are required: --model" in proc.stderr


# --------------------------------------------------------------------------------- output for scripts
def test_tsv_fields_are_escaped_and_json_has_a_record_for_every_input(bundles, tmp_path, capsys):
    odd = tmp_path / "tab\there\nnewline back\\slash.png"
    _noise((20, 20)).save(odd)
    missing, empty = tmp_path / "missing.png", tmp_path / "empty"
    empty.mkdir()
    common = ["--model", bundles["soft"], "--max-len", MAX_LEN, "--workers", "0"]
    assert cli.main(["caption", str(odd), *common]) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()  # one line for the image, two fields
    path, caption = line.split("\t")
    assert path == str(odd).replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
    assert path.encode().decode("unicode_escape") == str(odd) and len(caption.split()) == 3
    _before_summary(err, captioned=1, failed=0)

    assert cli.main(["caption", str(odd), str(missing), str(empty), str(tmp_path / "*.gif"), *common, "--json"]) == 1
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row for row in rows if "error" in row] == [
        {"path": str(empty), "error": "folder holds no image files"},
        {"path": str(tmp_path / "*.gif"), "error": "no file matches this pattern"},
        {"path": str(missing), "error": "file not found"},
    ]
    assert [row["path"] for row in rows if "caption" in row] == [str(odd)]
    assert len(_before_summary(err, captioned=1, failed=3)) == 3  # each failure also named on stderr


def test_empty_standard_input_is_refused_like_an_empty_folder(bundles, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    assert cli.main(["caption", "-", "--model", bundles["soft"]]) == 1
    out, err = capsys.readouterr()
    assert out == "" and _before_summary(err, captioned=0, failed=1) == [
        "error: -: standard input named no image paths"
    ]
    assert cli.main(["caption", str(tmp_path / "empty"), "--model", bundles["soft"]]) == 1
    out, err = capsys.readouterr()
    assert out == "" and _before_summary(err, 0, 1) == [f"error: {tmp_path / 'empty'}: folder holds no image files"]


def test_a_folder_scan_tries_files_without_a_suffix_and_counts_what_it_skips(bundles, tmp_path, capsys):
    folder = tmp_path / "downloads"
    folder.mkdir()
    _noise((20, 20)).save(folder / "IMG_0001", format="JPEG")  # an image without a suffix
    (folder / "README").write_text("not an image")
    (folder / "notes.txt").write_text("not an image either")
    assert cli.main(["caption", str(folder), "--model", bundles["soft"], "--max-len", "1", "--workers", "0"]) == 0
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [str(folder / "IMG_0001")]
    assert _before_summary(err, captioned=1, failed=0, skipped=2) == []
    assert f"e.g. {folder / 'README'}" in err


def test_a_folder_scan_takes_regular_files_skips_hidden_ones_and_names_each_file_once(tmp_path):
    folder = tmp_path / "photos"
    (folder / "album.jpg").mkdir(parents=True)  # a folder named like an image is walked
    (folder / ".thumbs").mkdir()
    for name in ("a.png", "album.jpg/b.png", ".thumbs/t.png", "._a.png", ".hidden.jpg"):
        _noise((8, 8)).save(folder / name, format="PNG")
    named = [str(folder / "a.png"), str(folder), str(folder / "*.png"), str(folder / ".." / "photos" / "a.png")]
    found = expand_inputs(named)
    assert found.paths == [str(folder / "a.png"), str(folder / "album.jpg" / "b.png")]
    assert found.errors == [] and found.skipped == []


def test_nul_separated_paths_from_standard_input(bundles, inputs, monkeypatch, capsys):
    good = inputs[1][:2]
    odd = "\n".join(good)  # a name with a newline is no problem with -0 (here: two names, one per line)
    data = ("\0".join([good[1], good[0], ""])).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert cli.main(["caption", "-0", "-", "--model", bundles["soft"], "--max-len", "1", "--workers", "0"]) == 0
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [good[1], good[0]]
    assert _before_summary(err, captioned=2, failed=0) == []
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(odd.encode())))
    assert expand_inputs(["-"], nul=True).paths == [odd]


@pytest.mark.parametrize(
    "option, message",
    [
        (["--method", "greedy", "--beam-size", "5"], "--beam-size goes with --method beam; this command decodes with "
         "--method greedy"),
        (["--temperature", "0.5"], "--temperature goes with --method sample; this command decodes with --method beam "
         "(the default)"),
        (["--method", "beam", "--seed", "1"], "--seed goes with --method sample; this command decodes with --method "
         "beam (the default)"),
        (["--method", "sample", "--length-penalty", "1"], "--length-penalty goes with --method beam; this command "
         "decodes with --method sample"),
    ],
)  # fmt: skip
def test_an_option_the_method_ignores_is_refused(option, message, bundles, inputs, capsys):
    assert cli.main(["caption", inputs[1][0], "--model", bundles["soft"], *option]) == 2
    assert capsys.readouterr() == ("", f"error: {message}\n")


def test_max_pixels_lets_a_large_image_through(bundles, tmp_path, monkeypatch, capsys):
    image = tmp_path / "large.png"
    _noise((60, 50)).save(image)
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


def test_sampling_takes_a_seed(bundles, inputs, capsys):
    args = ["caption", *inputs[1][:6], "--model", bundles["soft"], "--method", "sample", "--workers", "0"]
    captions = []
    for seed in ("1", "1", "2"):
        assert cli.main([*args, "--seed", seed, "--temperature", "3"]) == 0
        captions.append([line.split("\t")[1] for line in capsys.readouterr().out.splitlines()])
    assert captions[0] == captions[1] and len(captions[0]) == 6
    assert captions[0] != captions[2]


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


def test_help_does_not_import_torch():
    script = (
        "import sys\n"
        "from captioner.cli import main\n"
        "codes = [main(['--help']), main(['caption', '--help']), main(['evaluate', '--help'])]\n"
        "print(codes, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stderr == "[0, 0, 0] False\n"
    assert "a backslash, tab, newline or carriage return" in proc.stdout  # the TSV escapes, documented


# ------------------------------------------------------------------------------------------- attend
@pytest.fixture
def sheets(monkeypatch) -> list:
    """The shading and words of every sheet ``draw_overlay`` writes, to count its panels and marks."""
    written = []
    write = sheet.write_sheet

    def spy(shading, words, *args, **kwargs):
        written.append((shading, list(words)))
        return write(shading, words, *args, **kwargs)

    monkeypatch.setattr(sheet, "write_sheet", spy)
    return written


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_attend_draws_one_panel_per_word(mode, bundles, inputs, sheets, tmp_path, capsys):
    image = str(inputs[0] / "24_wide.PNG")
    out = tmp_path / "overlay.png"
    assert (
        cli.main(["attend", image, "--model", bundles[mode], "--out", str(out), "--max-len", MAX_LEN, "--workers", "0"])
        == 0
    )
    path, caption, target = capsys.readouterr().out.strip().split("\t")
    assert (path, target) == (image, str(out))
    with Image.open(out) as png:
        png.load()
        assert png.format == "PNG" and png.width > png.height  # the wide image's aspect ratio
    ((shading, words),) = sheets
    assert words == caption.split() and len(shading.panels) == len(words) == 3  # a panel per word
    assert shading.picture.size == (120, 40)
    assert (shading.cells is not None) == (mode == "hard")  # hard attention: the attended cell is outlined
    assert shading.cells is None or len(shading.cells) == 3


def test_attend_a_folder_writes_overlays_and_a_gallery(bundles, inputs, tmp_path, capsys):
    folder, good, _ = inputs
    bad = str(folder / "03_text.jpg")
    images = [good[0], bad, good[-1], good[-2]]
    out = tmp_path / "gallery"
    assert (
        cli.main(
            [
                "attend",
                *images,
                "--model",
                bundles["soft"],
                "--out",
                str(out),
                "--max-len",
                MAX_LEN,
                "--batch-size",
                "2",
            ]
        )
        == 1
    )
    stdout, err = capsys.readouterr()
    rows = [line.split("\t") for line in stdout.splitlines()]
    assert [row[0] for row in rows] == [good[0], good[-1], good[-2]]
    assert sorted(out.glob("*.jpg")) == sorted(Path(row[2]) for row in rows)
    assert err.splitlines()[0].startswith(f"error: {folder / '03_text.jpg'}: not an image file")
    page = (out / "index.html").read_text()
    parser = Links()
    parser.feed(page)
    names = [Path(row[2]).stem for row in rows]  # entry n for the n-th input: 0000_01_grey, 0002_25_bitmap, ...
    assert names == [f"{n:04d}_{Path(image).stem}" for n, image in enumerate(images) if image != bad]
    panels = [f"{name}/{step:02d}.jpg" for name in names for step in range(1, 4)]
    assert sorted(str(p.relative_to(out)) for p in out.glob("0*/*.jpg")) == panels  # a panel per word
    # the originals, copied so that the folder can be moved: a small PNG as it is, a BMP as JPEG
    copies = [f"images/{name}{'.jpg' if name.endswith('bitmap') else '.png'}" for name in names]
    assert parser.links == [
        link for name, copy in zip(names, copies) for link in (copy, f"{name}/01.jpg", f"{name}.jpg")
    ]
    assert all(row[1] in page for row in rows)
    assert f"<li><code>{folder / '03_text.jpg'}</code>: not an image file" in page  # the failed input is listed


def test_force_replaces_an_earlier_gallery(bundles, inputs, tmp_path, capsys):
    good = inputs[1]
    out = tmp_path / "gallery"
    args = ["attend", "--model", bundles["soft"], "--out", str(out), "--max-len", "1", "--workers", "0"]
    assert cli.main([*args, good[0], good[1]]) == 0
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert cli.main([*args, good[2], "--force"]) == 0
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    name = f"0000_{Path(good[2]).stem}"
    gallery = ["index.html", f"{name}.jpg", f"{name}/01.jpg", f"images/{name}.png"]
    assert written == sorted([*gallery, "notes.txt", ".captioner-gallery"])
    assert sorted(json.loads(line) for line in (out / ".captioner-gallery").read_text().splitlines()) == sorted(gallery)


def test_out_is_never_overwritten_without_force(bundles, inputs, tmp_path, capsys):
    out = tmp_path / "overlay.png"
    args = ["attend", inputs[1][0], "--model", bundles["soft"], "--out", str(out), "--max-len", "1", "--workers", "0"]
    assert cli.main(args) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert cli.main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out {out}: {out} already exists; pass --force to overwrite it"
    ]
    assert out.read_bytes() == before
    assert cli.main([*args, "--force"]) == 0
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    assert cli.main([*args[:4], "--out", str(tmp_path / "used")]) == 2
    assert "pass --force" in capsys.readouterr().err


# -------------------------------------------------------------------------------- bad model files
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
    _one_error_line(err, path, reason)
    assert not path.with_suffix(".ran").exists()  # the pickled call never ran


@pytest.mark.parametrize(
    "option, message",
    [
        (["--beam-size", "0"], "--beam-size=0 must be >= 1"),
        (["--max-len", "0"], "--max-len=0 must be >= 1"),
        (["--batch-size", "0"], "--batch-size=0 must be >= 1"),
        (["--workers", "-1"], "--workers=-1 must be >= 0"),
        (["--method", "sample", "--temperature", "0"], "--temperature=0.0 must be >= 1e-06"),
        (["--min-len", "20"], "--min-len=20 must be < --max-len=20"),
        (["--no-repeat-ngram-size", "-1"], "--no-repeat-ngram-size=-1 must be >= 0"),
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


# ----------------------------------------------------------------------------------------- evaluate
@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("data") / "shapes", ShapesSpec(n_train=20, n_val=6, n_test=6))


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
        "--max-len",
        MAX_LEN,
        "--workers",
        "0",
    ]
    assert cli.main(args) == 1  # an unreadable test image: reported, the others evaluated
    stdout, err = capsys.readouterr()
    _one_error_line(err, broken, "truncated or corrupt")
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


def test_evaluate_says_what_hard_attention_read(bundles, shapes, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("captioner.evaluation.report.java_available", lambda: False)
    common = ["evaluate", "--shapes", str(shapes), "--split", "val", "--method", "greedy", "--max-len", MAX_LEN]
    common += ["--workers", "0"]
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
        (["--coco-captions", "captions.json", "--images", "nowhere"], "COCO captions file for 'test' not found"),
    ],
)
def test_evaluate_refuses_a_missing_dataset(dataset, message, bundles, tmp_path, capsys):
    assert cli.main(["evaluate", "--model", bundles["soft"], *dataset, "--out", str(tmp_path)]) == 2
    _one_error_line(capsys.readouterr().err, "", message)


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
        *("--instances", str(annotations / "instances_test.json"), "--no-coco", "--max-len", MAX_LEN),
        *("--workers", "0", "--method", "greedy"),
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


# ------------------------------------------------------------------------- COCO evaluation server
def _image_info(shapes: Path, folder: Path, split: str = "test2014") -> Path:
    """An image_info file as COCO ships for its test images (images only, no annotations) for the test
    split of ``shapes``, with the image files under ``folder``; ids out of order as COCO lists them."""
    folder.mkdir(parents=True)
    images = []
    for path in sorted((shapes / "images" / "test").glob("*.png"), reverse=True):
        name = f"COCO_{split}_{int(path.stem):012d}.png"
        shutil.copy(path, folder / name)
        images.append(
            {
                "id": int(path.stem),
                "file_name": name,
                "width": 96,
                "height": 96,
                "license": 1,
                "coco_url": "",
                "date_captured": "",
            }
        )
    info = {
        "info": {"description": "test"},
        "licenses": [],
        "images": images,
        "categories": [{"id": 1, "name": "person", "supercategory": "person"}],
    }
    target = folder.parent / f"image_info_{split}.json"
    target.write_text(json.dumps(info))
    return target


def test_caption_an_image_info_file_for_the_evaluation_server(bundles, shapes, tmp_path, capsys):
    info = _image_info(shapes, tmp_path / "test2014")
    out = tmp_path / "server"
    args = [
        "caption",
        "--image-info",
        str(info),
        "--images",
        str(tmp_path / "test2014"),
        "--out",
        str(out),
        "--model",
        bundles["soft"],
        "--max-len",
        MAX_LEN,
        "--workers",
        "0",
        "--name",
        "sat-soft",
    ]
    assert cli.main(args) == 0
    stdout, err = capsys.readouterr()
    target = out / "captions_test2014_sat-soft_results.json"
    assert sorted(out.iterdir()) == [target]
    assert _before_summary(err, captioned=6, failed=0) == [f"results: {target} (6 images)"]
    rows = json.loads(target.read_text())
    ids = [image["id"] for image in json.loads(info.read_text())["images"]]
    assert sorted(row["image_id"] for row in rows) == sorted(ids)  # every id once
    for row in rows:
        assert list(row) == ["image_id", "caption"]  # exactly the server's format
        assert type(row["image_id"]) is int and isinstance(row["caption"], str)
        assert len(row["caption"].split()) == 3 and set(row["caption"].split()) <= set(SHAPE_WORDS)
    printed = dict(line.split("\t") for line in stdout.splitlines())
    assert {Path(p).name for p in printed} == {i["file_name"] for i in json.loads(info.read_text())["images"]}
    with contextlib.redirect_stdout(io.StringIO()):
        from pycocotools.coco import COCO

        accepted = COCO(str(info)).loadRes(str(target))  # pycocotools' own check of a results file
    assert sorted(accepted.getImgIds()) == sorted(ids)

    assert cli.main(args) == 2  # never overwritten without --force
    assert "pass --force" in capsys.readouterr().err
    assert cli.main([*args, "--force", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(line["image_id"] for line in lines) == sorted(ids)


def test_an_unreadable_image_of_an_image_info_file_is_named_and_nothing_written(bundles, shapes, tmp_path, capsys):
    info = _image_info(shapes, tmp_path / "val2014", split="val2014")
    broken = sorted((tmp_path / "val2014").glob("*.png"))[2]
    broken.write_bytes(broken.read_bytes()[:100])
    missing = sorted((tmp_path / "val2014").glob("*.png"))[4]
    missing.unlink()
    out = tmp_path / "server"
    for command in ("caption", "evaluate"):
        code = cli.main(
            [
                command,
                "--image-info",
                str(info),
                "--images",
                str(tmp_path / "val2014"),
                "--out",
                str(out),
                "--model",
                bundles["soft"],
                "--max-len",
                "1",
                "--workers",
                "0",
            ]
        )
        stdout, err = capsys.readouterr()
        assert code == 1 and "Traceback" not in err
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert lines[0].startswith(f"error: {broken}: truncated or corrupt image data")
        assert lines[1] == f"error: {missing}: file not found"
        assert lines[2].startswith("error: 2 of 6 images could not be read") and "not written" in lines[2]
        assert "captions_val2014_captioner_results.json" in lines[2]
        assert not out.exists()  # an incomplete file would be refused by the server: none is written


def test_evaluate_writes_the_server_file_for_an_image_info_file(bundles, shapes, tmp_path, capsys):
    info = _image_info(shapes, tmp_path / "test2014")
    common = [
        "--images",
        str(tmp_path / "test2014"),
        "--model",
        bundles["soft"],
        "--max-len",
        MAX_LEN,
        "--workers",
        "0",
        "--method",
        "greedy",
    ]
    assert cli.main(["evaluate", "--image-info", str(info), "--out", str(tmp_path / "a"), *common]) == 0
    stdout, err = capsys.readouterr()
    assert stdout == "" and "nothing to score" in err
    assert cli.main(["caption", "--image-info", str(info), "--out", str(tmp_path / "b"), *common]) == 0
    capsys.readouterr()
    name = "captions_test2014_captioner_results.json"
    assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    # The file as a captions file: told what it is and what to do instead of "no 'annotations'"
    assert cli.main(["evaluate", "--coco-captions", str(info), "--out", str(tmp_path / "c"), *common]) == 2
    _one_error_line(capsys.readouterr().err, info, "has no 'annotations': it lists images without captions")


@pytest.mark.parametrize(
    "change, message",
    [
        (["--name", "my_model"], "--name 'my_model': use letters, digits and hyphens only"),
        (["--rename", "test_images.json"], "cannot tell the COCO split from this file name"),
        (["--drop", "--out"], "--image-info, --images and --out go together"),
        (["--extra", "photo.jpg"], "give images either as arguments or with --image-info, not both"),
        (["--duplicate"], "image 1 repeats image id"),
    ],
)
def test_a_bad_image_info_request_is_one_line_and_exit_2(change, message, bundles, shapes, tmp_path, capsys):
    info = _image_info(shapes, tmp_path / "test2014")
    args = [
        "caption",
        "--image-info",
        str(info),
        "--images",
        str(tmp_path / "test2014"),
        "--out",
        str(tmp_path / "out"),
        "--model",
        bundles["soft"],
    ]
    if change[0] == "--name":
        args += change
    elif change[0] == "--rename":
        args[2] = str(info.rename(info.with_name(change[1])))
    elif change[0] == "--drop":
        args = args[:5] + args[7:]
    elif change[0] == "--extra":
        args.insert(1, change[1])
    else:
        data = json.loads(info.read_text())
        data["images"][1]["id"] = data["images"][0]["id"]
        info.write_text(json.dumps(data))
    assert cli.main(args) == 2
    _one_error_line(capsys.readouterr().err, "", message)
    assert not (tmp_path / "out").exists()


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
                "--max-len",
                MAX_LEN,
                "--workers",
                "0",
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
