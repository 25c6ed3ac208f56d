"""``captioner attend``: one overlay panel per word (hard attention outlines the attended cell), a folder of
images drawn into a gallery of overlays and copied originals with its failed inputs listed; ``--out`` never
overwritten without ``--force``, which replaces only what a gallery wrote, never an input or a user's file, and only
once the model has loaded; a gallery inside its input folder is never read as input."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from PIL import Image

from captioner import cli
from captioner.cli import options
from captioner.viz import sheet
from cli_helpers import MAX_LEN, QUICK
from conftest import Links, snapshot, write_bundle

WORDS = ["a", "red", "blue", "circle", "square"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return str(write_bundle(tmp_path_factory.mktemp("bundle") / "model.pt", WORDS))


def photos(folder: Path, *names: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        Image.effect_noise((24, 16), 40 + k).convert("RGB").save(folder / name)
    return [folder / name for name in names]


def attend(bundle: str, *args: str) -> int:
    return cli.main(["attend", *args, "--model", bundle, "--max-len", "2", "--workers", "0"])


def recorded(out: Path) -> list[str]:
    return [json.loads(line) for line in (out / ".captioner-gallery").read_text().splitlines()]


def test_force_replaces_the_gallery_and_nothing_of_the_users(bundle, tmp_path, capsys):
    project = tmp_path / "project"
    photos(project / "images", "0001_cat.png", "0002_dog.png")  # inputs named like a gallery's files
    photos(project / "2019_trip", "0001_beach.jpg")  # a numbered folder of the user's
    photos(project, "0005_notes.png")
    (project / "0006_list.txt").write_text("mine")
    users = snapshot(project)
    assert attend(bundle, str(project / "images"), "--out", str(project)) == 2  # not empty: needs --force
    assert capsys.readouterr().err.splitlines() == [  # the gallery goes among the user's files: none replaced
        f"error: --out {project}: {project} holds files; pass --force to write the gallery among them (none is "
        "replaced)"
    ]
    for run in range(2):  # the second replaces the first's files
        if run:
            assert attend(bundle, str(project / "images"), "--out", str(project)) == 2
            assert capsys.readouterr().err.splitlines() == [
                f"error: --out {project}: {project} holds an earlier gallery; pass --force to replace it (its files "
                "only: nothing else there is touched)"
            ]
        assert attend(bundle, str(project / "images"), "--out", str(project), "--force") == 0
        err = capsys.readouterr().err
        assert re.search(r"summary: 2 captioned, 0 failed", err), err
        after = snapshot(project)
        assert {name: after.get(name) for name in users} == users  # every file of the user's, as it was
        gallery = sorted(set(after) - set(users))
        assert gallery == sorted(
            [".captioner-gallery", "index.html"]
            + [f"{n}{kind}.jpg" for n in ("0000_0001_cat", "0001_0002_dog") for kind in ("", ".panels")]
        )  # the inputs lie inside the gallery: linked, not copied
        assert sorted(recorded(project)) == [name for name in gallery if name != ".captioner-gallery"]
    assert attend(bundle, str(project / "images" / "0002_dog.png"), "--out", str(project), "--force") == 0
    after = snapshot(project)
    assert {name: after.get(name) for name in users} == users
    assert not (project / "0001_0002_dog.jpg").exists() and not (project / "0001_0002_dog.panels.jpg").exists()
    assert (project / "0000_0002_dog.jpg").is_file()


@pytest.fixture
def stdout_read_by_none(monkeypatch):
    """Make stdout a pipe whose reader went away (``| head -1`` once it has a line): writes raise BrokenPipeError."""
    opened = []

    def make() -> None:
        read, write = os.pipe()
        os.close(read)
        opened.append(open(write, "w", encoding="utf-8"))  # noqa: SIM115  # closed below
        monkeypatch.setattr(sys, "stdout", opened[-1])

    yield make
    for stdout in opened:
        stdout.close()  # stdout_gone pointed it at the null device


def _drawn(number: int, image: Path) -> tuple[str, str]:
    return f"{number:04d}_{image.stem}.panels.jpg", f"{number:04d}_{image.stem}.jpg"


def test_a_reader_of_stdout_that_goes_away_ends_the_rows_not_the_gallery(bundle, tmp_path, capsys, stdout_read_by_none):
    images = photos(tmp_path / "in", "cat.png", "dog.png")
    out = tmp_path / "gallery"
    stdout_read_by_none()
    assert attend(bundle, str(tmp_path / "in"), "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert re.search(r"summary: 2 captioned, 0 failed", err) and "Traceback" not in err, err
    parser = Links()
    parser.feed((out / "index.html").read_text())
    assert parser.links == [  # per image: its copy, the strip of its panels, its sheet
        link for n, image in enumerate(images) for link in (f"images/{n:04d}_{image.name}", *_drawn(n, image))
    ]
    assert all((out / link).is_file() for link in parser.links)
    stdout_read_by_none()
    assert cli.main(["caption", str(images[0]), "--model", bundle, "--workers", "0"]) == 1  # its rows: all it makes


def test_an_image_with_a_long_name_gets_a_gallery_entry_of_a_name_cut_short(bundle, tmp_path, capsys):
    """Its sheet's name, 0000_ and 240 bytes and .panels.jpg, was past the 255 bytes a file's name holds: 'File name
    too long', and no gallery at all. Now the name is cut at a whole character (a Japanese one is 3 bytes)."""
    long_name, japanese = "x" * 240, "写真" * 40  # 240 bytes each
    photos(tmp_path / "in", f"{long_name}.png", f"{japanese}.png")
    out = tmp_path / "gallery"
    assert attend(bundle, str(tmp_path / "in"), "--out", str(out)) == 0
    assert re.search(r"summary: 2 captioned, 0 failed", capsys.readouterr().err)
    sheets = sorted(path.name for path in out.glob("*.jpg") if not path.name.endswith(".panels.jpg"))
    assert sheets == [f"0000_{long_name[:200]}.jpg", f"0001_{japanese[:66]}.jpg"]  # 198 bytes: 66 characters


def test_a_bad_model_or_a_users_file_leaves_everything_as_it_was(bundle, tmp_path, capsys):
    out = tmp_path / "gallery"
    (image,) = photos(tmp_path / "in", "cat.png")
    assert attend(bundle, str(image), "--out", str(out)) == 0
    before = snapshot(out)
    capsys.readouterr()
    missing = str(tmp_path / "typo.pt")
    assert cli.main(["attend", str(image), "--model", missing, "--out", str(out), "--force"]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    assert snapshot(out) == before  # the old gallery is whole
    pictures = tmp_path / "Pictures"
    photos(pictures, "cat.png")
    (pictures / "index.html").write_text("my own page")  # no gallery wrote this one
    before = snapshot(pictures)
    assert attend(bundle, str(pictures), "--out", str(pictures), "--force") == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{pictures / 'index.html'} exists and no gallery wrote it" in line
    assert snapshot(pictures) == before


def test_force_replaces_a_gallery_of_one_panel_file_per_word_with_strips(bundle, tmp_path, capsys):
    out = tmp_path / "gallery"
    (image,) = photos(tmp_path / "in", "cat.png")
    old = ["index.html", "0000_cat.jpg", "0000_cat/01.jpg", "0000_cat/02.jpg"]  # as galleries wrote them before
    for name in old:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b"old")
    (out / ".captioner-gallery").write_text("".join(json.dumps(name) + "\n" for name in old))
    assert attend(bundle, str(image), "--out", str(out), "--force") == 0
    capsys.readouterr()
    new = [".captioner-gallery", "0000_cat.jpg", "0000_cat.panels.jpg", "images/0000_cat.png", "index.html"]
    assert sorted(snapshot(out)) == new
    assert not (out / "0000_cat").exists()  # the old panels' folder, emptied, goes too


@pytest.mark.parametrize("inside", ["overlays", "."])
def test_a_gallery_inside_its_input_folder_is_never_read_as_input(bundle, tmp_path, capsys, inside):
    folder = tmp_path / "f3"
    photos(folder, "a.png", "b.jpg", "c.png")
    out = folder / inside
    # run 0 writes the gallery, run 1 replaces it, run 2 writes another beside it: the first is left out
    for run, where in enumerate([out, out, folder / "second"]):
        force = ["--force"] if run or inside == "." else []  # a folder of images is not empty: --force from the start
        assert attend(bundle, str(folder), "--out", str(where), *force) == 0
        stdout, err = capsys.readouterr()
        assert [line.split("\t")[0] for line in stdout.splitlines()] == [
            str(folder / n) for n in ("a.png", "b.jpg", "c.png")
        ]
        assert re.search(r"summary: 3 captioned, 0 failed, 0 skipped", err), err
        files = len(recorded(out))  # 3 sheets, 3 strips and index.html, or their copies of the inputs too
        left = [line for line in err.splitlines() if line.startswith("left out: ")]
        reason = [None, f"in --out {out}, where this gallery goes", f"of captioner attend's gallery in {out}"][run]
        assert left == (
            [f"left out: {files} files {reason} (a file named by itself is read all the same)"] if run else []
        )


def test_the_progress_bar_says_drawing_and_counts_images(bundle, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(options, "progress", lambda args, images: True)
    images = photos(tmp_path / "in", "a.png", "b.png", "c.png")
    images.append(tmp_path / "in" / "broken.png")
    images[-1].write_text("no image")
    assert attend(bundle, str(tmp_path / "in"), "--out", str(tmp_path / "out")) == 1
    err = capsys.readouterr().err
    assert "drawing" in err and "captioning" not in err
    assert re.findall(r"drawing: +\d+%.*? (\d)/4", err)[-1] == "4"
    page = (tmp_path / "out" / "index.html").read_text()
    assert page.index("broken.png") < page.index("a.png")  # the failure is listed first


def test_max_pixels_reaches_the_drawing_and_the_gallery_s_copies(bundle, tmp_path, monkeypatch, capsys):
    image = tmp_path / "in" / "large.tif"  # not copied byte for byte: the copy decodes it
    image.parent.mkdir()
    Image.effect_noise((60, 50), 40).convert("RGB").save(image)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2_000)
    out = tmp_path / "gallery"
    assert attend(bundle, str(image.parent), "--out", str(out)) == 1
    assert "over the limit of 2,000" in capsys.readouterr().err
    assert attend(bundle, str(image.parent), "--out", str(out), "--force", "--max-pixels", "3000") == 0
    capsys.readouterr()
    monkeypatch.undo()  # the sheet is larger than the test's limit
    copies = list((out / "images").iterdir())
    assert [copy.suffix for copy in copies] == [".jpg"]
    with Image.open(copies[0]) as copy:
        assert copy.size == (60, 50)
    with Image.open(out / "0000_large.jpg") as sheet:
        assert sheet.width > 60


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_a_folder_of_photos_past_pillow_s_own_limit_draws_without_pillow_s_warning(
    bundle, tmp_path, monkeypatch, capsys
):
    """A 12000x9000 JPEG (108 MP, past Pillow's 89 MP) in a folder printed Pillow's raw DecompressionBombWarning,
    with its source line; here Pillow's limit is 40,000 pixels and the photos 250x200. The JPEG is drawn at 1/2,
    under the limit; with --max-pixels above Pillow's, it and a TIFF (whose decoder checks Pillow's limit itself)
    are drawn whole. Neither warns (the warning is an error here), in the drawing or in the gallery."""
    folder = tmp_path / "photos"
    photos(folder)
    for name in ("big.jpg", "scan.tif"):
        Image.effect_noise((250, 200), 40).convert("RGB").save(folder / name)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40_000)
    assert attend(bundle, str(folder / "big.jpg"), "--out", str(tmp_path / "jpeg")) == 0
    assert attend(bundle, str(folder), "--out", str(tmp_path / "both"), "--max-pixels", "60000") == 0
    err = capsys.readouterr().err
    assert "Warning" not in err and [line.split(":")[0] for line in err.splitlines()] == ["gallery", "summary"] * 2
    assert sorted(path.name for path in (tmp_path / "both").glob("*.panels.jpg")) == [
        "0000_big.panels.jpg",
        "0001_scan.panels.jpg",
    ]  # both drawn


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
    assert cli.main(["attend", image, "--model", bundles[mode], "--out", str(out), *QUICK]) == 0
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
    sheets = [path for path in out.glob("*.jpg") if not path.name.endswith(".panels.jpg")]
    assert sorted(sheets) == sorted(Path(row[2]) for row in rows)
    assert err.splitlines()[0].startswith(f"error: {folder / '03_text.jpg'}: not an image file")
    page = (out / "index.html").read_text()
    parser = Links()
    parser.feed(page)
    names = [Path(row[2]).stem for row in rows]  # entry n for the n-th input: 0000_01_grey, 0002_25_bitmap, ...
    assert names == [f"{n:04d}_{Path(image).stem}" for n, image in enumerate(images) if image != bad]
    strips = [out / f"{name}.panels.jpg" for name in names]
    assert sorted(out.glob("*.panels.jpg")) == strips
    for strip, row in zip(strips, rows):  # a panel per word, each the image's size, in one row
        with Image.open(row[0]) as image, Image.open(strip) as picture:
            assert picture.size == sheet.Strip(image.size, 3).picture_size
    # the originals, copied so that the folder can be moved: a small PNG as it is, a BMP as JPEG
    copies = [f"images/{name}{'.jpg' if name.endswith('bitmap') else '.png'}" for name in names]
    assert parser.links == [
        link for name, copy in zip(names, copies) for link in (copy, f"{name}.panels.jpg", f"{name}.jpg")
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
    gallery = ["index.html", f"{name}.jpg", f"{name}.panels.jpg", f"images/{name}.jpg"]  # grey and alpha: on white
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
    assert cli.main([*args, "--force"]) == 0  # the file it wrote
    mine = tmp_path / "mine.png"
    mine.write_bytes(before)  # the user's own, under another name
    assert cli.main([*args[:4], "--out", str(mine), "--force", *args[6:]]) == 2
    assert "was not written by captioner, and --force replaces only the files it wrote" in capsys.readouterr().err
    assert mine.read_bytes() == before
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    assert cli.main([*args[:4], "--out", str(tmp_path / "used")]) == 2
    assert "pass --force" in capsys.readouterr().err


def test_a_file_the_writing_thread_cannot_write_stops_the_gallery_and_its_image_is_not_printed(
    bundles, inputs, tmp_path, capsys, monkeypatch
):
    folder, good, _ = inputs
    save = sheet.save_picture

    def full_disk(picture, path):
        if Path(path).name.startswith("0001_") and Path(path).name.endswith(".panels.jpg"):  # the 2nd image's strip
            raise OSError(28, "No space left on device")
        return save(picture, path)

    monkeypatch.setattr(sheet, "save_picture", full_disk)
    out = tmp_path / "gallery"
    assert cli.main(["attend", *good[:3], "--model", bundles["soft"], "--out", str(out), *QUICK]) == 2
    stdout, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in stdout.splitlines()] == [good[0]]  # printed once its files are written
    assert "No space left on device" in err and not (out / "index.html").exists()


def test_an_image_that_cannot_be_drawn_is_its_own_failure_and_a_failed_run_keeps_the_old_gallery(
    bundle, tmp_path, capsys, monkeypatch
):
    from captioner.cli import attend as attend_module
    from captioner.data.images import ImageError

    ok, odd = photos(tmp_path / "in", "ok.png", "odd.png")
    out = tmp_path / "g"
    assert attend(bundle, str(ok), str(odd), "--out", str(out)) == 0
    capsys.readouterr()
    read = attend_module.load_rgb

    def changed(path, *args, **kwargs):  # captioned, then replaced by a file that cannot be drawn
        if Path(path).name == "odd.png":
            raise ImageError(path, "not an image file (Pillow cannot identify its format)")
        return read(path, *args, **kwargs)

    monkeypatch.setattr(attend_module, "load_rgb", changed)
    assert attend(bundle, str(ok), str(odd), "--out", str(out), "--force") == 1
    stdout, err = capsys.readouterr()
    assert [line.split("\t")[0] for line in stdout.splitlines()] == [str(ok)]
    assert f"error: {odd}: cannot be drawn: not an image file" in err and "summary: 1 captioned, 1 failed" in err
    page = (out / "index.html").read_text()
    assert "Not captioned (1)" in page and f"{odd}</code>: cannot be drawn: not an image file" in page
    assert sorted(recorded(out)) == ["0000_ok.jpg", "0000_ok.panels.jpg", "images/0000_ok.png", "index.html"]
    before = snapshot(out)
    save = sheet.save_picture

    def full_disk(picture, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sheet, "save_picture", full_disk)
    assert attend(bundle, str(ok), "--out", str(out), "--force") == 2
    assert "No space left on device" in capsys.readouterr().err
    assert snapshot(out) == before  # the new gallery never got ready: the old one is whole
    assert sorted(path.name for path in tmp_path.iterdir()) == ["g", "in"]  # nothing of the new one left beside
    monkeypatch.setattr(sheet, "save_picture", save)


def test_a_jpeg_drawn_at_a_reduced_scale_is_shown_and_copied_at_it(bundle, tmp_path, capsys):
    """2001x1999 under 1,000,000 pixels: libjpeg draws it at 1/4 (501x500), and the gallery's copy of it, which
    keeps no more than COPY_SIDE a side, is made at that scale too, not refused."""
    (ok,) = photos(tmp_path / "in", "ok.png")
    odd = tmp_path / "in" / "odd.jpg"
    Image.new("RGB", (2001, 1999), (200, 40, 40)).save(odd)
    out = tmp_path / "g"
    assert attend(bundle, str(ok), str(odd), "--out", str(out), "--max-pixels", "1000000") == 0
    assert "summary: 2 captioned, 0 failed" in capsys.readouterr().err
    with Image.open(out / "images" / "0001_odd.jpg") as copy:
        assert copy.size == (501, 500)
