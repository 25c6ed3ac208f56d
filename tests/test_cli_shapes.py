"""``captioner shapes``: its options are ShapesSpec's fields, with their defaults in ``--help``; an option the chosen
scenes do not use is refused; the printed overrides train on what was generated."""

from __future__ import annotations

from dataclasses import fields

import pytest

from captioner import cli
from captioner.cli.parser import SHAPES_OPTIONS
from captioner.config import ShapesSpec


def test_shapes_generates_a_small_set_and_says_how_to_train_on_it(tmp_path, capsys):
    out = tmp_path / "small"
    args = ["shapes", "--out", str(out), "--train", "6", "--val", "2", "--test", "3", "--image-size", "32"]
    assert cli.main(args) == 0
    overrides = f"data.source.root={out} data.source.n_train=6 data.source.n_val=2 data.source.n_test=3"
    assert capsys.readouterr().err == (
        f"{out}: generated, 6 train, 2 val and 3 test images of 32 px (seed 0); train on it with: python train.py "
        f"{overrides} data.source.image_size=32\n"
    )
    assert [len(list((out / "images" / split).glob("*.png"))) for split in ("train", "val", "test")] == [6, 2, 3]
    assert cli.main(args) == 0 and "already there" in capsys.readouterr().err
    assert cli.main([*args[:-1], "48"]) == 2
    err = capsys.readouterr().err
    assert "made with different parameters (image_size=32 (asked 48))" in err
    assert "give another folder (train.py: data.source.root=FOLDER, captioner shapes --out FOLDER)" in err
    assert cli.main(["shapes", "--out", str(tmp_path / "x"), "--train", "0"]) == 2
    assert capsys.readouterr().err == "error: --train=0 must be >= 1\n"


def test_every_field_of_shapes_spec_is_an_option() -> None:
    assert list(SHAPES_OPTIONS) == [item.name for item in fields(ShapesSpec)]


def test_shapes_help_shows_each_option_s_default(capsys) -> None:
    assert cli.main(["shapes", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    for option in (
        "--train N training images (default: 3000)",
        "--val N validation images (default: 250)",
        "--test N test images (default: 250)",
        "--image-size N simple scenes only: the square images' side in pixels (default: 96)",
        "--seed N the same seed, the same images (default: 0)",
        "(default: simple)",
        "--width N cluttered scenes only: image width in pixels (default: 160)",
        "--height N cluttered scenes only: image height in pixels (default: 120)",
    ):
        assert option in shown, option
    assert "built-in set's" not in shown


@pytest.mark.parametrize(
    "options, message",
    [
        (["--width", "50"], "--width does not apply to the simple scenes (they take --train, --val, --test, "),
        (
            ["--scenes", "cluttered", "--image-size", "64", "--seed", "1"],
            "--image-size does not apply to the cluttered scenes (they take --train, --val, --test, --seed, --width, ",
        ),
    ],
)
def test_an_option_the_chosen_scenes_do_not_use_is_refused(options, message, tmp_path, capsys) -> None:
    assert cli.main(["shapes", "--out", str(tmp_path / "x"), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1 and not (tmp_path / "x").exists()
