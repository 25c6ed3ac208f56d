"""Results for the COCO evaluation server: ``captioner caption`` and ``evaluate`` with ``--image-info`` write the
server's results file (every image id once, exactly its format, never overwritten without --force); an unreadable
image is named and no incomplete file written; a bad request is one line and exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from captioner import cli
from cli_helpers import QUICK, SHAPE_WORDS, before_summary, one_error_line


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


def _server_request(info: Path, images: Path, out: Path, bundle: str) -> list[str]:
    """``captioner caption`` of an image_info file's images into a results file for the evaluation server (items 1
    and 2 are ``--image-info`` and its file, 5 and 6 ``--images`` and its folder)."""
    return ["caption", "--image-info", str(info), "--images", str(images), "--out", str(out), "--model", bundle]


def test_caption_an_image_info_file_for_the_evaluation_server(bundles, shapes, tmp_path, capsys):
    info = _image_info(shapes, tmp_path / "test2014")
    out = tmp_path / "server"
    args = [*_server_request(info, tmp_path / "test2014", out, bundles["soft"]), *QUICK, "--name", "sat-soft"]
    assert cli.main(args) == 0
    stdout, err = capsys.readouterr()
    target = out / "captions_test2014_sat-soft_results.json"
    record = out / ".captioner-written"  # what --force may replace: this file, which captioner wrote
    assert sorted(out.iterdir()) == [record, target] and record.read_text() == f'"{target.name}"\n'
    assert before_summary(err, captioned=6, failed=0) == [f"results: {target} (6 images)"]
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
        *QUICK,
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
    one_error_line(capsys.readouterr().err, info, "has no 'annotations': it lists images without captions")


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
    args = _server_request(info, tmp_path / "test2014", tmp_path / "out", bundles["soft"])
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
    one_error_line(capsys.readouterr().err, "", message)
    assert not (tmp_path / "out").exists()
