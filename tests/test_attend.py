"""``captioner attend`` into a folder: ``--force`` replaces only what a gallery wrote, never an input or a user's
file, and only once the model has loaded; a gallery inside its input folder is never read as input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from captioner import cli
from captioner.cli import options
from conftest import snapshot, write_bundle

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
    assert "pass --force to overwrite it" in capsys.readouterr().err
    for _ in range(2):  # the second replaces the first's files
        assert attend(bundle, str(project / "images"), "--out", str(project), "--force") == 0
        err = capsys.readouterr().err
        assert re.search(r"summary: 2 captioned, 0 failed", err), err
        after = snapshot(project)
        assert {name: after.get(name) for name in users} == users  # every file of the user's, as it was
        gallery = sorted(set(after) - set(users))
        assert gallery == sorted(
            [".captioner-gallery", "index.html", "0000_0001_cat.jpg", "0001_0002_dog.jpg"]
            + [f"{n}/0{k}.jpg" for n in ("0000_0001_cat", "0001_0002_dog") for k in (1, 2)]
        )  # the inputs lie inside the gallery: linked, not copied
        assert sorted(recorded(project)) == [name for name in gallery if name != ".captioner-gallery"]
    assert attend(bundle, str(project / "images" / "0002_dog.png"), "--out", str(project), "--force") == 0
    after = snapshot(project)
    assert {name: after.get(name) for name in users} == users
    assert not (project / "0001_0002_dog.jpg").exists() and not (project / "0001_0002_dog").exists()  # the old
    assert (project / "0000_0002_dog.jpg").is_file()


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


@pytest.mark.parametrize("inside", ["overlays", "."])
def test_a_gallery_inside_its_input_folder_is_never_read_as_input(bundle, tmp_path, capsys, inside):
    folder = tmp_path / "f3"
    photos(folder, "a.png", "b.jpg", "c.png")
    out = folder / inside
    for run in range(2):
        force = ["--force"] if run or inside == "." else []  # a folder of images is not empty: --force from the start
        assert attend(bundle, str(folder), "--out", str(out), *force) == 0
        stdout, err = capsys.readouterr()
        assert [line.split("\t")[0] for line in stdout.splitlines()] == [
            str(folder / n) for n in ("a.png", "b.jpg", "c.png")
        ]
        assert re.search(r"summary: 3 captioned, 0 failed, 0 skipped", err), err


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
