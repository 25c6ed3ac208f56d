"""Which images ``captioner caption`` reads: folders (files without a suffix tried, hidden ones and non-images
skipped and counted), glob patterns, paths on standard input (``-``, NUL-separated with ``-0``, piped into the
command); an empty folder or standard input is refused; a progress bar only on a terminal."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import warnings

import pytest

from captioner import cli
from captioner.cli.inputs import LeftOut, expand_inputs
from captioner.data.images import ImageError, load_rgb
from cli_helpers import QUICK, before_summary, noise
from conftest import ROOT


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
    assert before_summary(error, captioned=0, failed=1) == [f"error: {folder / '*.jpeg'}: no file matches this pattern"]


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


def test_a_folder_scan_tries_files_without_a_suffix_and_counts_what_it_skips(bundles, tmp_path, capsys):
    folder = tmp_path / "downloads"
    folder.mkdir()
    noise((20, 20)).save(folder / "IMG_0001", format="JPEG")  # an image without a suffix
    (folder / "README").write_text("not an image")
    (folder / "notes.txt").write_text("not an image either")
    assert cli.main(["caption", str(folder), "--model", bundles["soft"], "--max-len", "1", "--workers", "0"]) == 0
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [str(folder / "IMG_0001")]
    assert before_summary(err, captioned=1, failed=0, skipped=2) == []
    assert f"e.g. {folder / 'README'}" in err


def test_a_folder_scan_takes_avif_and_jfif_and_says_what_a_heic_photo_needs(bundles, tmp_path, capsys):
    """A browser's .jfif and an AVIF (Pillow reads both) are captioned, and an iPhone's HEIC (Pillow needs a plugin)
    is a failure that says so; all three were skipped as files that are not images."""
    folder = tmp_path / "phone"
    folder.mkdir()
    noise((20, 20)).save(folder / "saved.jfif", format="JPEG")
    noise((20, 20)).save(folder / "IMG_0002.avif", format="AVIF")
    (folder / "IMG_0001.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64))
    assert cli.main(["caption", str(folder), "--model", bundles["soft"], "--max-len", "1", "--workers", "0"]) == 1
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [
        str(folder / "IMG_0002.avif"),
        str(folder / "saved.jfif"),
    ]
    assert before_summary(err, captioned=2, failed=1, skipped=0) == [
        f"error: {folder / 'IMG_0001.HEIC'}: a HEIF/HEIC photo, which Pillow decodes only with the pillow-heif plugin: "
        "convert it to JPEG first"
    ]


def test_a_folder_scan_takes_regular_files_skips_hidden_ones_and_names_each_file_once(tmp_path):
    folder = tmp_path / "photos"
    (folder / "album.jpg").mkdir(parents=True)  # a folder named like an image is walked
    (folder / ".thumbs").mkdir()
    for name in ("a.png", "album.jpg/b.png", ".thumbs/t.png", "._a.png", ".hidden.jpg"):
        noise((8, 8)).save(folder / name, format="PNG")
    named = [str(folder / "a.png"), str(folder), str(folder / "*.png"), str(folder / ".." / "photos" / "a.png")]
    found = expand_inputs(named)
    assert found.paths == [str(folder / "a.png"), str(folder / "album.jpg" / "b.png")]
    assert found.errors == [] and found.skipped == []


def test_a_folder_scan_follows_links_out_of_the_folder_once_and_names_a_broken_one(tmp_path):
    """A link to a folder elsewhere is searched (it was silently left out), once, without looping; a link to a
    folder inside is not (its files are found there), and a broken link named like an image is that image's error
    (it was silently dropped)."""
    folder, nas = tmp_path / "photos", tmp_path / "nas"
    for name in ("photos/a.png", "photos/sub/b.png", "nas/c.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        noise((8, 8)).save(tmp_path / name)
    (folder / "nas").symlink_to(nas)
    (folder / "nas_again").symlink_to(nas)
    (nas / "loop").symlink_to(nas)
    (folder / "sub_again").symlink_to(folder / "sub")
    (folder / "sub" / "up").symlink_to(folder)
    (folder / "gone.jpg").symlink_to(tmp_path / "deleted.jpg")
    found = expand_inputs([str(folder)])
    assert found.paths == [str(folder / name) for name in ("a.png", "gone.jpg", "nas/c.png", "sub/b.png")]
    assert found.errors == [] and found.skipped == []
    with pytest.raises(ImageError, match=f"gone.jpg: broken symbolic link: its target {tmp_path}/deleted.jpg is not"):
        load_rgb(found.paths[1])


def test_a_folder_scan_never_opens_a_pipe(tmp_path):
    """A named pipe, or a link to one (without a suffix, whose header the search would read, or named like an
    image), is skipped and counted, never opened: opening it waits for a writer that never comes."""
    folder = tmp_path / "photos"
    folder.mkdir()
    noise((8, 8)).save(folder / "a.png")
    os.mkfifo(folder / "pipe")
    (folder / "to_pipe").symlink_to(folder / "pipe")
    (folder / "z.jpg").symlink_to(folder / "pipe")
    found: list = []
    search = threading.Thread(target=lambda: found.append(expand_inputs([str(folder)])), daemon=True)
    search.start()
    search.join(10)
    waited = search.is_alive()
    if waited:  # a writer lets the search's open() of the pipe return
        os.close(os.open(folder / "pipe", os.O_WRONLY | os.O_NONBLOCK))
        search.join()
    assert not waited and found[0].paths == [str(folder / "a.png")]
    assert found[0].skipped == [str(folder / name) for name in ("pipe", "to_pipe", "z.jpg")]


def test_a_folder_that_cannot_be_listed_is_an_input_error(tmp_path, monkeypatch):
    """A subfolder without read permission was silently left out, and a whole folder of it 'held no image files'.
    (Root reads any folder, so listing is refused here as it is for another user.)"""
    folder = tmp_path / "photos"
    (folder / "private").mkdir(parents=True)
    noise((8, 8)).save(folder / "a.png")
    listing = os.scandir

    def scandir(path="."):
        if os.path.basename(os.fspath(path)) == "private" or os.fspath(path) == str(tmp_path / "locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return listing(path)

    monkeypatch.setattr(os, "scandir", scandir)
    (tmp_path / "locked").mkdir()
    found = expand_inputs([str(folder), str(tmp_path / "locked")])
    assert found.paths == [str(folder / "a.png")]
    assert [(e.path, e.reason) for e in found.errors] == [
        (str(folder / "private"), "folder cannot be read (Permission denied)"),
        (str(tmp_path / "locked"), "folder cannot be read (Permission denied)"),
    ]


def test_caption_leaves_a_gallery_among_its_inputs_out_and_says_how_many_files(bundles, tmp_path, capsys):
    """``captioner attend photos --out photos/overlays`` then ``captioner caption photos``: the photos, not the
    gallery's sheets, strips, copies and pages; a user's own file in the gallery's folder is read, and so is a
    gallery file named by itself."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for k in range(3):
        noise((24, 16)).save(folder / f"p{k}.jpg")
    model = ["--model", bundles["soft"], *QUICK]
    assert cli.main(["attend", str(folder), "--out", str(folder / "overlays"), *model]) == 0
    capsys.readouterr()
    gallery = folder / "overlays"
    written = (gallery / ".captioner-gallery").read_text().splitlines()
    assert len(written) == 10  # 3 sheets, 3 strips, 3 copies of the photos, index.html
    noise((24, 16)).save(gallery / "mine.jpg")  # no gallery wrote it
    assert cli.main(["caption", str(folder), *model]) == 0
    out, err = capsys.readouterr()
    photos = [str(folder / f"p{k}.jpg") for k in range(3)]
    assert [line.split("\t")[0] for line in out.splitlines()] == [str(gallery / "mine.jpg"), *photos]
    note = f"of captioner attend's gallery in {gallery} (a file named by itself is read all the same)"
    assert before_summary(err, captioned=4, failed=0) == [f"left out: 10 files {note}"]
    sheet = str(gallery / "0000_p0.jpg")
    assert cli.main(["caption", str(folder / "**" / "*.jpg"), sheet, *model]) == 0  # a glob, a file by its name
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [str(gallery / "mine.jpg"), *photos, sheet]
    assert before_summary(err, captioned=5, failed=0) == [f"left out: 9 files {note}"]  # the JPEGs of the 10


def test_a_folder_inside_a_gallery_is_searched_by_the_gallery_s_record(tmp_path):
    """The record of a gallery in a folder above the one named (``photos/overlays/images`` of the gallery in
    ``photos/overlays``) leaves its files out as well; nothing else is left out."""
    copies = tmp_path / "overlays" / "images"
    copies.mkdir(parents=True)
    for name in ("0000_cat.jpg", "0001_dog.jpg"):
        noise((8, 8)).save(copies / name)
    record = "".join(json.dumps(name) + "\n" for name in ("images/0000_cat.jpg", "images/0001_dog.jpg"))
    (tmp_path / "overlays" / ".captioner-gallery").write_text(record)
    found = expand_inputs([str(copies)])
    assert found.paths == [] and [error.reason for error in found.errors] == ["folder holds no image files"]
    assert found.left_out == (
        f"left out: 2 files of captioner attend's gallery in {tmp_path / 'overlays'} "
        "(a file named by itself is read all the same)"
    )
    (tmp_path / "overlays" / ".captioner-gallery").write_text(record.splitlines()[0] + "\n")
    found = expand_inputs([str(tmp_path)])
    assert found.paths == [str(copies / "0001_dog.jpg")] and found.left_out.startswith("left out: 1 file of ")
    found = expand_inputs([str(tmp_path)], leave_out=LeftOut(tmp_path / "overlays"))  # attend's --out: all of it
    assert found.paths == [] and found.left_out == (
        f"left out: 2 files in --out {tmp_path / 'overlays'}, where this gallery goes "
        "(a file named by itself is read all the same)"
    )


def test_a_folder_scan_takes_a_photo_past_pillow_s_own_limit_without_a_warning(tmp_path, monkeypatch):
    folder = tmp_path / "photos"
    folder.mkdir()
    noise((64, 64)).save(folder / "IMG_0002", format="JPEG")  # no suffix: its header is read to know it
    monkeypatch.setattr("PIL.Image.MAX_IMAGE_PIXELS", 100)  # 4,096 pixels: past twice Pillow's limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DecompressionBombWarning (or Error) would fail the test
        found = expand_inputs([str(folder)])
    assert found.paths == [str(folder / "IMG_0002")] and found.skipped == []  # load_rgb applies max_pixels


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
    assert before_summary(err, captioned=4, failed=1) == [f"error: {missing}: file not found"]
    assert cli.main(["caption", "-", "-", "--model", bundles["soft"]]) == 2
    assert "given more than once" in capsys.readouterr().err


def test_a_path_on_standard_input_that_is_not_utf8_names_its_file(bundles, tmp_path, monkeypatch, capsys):
    """``find photos | captioner caption -`` under a strict UTF-8 locale (en_US.UTF-8): a Latin-1 name was a
    UnicodeDecodeError, a traceback; it is read as its bytes and names its file."""
    latin = tmp_path / os.fsdecode(b"caf\xe9.png")
    noise((20, 20)).save(latin)
    stdin = io.TextIOWrapper(io.BytesIO(os.fsencode(latin) + b"\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert cli.main(["caption", "-", "--model", bundles["soft"], *QUICK, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(latin)


def test_nul_separated_paths_from_standard_input(bundles, inputs, monkeypatch, capsys):
    good = inputs[1][:2]
    odd = "\n".join(good)  # a name with a newline is no problem with -0 (here: two names, one per line)
    data = ("\0".join([good[1], good[0], ""])).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert cli.main(["caption", "-0", "-", "--model", bundles["soft"], "--max-len", "1", "--workers", "0"]) == 0
    out, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in out.splitlines()] == [good[1], good[0]]
    assert before_summary(err, captioned=2, failed=0) == []
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(odd.encode())))
    assert expand_inputs(["-"], nul=True).paths == [odd]


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


def test_empty_standard_input_is_refused_like_an_empty_folder(bundles, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    assert cli.main(["caption", "-", "--model", bundles["soft"]]) == 1
    out, err = capsys.readouterr()
    assert out == "" and before_summary(err, captioned=0, failed=1) == ["error: -: standard input named no image paths"]
    assert cli.main(["caption", str(tmp_path / "empty"), "--model", bundles["soft"]]) == 1
    out, err = capsys.readouterr()
    assert out == "" and before_summary(err, 0, 1) == [f"error: {tmp_path / 'empty'}: folder holds no image files"]
