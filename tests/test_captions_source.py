"""data=captions: a user's folder of images and captions file (CSV, TSV, JSON Lines), its problems all at once,
its split by image written into the run folder and read back by ``captioner evaluate``, and the README's three
commands run as written."""

from __future__ import annotations

import json
import logging
import random
import re
import shlex
import subprocess
import sys
from codecs import BOM_UTF16_BE, BOM_UTF16_LE, BOM_UTF32_LE
from pathlib import Path

import pytest
from PIL import Image
from test_datasets_guide import TINY_RUN as GUIDE_TINY_RUN

from captioner.config import CaptionsSpec
from captioner.data.captions_file import SPLIT_FILE, assign_splits, read_captions, read_split
from captioner.data.sources import CaptionsSource
from captioner.errors import ConfigError, DataError, DataProblems
from captioner.training import preflight
from conftest import ROOT, compose_plain, subprocess_env

WORDS = ["a", "red", "blue", "green", "square", "circle", "star", "on", "the", "left", "right", "two", "shapes"]


def write_images(folder: Path, names: list[str]) -> None:
    """Small distinct JPEGs named ``names`` under ``folder``."""
    for index, name in enumerate(names):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 40), (index * 37 % 256, 90, 200 - index * 13 % 200)).save(folder / name)


def irregular_set(folder: Path, images: int = 30, seed: int = 0) -> dict[str, list[str]]:
    """A user's set under ``folder``: ``images`` JPEGs with 1 to 7 captions each, one of them unreadable, and
    ``captions.csv`` (one row per caption, no split column). Returns image -> its captions."""
    rng = random.Random(seed)
    names = [f"img_{index:03d}.jpg" for index in range(images)]
    write_images(folder, names)
    captions = {name: [" ".join(rng.choices(WORDS, k=5)) + f" {k}" for k in range(rng.randint(1, 7))] for name in names}
    rows = ["image,caption", *(f"{name},{caption}" for name, texts in captions.items() for caption in texts)]
    (folder / "captions.csv").write_text("\n".join(rows) + "\n")
    return captions


def spoil_one(folder: Path, source: CaptionsSource) -> str:
    """Make one training image unreadable: one that preflight's decode sample (first, middle, last) passes by."""
    train = source.records("train")
    Path(train[1].image_path).write_bytes(b"not an image")
    return train[1].image_path


# ----------------------------------------------------------------------------------------------- the layouts
def test_csv_with_bom_crlf_quoted_commas_blank_lines_and_unicode(tmp_path: Path) -> None:
    write_images(tmp_path, ["café.jpg", "b.jpg", "sub/c.jpg"])
    text = (
        "\ufeffimage,caption\r\n"
        'café.jpg,"A dog, a cat and a bird."\r\n'
        "\r\n"
        "b.jpg,Ein Bär läuft über die Straße\r\n"
        'café.jpg,"a caption over\r\ntwo lines"\r\n'
        "   \r\n"
        "./sub/c.jpg,  spaced   out  \r\n"
        "b.jpg,二匹の犬\r\n"
    )
    (tmp_path / "captions.csv").write_bytes(text.encode("utf-8"))
    found = read_captions(tmp_path / "captions.csv", CaptionsSpec(val=1, test=1))
    by_name = {found.names[r.image_id]: r for r in found.records}
    assert by_name["café.jpg"].captions == ("A dog, a cat and a bird.", "a caption over two lines")
    assert by_name["b.jpg"].captions == ("Ein Bär läuft über die Straße", "二匹の犬")
    assert by_name["sub/c.jpg"].captions == ("spaced out",)
    assert [found.names[r.image_id] for r in found.records] == ["café.jpg", "b.jpg", "sub/c.jpg"]  # file order
    assert [r.image_id for r in found.records] == [0, 1, 2]
    assert by_name["sub/c.jpg"].image_path == str(tmp_path / "sub" / "c.jpg")
    assert sorted(r.split for r in found.records) == ["test", "train", "val"]


def test_tsv_by_suffix_or_by_header_and_other_column_names(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg"])
    rows = "file\ttext\tsplit\na.jpg\tone, with a comma\ttrain\nb.jpg\ttwo\tval\nb.jpg\tthree\tVAL\n"
    spec = CaptionsSpec(image_column="file", caption_column="text")
    for name in ("captions.tsv", "captions.txt"):  # .txt: a tab in the header and no comma
        (tmp_path / name).write_text(rows)
        found = read_captions(tmp_path / name, spec)
        assert [(r.captions, r.split) for r in found.records] == [
            (("one, with a comma",), "train"),
            (("two", "three"), "val"),
        ]


def test_json_lines_with_a_caption_or_a_list_of_captions(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"])
    lines = [
        json.dumps({"image": "a.jpg", "caption": "a dog"}),
        "",
        json.dumps({"image": "b.jpg", "captions": ["two cats", "cats, two"]}, ensure_ascii=False),
        json.dumps({"image": "a.jpg", "caption": "a brown dog", "captions": ["dög"]}, ensure_ascii=False),
        json.dumps({"image": "c.jpg", "captions": ["a bird"]}),
    ]
    (tmp_path / "captions.jsonl").write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode())
    found = read_captions(tmp_path / "captions.jsonl", CaptionsSpec(val=1, test=1))
    assert [r.captions for r in found.records] == [
        ("a dog", "a brown dog", "dög"),
        ("two cats", "cats, two"),
        ("a bird",),
    ]
    (tmp_path / "data.json").write_text("\n".join(lines))  # no known suffix: a first line that starts with {
    assert read_captions(tmp_path / "data.json", CaptionsSpec(val=1, test=1)).records == found.records


def test_paths_are_relative_to_the_images_folder_when_given(tmp_path: Path) -> None:
    write_images(tmp_path / "photos", ["a.jpg", "b.jpg", "c.jpg"])
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "captions.csv").write_text("image,caption\na.jpg,x\nb.jpg,y\nc.jpg,z\n")
    spec = CaptionsSpec(images=str(tmp_path / "photos"), val=1, test=1)
    found = read_captions(tmp_path / "meta" / "captions.csv", spec)
    assert {r.image_path for r in found.records} == {str(tmp_path / "photos" / n) for n in ("a.jpg", "b.jpg", "c.jpg")}


# ----------------------------------------------------------------------------------- problems, all at once
def test_a_split_column_may_name_the_splits_as_other_datasets_do(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"])
    rows = ["a.jpg,one,Training", "b.jpg,two,validation", "c.jpg,three,TEST"]
    (tmp_path / "captions.csv").write_text("\n".join(["image,caption,split", *rows]) + "\n")
    found = read_captions(tmp_path / "captions.csv", CaptionsSpec())
    assert [(Path(r.image_path).name, r.split) for r in found.records] == [
        ("a.jpg", "train"),
        ("b.jpg", "val"),
        ("c.jpg", "test"),
    ]


def test_every_problem_of_a_csv_is_raised_at_once_with_its_line(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg"])
    (tmp_path / "captions.csv").write_text(
        "image,caption,split\n"
        "a.jpg,fine,train\n"  # 2
        "b.jpg,,train\n"  # 3: empty caption
        "missing.jpg,a cat,val\n"  # 4: not found
        "b.jpg,a dog, and a cat,train\n"  # 5: four fields
        "b.jpg,a bird,dev\n"  # 6: no such split
        ",no image,test\n"  # 7: no image
        "a.jpg,again,val\n"  # 8: a.jpg was train on line 2
        "missing.jpg,a cow,val\n"  # 9: the missing image's second row
    )
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.csv", CaptionsSpec())
    file = str(tmp_path / "captions.csv")
    assert info.value.problems == [
        f"{file} line 3: empty caption",
        f"{file} line 4: image not found: {tmp_path / 'missing.jpg'} (named on lines 4, 9)",
        f"{file} line 5: 4 fields, the header has 3; a caption that holds the delimiter must be quoted",
        f"{file} line 6: split 'dev' is not one of train, val, test",
        f"{file} line 7: no image path",
        f"{file} line 8: a.jpg is in split val, but in train on line 2",
    ]
    message = str(info.value).splitlines()
    assert message[0] == f"{file}: 6 problems, listed below by line (docs/datasets.md#your-own-images)"
    assert message[1:] == info.value.problems


def test_line_numbers_count_a_quoted_caption_s_line_breaks_and_blank_lines(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg"])
    (tmp_path / "captions.csv").write_text('image,caption,split\na.jpg,"two\nlines",train\n\nb.jpg,,val\n')
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.csv", CaptionsSpec())
    assert info.value.problems == [f"{tmp_path / 'captions.csv'} line 5: empty caption"]


def test_a_header_in_another_case_and_a_semicolon_csv_read_as_a_spreadsheet_writes_them(tmp_path: Path) -> None:
    # Excel where the decimal mark is a comma saves 'CSV' with ';'; headers come as typed: "Image; Caption;SPLIT".
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"])
    (tmp_path / "captions.csv").write_text(
        "Image; Caption;SPLIT\r\na.jpg;A dog, a cat;train\r\nb.jpg;2,5 apples;val\r\nc.jpg;a tree;test\r\n"
    )
    found = read_captions(tmp_path / "captions.csv", CaptionsSpec())
    assert [(Path(r.image_path).name, r.captions, r.split) for r in found.records] == [
        ("a.jpg", ("A dog, a cat",), "train"),
        ("b.jpg", ("2,5 apples",), "val"),
        ("c.jpg", ("a tree",), "test"),
    ]
    # two columns that differ only in case: neither is guessed
    (tmp_path / "captions.csv").write_text("Image,IMAGE,caption\na.jpg,b.jpg,x\n")
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.csv", CaptionsSpec())
    assert info.value.problems == [
        f"{tmp_path / 'captions.csv'} line 1: the header has no 'image' column (it has 'Image', 'IMAGE', 'caption'); "
        "name the file's column with data.source.image_column"
    ]


def test_a_file_with_a_header_and_no_row_says_so(tmp_path: Path) -> None:
    (tmp_path / "captions.csv").write_text("image,caption\r\n\r\n")
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.csv", CaptionsSpec())
    assert info.value.problems == [
        f"{tmp_path / 'captions.csv'}: the file has a header and no row: it needs a row per caption"
    ]


def test_a_windows_path_not_found_says_the_path_on_disk_when_there_is_one(tmp_path: Path) -> None:
    # Written on Windows: backslashes, and names in another case than the disk's (its paths ignore case).
    write_images(tmp_path, ["sub/a.jpg", "b.jpg", "c.jpg", "IMG_7.JPG", "sub/Dog.jpg", "x.jpg", "X.jpg"])
    (tmp_path / "captions.csv").write_text(
        "image,caption\nsub\\a.jpg,a dog\nb.jpg,a cat\nc.jpg,a cow\nd\\e.jpg,x\nimg_7.jpg,y\nsub\\dog.JPG,z\nx.JPG,w\n"
    )
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.csv", CaptionsSpec(val=1, test=1))
    hint = (
        " is there: write the file's paths as they are on disk (here case counts and a backslash is part of a "
        "file's name)"
    )
    assert [line.split(" line ", 1)[1] for line in info.value.problems] == [
        f"2: image not found: {tmp_path}/sub\\a.jpg; sub/a.jpg{hint}",
        f"5: image not found: {tmp_path}/d\\e.jpg",
        f"6: image not found: {tmp_path}/img_7.jpg; IMG_7.JPG{hint}",
        f"7: image not found: {tmp_path}/sub\\dog.JPG; sub/Dog.jpg{hint}",
        f"8: image not found: {tmp_path}/x.JPG",  # x.jpg and X.jpg: no guess
    ]


def test_a_stray_quote_is_a_problem_of_its_line_not_the_rows_after_it_taken_into_one_caption(tmp_path: Path) -> None:
    # A lenient reader took lines 3-5 into line 2's caption ('a dog b.jpg,a cat c.jpg,a cow d.jpg,a big" pig').
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg", "d.jpg", "e.jpg"])
    file = tmp_path / "captions.csv"
    quote = (
        "a quote is left open or closed before its field ends; a caption that holds a quote is quoted whole, its "
        'quotes doubled: "a ""big"" dog"'
    )
    closed = "(',' expected after '\"')"
    cases = [
        (
            'a.jpg,"a dog\nb.jpg,a cat\nc.jpg,a cow\nd.jpg,a "big" pig\ne.jpg,ok\n',
            f"2: not CSV from here to line 5 {closed}",
        ),
        ('a.jpg,a dog\nb.jpg,"a cat\nc.jpg,a cow\n', "3: not CSV from here to line 4 (unexpected end of data)"),
        ('a.jpg,"Hi" he said\n', f"2: not CSV {closed}"),
    ]
    for rows, problem in cases:
        file.write_text("image,caption\n" + rows)
        with pytest.raises(DataProblems) as info:
            read_captions(file, CaptionsSpec(val=1, test=1))
        assert [line for line in info.value.problems if "not CSV" in line] == [f"{file} line {problem}: {quote}"]
    file.write_text('image,caption\na.jpg,"He said ""hi"", twice"\nb.jpg,a "big" pig\nc.jpg,"two\nlines"\n')
    found = read_captions(file, CaptionsSpec(val=1, test=1))
    assert [record.captions for record in found.records] == [('He said "hi", twice',), ('a "big" pig',), ("two lines",)]


def test_an_image_given_as_a_url_says_to_download_the_images_first(tmp_path: Path) -> None:
    write_images(tmp_path, ["b.jpg", "c.jpg", "d.jpg"])
    url = (
        "; it is a URL: the images are read from files, so download them first (img2dataset writes them as "
        "WebDataset shards, which data=webdataset reads)"
    )
    file = tmp_path / "captions.csv"
    file.write_text("image,caption\nhttps://example.com/a.jpg,a dog\nb.jpg,a cat\nc.jpg,a cow\nd.jpg,a hen\n")
    with pytest.raises(DataProblems) as info:
        read_captions(file, CaptionsSpec(val=1, test=1))
    assert info.value.problems == [f"{file} line 2: image not found: {tmp_path}/https:/example.com/a.jpg{url}"]
    file.write_text("image,caption\nhttps://example.com/a.jpg,a dog\nhttps://example.com/b.jpg,a cat\n")
    with pytest.raises(DataProblems) as info:
        read_captions(file, CaptionsSpec(val=1, test=1))
    assert info.value.problems[0] == (
        f"{file}: its images: 0 of 2 images found under {tmp_path}/https:/example.com (e.g. "
        f"{tmp_path}/https:/example.com/a.jpg){url}"
    )


def test_one_file_named_two_ways_is_a_problem_not_two_images_that_could_be_in_two_splits(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg", "d.jpg"])
    (tmp_path / "link.jpg").symlink_to(tmp_path / "b.jpg")
    file = tmp_path / "captions.csv"
    file.write_text(
        f"image,caption\na.jpg,a dog\nb.jpg,a cat\n{tmp_path}/a.jpg,a hound\nc.jpg,x\nd.jpg,y\nlink.jpg,z\n"
    )
    with pytest.raises(DataProblems) as info:
        read_captions(file, CaptionsSpec(val=1, test=1))
    assert info.value.problems == [
        f"{file} line 4: {tmp_path}/a.jpg is the file a.jpg names (line 2): name each image one way",
        f"{file} line 7: link.jpg is the file b.jpg names (line 3): name each image one way",
    ]


def test_a_json_null_split_is_no_split_not_the_split_named_none(tmp_path: Path) -> None:
    # pandas' to_json(lines=True) writes a missing value as null
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"])
    file = tmp_path / "captions.jsonl"
    file.write_text(
        '{"image": "a.jpg", "caption": "x", "split": "train"}\n{"image": "b.jpg", "caption": "y", "split": null}\n'
    )
    with pytest.raises(DataProblems) as info:
        read_captions(file, CaptionsSpec())
    assert info.value.problems == [f"{file} line 2: no 'split', which line 1 gives"]
    file.write_text(
        '{"image": "a.jpg", "caption": "x", "split": null}\n{"image": "b.jpg", "caption": "y", "split": null}\n'
        '{"image": "c.jpg", "caption": "z", "split": null}\n'
    )
    assert sorted(r.split for r in read_captions(file, CaptionsSpec(val=1, test=1)).records) == ["test", "train", "val"]


def test_a_missing_column_names_the_header_and_the_key(tmp_path: Path) -> None:
    (tmp_path / "captions.csv").write_text("\n\nfilename,text\na.jpg,x\n")
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.csv", CaptionsSpec())
    file = tmp_path / "captions.csv"
    assert info.value.problems == [
        f"{file} line 3: the header has no 'image' column (it has 'filename', 'text'); name the file's column with "
        "data.source.image_column",
        f"{file} line 3: the header has no 'caption' column (it has 'filename', 'text'); name the file's column "
        "with data.source.caption_column",
    ]


def test_every_problem_of_json_lines_is_raised_at_once(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"])
    (tmp_path / "captions.jsonl").write_text(
        '{"image": "a.jpg", "caption": "fine"}\n'
        '{"image": "a.jpg", "caption": "cut\n'
        '["a.jpg", "x"]\n'
        '{"image": "a.jpg"}\n'
        '{"image": "a.jpg", "captions": ["ok", "", 3]}\n'
        '{"caption": "no image"}\n'
        '{"image": "b.jpg", "caption": "fine"}\n{"image": "c.jpg", "caption": "fine"}\n'
    )
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.jsonl", CaptionsSpec(val=1, test=1))
    assert [line.split(" line ", 1)[1] for line in info.value.problems] == [
        "2: not valid JSON (Invalid control character at, column 35)",
        "3: a JSON list, expected an object",
        "4: no caption: give 'caption' (a string) or 'captions' (a list of strings)",
        "5: empty caption",
        "5: a caption of type int, expected a string",
        "6: no 'image' (the image's path, a string)",
    ]


def test_a_caption_without_words_is_a_problem_as_an_empty_one_is(tmp_path: Path) -> None:
    # Only punctuation, symbols or emoji: the tokenizer reads no word, so it would train <start> <end>.
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg", "d.jpg"])
    (tmp_path / "captions.csv").write_text(
        "image,caption\na.jpg,A dog.\na.jpg,...\nb.jpg,\U0001f600 \U0001f600\nc.jpg,\u00e9t\u00e9 42 !\nd.jpg,a cat\n",
        encoding="utf-8",
    )
    (tmp_path / "captions.jsonl").write_text(
        '{"image": "a.jpg", "captions": ["A dog.", "!!! ???"]}\n{"image": "c.jpg", "caption": "- -"}\n'
        '{"image": "b.jpg", "caption": "a cat"}\n{"image": "d.jpg", "caption": "a cat"}\n'
    )
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.csv", CaptionsSpec(val=1, test=1))
    assert [line.split(" line ", 1)[1] for line in info.value.problems] == [
        "3: caption '...' has no words (only punctuation, symbols or emoji)",
        "4: caption '\U0001f600 \U0001f600' has no words (only punctuation, symbols or emoji)",
    ]
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.jsonl", CaptionsSpec(val=1, test=1))
    assert [line.split(" line ", 1)[1] for line in info.value.problems] == [
        "1: caption '!!! ???' has no words (only punctuation, symbols or emoji)",
        "2: caption '- -' has no words (only punctuation, symbols or emoji)",
    ]


def test_a_file_that_is_not_utf8_says_so_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "captions.csv").write_bytes("image,caption\na.jpg,ok\nb.jpg,caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataProblems, match="line 3: not UTF-8 text"):
        read_captions(tmp_path / "captions.csv", CaptionsSpec())


def test_a_windows_1252_file_is_named_with_its_line_and_read_with_data_source_encoding(tmp_path: Path) -> None:
    # A spreadsheet's plain 'CSV' on Windows: the bad byte far past the decoder's first chunk of 8 KiB.
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg", "d.jpg"])
    rows = [f"{name},a plain caption {k}" for k in range(400) for name in ("a.jpg", "b.jpg", "c.jpg")]
    text = "image,caption\r\n" + "\r\n".join([*rows, "d.jpg,Caf\u00e9 cr\u00e8me \u2014 na\u00efve"]) + "\r\n"
    (tmp_path / "captions.csv").write_bytes(text.encode("cp1252"))
    with pytest.raises(DataProblems) as info:
        read_captions(tmp_path / "captions.csv", CaptionsSpec(val=1, test=1))
    assert info.value.problems == [
        f"{tmp_path / 'captions.csv'} line 1202: not UTF-8 text (byte 0xe9; as cp1252 the line reads "
        "'d.jpg,Caf\u00e9 cr\u00e8me \u2014 na\u00efve'): save the file as UTF-8 (a spreadsheet's 'CSV UTF-8'), or "
        "read it as it is with data.source.encoding=cp1252"
    ]
    found = read_captions(tmp_path / "captions.csv", CaptionsSpec(val=1, test=1, encoding="cp1252"))
    assert found.records[3].captions == ("Caf\u00e9 cr\u00e8me \u2014 na\u00efve",)
    with pytest.raises(DataProblems, match=r"line 1202: not ascii text \(byte 0xe9\): give the file's encoding"):
        read_captions(tmp_path / "captions.csv", CaptionsSpec(val=1, test=1, encoding="ascii"))
    with pytest.raises(ConfigError, match="encoding='nope' is not a text encoding"):
        CaptionsSpec(encoding="nope")


def test_a_byte_order_mark_names_the_encoding_utf16_as_excel_s_unicode_text(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"])
    text = "image\tcaption\r\na.jpg\tna\u00efve caf\u00e9\r\nb.jpg\tb\r\nc.jpg\tc\r\n"
    for bom, encoding in ((BOM_UTF16_LE, "utf-16-le"), (BOM_UTF16_BE, "utf-16-be"), (BOM_UTF32_LE, "utf-32-le")):
        (tmp_path / "captions.txt").write_bytes(bom + text.encode(encoding))
        found = read_captions(tmp_path / "captions.txt", CaptionsSpec(val=1, test=1, encoding="cp1252"))
        assert [record.captions for record in found.records] == [("na\u00efve caf\u00e9",), ("b",), ("c",)]


def test_duplicate_rows_are_kept_once_counted_and_reported_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"])
    (tmp_path / "captions.csv").write_text(
        "image,caption\na.jpg,a dog\na.jpg,a  dog\nb.jpg,x\nc.jpg,y\na.jpg,a cat\nb.jpg,x\n"
    )
    source = CaptionsSource(str(tmp_path / "captions.csv"), val=1, test=1, write_split=str(tmp_path / "split.json"))
    with caplog.at_level(logging.WARNING):
        source.prepare()
    assert source.read().duplicates == [3, 7]
    assert [r.captions for r in source.read().records] == [("a dog", "a cat"), ("x",), ("y",)]
    assert f"{tmp_path / 'captions.csv'}: 2 duplicate rows (a caption its image already has) kept once: lines 3, 7" in (
        caplog.text
    )
    assert json.loads((tmp_path / "split.json").read_text())["duplicate_rows"] == 2


# ------------------------------------------------------------------------------------------------- the split
def test_the_split_is_by_image_seeded_and_independent_of_the_rows_order(tmp_path: Path) -> None:
    captions = irregular_set(tmp_path, images=40)
    spec = CaptionsSpec(val=5, test=0.2)
    first = read_captions(tmp_path / "captions.csv", spec)
    sizes = {split: len(first.split(split)) for split in ("train", "val", "test")}
    assert sizes == {"train": 27, "val": 5, "test": 8}
    assert {first.names[r.image_id]: len(r.captions) for r in first.records} == {
        name: len(texts) for name, texts in captions.items()
    }  # every caption of an image in the image's one split
    assert {len(texts) for texts in captions.values()} >= {1, 7}
    lines = (tmp_path / "captions.csv").read_text().splitlines()
    random.Random(1).shuffle(body := lines[1:])
    (tmp_path / "shuffled.csv").write_text("\n".join([lines[0], *body]))
    shuffled = read_captions(tmp_path / "shuffled.csv", spec)
    split_of = {first.names[r.image_id]: r.split for r in first.records}
    assert {shuffled.names[r.image_id]: r.split for r in shuffled.records} == split_of
    again = read_captions(tmp_path / "captions.csv", spec)
    assert again.records == first.records
    other = read_captions(tmp_path / "captions.csv", CaptionsSpec(val=5, test=0.2, seed=1))
    assert {other.names[r.image_id]: r.split for r in other.records} != split_of


def test_split_sizes_are_checked(tmp_path: Path) -> None:
    assert CaptionsSpec(val=0.01).held_out("val", 50) == 1  # a fraction gives at least one image
    assert CaptionsSpec(test=0.25).held_out("test", 10) == 2
    with pytest.raises(ConfigError, match="val=2.5 must be a whole number"):
        CaptionsSpec(val=2.5)
    with pytest.raises(ConfigError, match="test=0 must be > 0"):
        CaptionsSpec(test=0)
    with pytest.raises(DataError, match="hold out 2 \\+ 2 of the file's 4 images, leaving none to train on"):
        assign_splits(["a", "b", "c", "d"], CaptionsSpec(val=2, test=2))


def test_the_run_s_split_file_is_written_and_reused_with_its_ids(tmp_path: Path) -> None:
    irregular_set(tmp_path, images=20)
    written = tmp_path / "run" / SPLIT_FILE
    source = CaptionsSource(str(tmp_path / "captions.csv"), write_split=str(written), seed=3)
    source.prepare()
    document = json.loads(written.read_text())
    assert document["settings"]["seed"] == 3 and document["sizes"] == {"train": 16, "val": 2, "test": 2}
    ids = {entry["image"]: (entry["id"], entry["split"]) for entry in document["images"]}
    assert read_split(written) == ids
    # the file's rows reordered and one image added: the run's ids and splits still hold, the new image is in none
    lines = (tmp_path / "captions.csv").read_text().splitlines()
    write_images(tmp_path, ["new.jpg"])
    (tmp_path / "edited.csv").write_text("\n".join([lines[0], "new.jpg,a new one", *reversed(lines[1:])]))
    reused = CaptionsSource(str(tmp_path / "edited.csv"), split_from=str(written))
    for split in ("train", "val", "test"):
        ours = [(r.image_id, r.image_path, sorted(r.captions)) for r in source.records(split)]
        assert [(r.image_id, r.image_path, sorted(r.captions)) for r in reused.records(split)] == ours
    assert reused.read().left_out == ["new.jpg"]
    (tmp_path / "fewer.csv").write_text("\n".join(line for line in lines if not line.startswith("img_004.jpg,")))
    with pytest.raises(DataProblems, match="images of the run's split are not in the file"):
        CaptionsSource(str(tmp_path / "fewer.csv"), split_from=str(written)).records("test")


def test_evaluate_reads_the_split_beside_the_model_and_scores_the_run_s_test_images(tmp_path: Path) -> None:
    from captioner.cli import evaluate
    from captioner.cli.parser import parse

    irregular_set(tmp_path, images=20)
    run = tmp_path / "outputs" / "run"
    source = CaptionsSource(str(tmp_path / "captions.csv"), write_split=str(run / SPLIT_FILE), test=4)
    source.prepare()
    (run / "checkpoints").mkdir()
    for model in (run, run / "bundle.pt", run / "checkpoints" / "last.ckpt"):
        args = parse(["evaluate", "--model", str(model), "--captions", str(tmp_path / "captions.csv"), "--out", "e"])
        assert evaluate._records(args) == source.records("test")  # noqa: SLF001 - the split it scores
        assert len(source.records("test")) == 4
    args = parse(["evaluate", "--model", str(tmp_path), "--captions", str(tmp_path / "captions.csv"), "--out", "e"])
    with pytest.raises(ConfigError, match=f"no {SPLIT_FILE} beside --model .*give the run's folder, or its split"):
        evaluate._records(args)  # noqa: SLF001
    args = parse(
        ["evaluate", "--model", "m", "--captions", "c.csv", "--split-file", str(run / SPLIT_FILE), "--out", "e"]
    )
    with pytest.raises(DataError, match="--captions c.csv: file not found"):
        evaluate._records(args)  # noqa: SLF001
    args = parse(["evaluate", "--model", "m", "--shapes", "s", "--split-file", str(run / SPLIT_FILE), "--out", "e"])
    with pytest.raises(ConfigError, match="--split-file goes with --captions"):
        evaluate.run(args)


def test_evaluate_without_the_run_s_split_file_scores_the_test_images_of_the_file_s_own_split_column(
    tmp_path: Path,
) -> None:
    from captioner.cli import evaluate
    from captioner.cli.parser import parse

    names = [f"photos/p{index}.jpg" for index in range(6)]
    write_images(tmp_path, names)
    splits = ["train", "train", "test", "val", "test", "train"]
    rows = [f"{name},a photo number {index},{split}" for index, (name, split) in enumerate(zip(names, splits))]
    (tmp_path / "captions.csv").write_text("\n".join(["image,caption,split", *rows]) + "\n")
    bundle = tmp_path / "elsewhere" / "bundle.pt"  # a bundle copied away from its run folder: no split file beside it
    args = parse(["evaluate", "--model", str(bundle), "--captions", str(tmp_path / "captions.csv"), "--out", "e"])
    records = evaluate._records(args)  # noqa: SLF001 - the split it scores
    assert [(Path(r.image_path).name, r.image_id, r.captions) for r in records] == [
        ("p2.jpg", 2, ("a photo number 2",)),
        ("p4.jpg", 4, ("a photo number 4",)),
    ]
    (tmp_path / "captions.csv").write_text("\n".join(["image,caption", *(",".join(r.split(",")[:2]) for r in rows)]))
    with pytest.raises(ConfigError, match="and the file has no 'split' column to split it: give the run's folder"):
        evaluate._records(args)  # noqa: SLF001 - a hashed split is the run's seed's and sizes': never guessed


# ------------------------------------------------------------------------------------------------ preflight
def test_preflight_names_a_missing_file_or_folder_and_lists_each_problem_of_the_file_once(tmp_path: Path) -> None:
    plain = compose_plain(["experiment=captions_cpu"], tmp_path)
    assert [str(p) for p in preflight.problems(plain)] == [
        "data.source.captions is null; give the file's path (docs/datasets.md#your-own-images)"
    ]
    given = [f"data.source.captions={tmp_path / 'nope.csv'}", f"data.source.images={tmp_path / 'photos'}"]
    found = [str(p) for p in preflight.problems(compose_plain(["experiment=captions_cpu", *given], tmp_path))]
    assert found == [
        f"data.source.captions={str(tmp_path / 'nope.csv')!r}: file not found; give the captions file: CSV or TSV "
        "with an image,caption header, or JSON Lines (docs/datasets.md#your-own-images)",
        f"data.source.images={str(tmp_path / 'photos')!r}: folder not found; give the images' folder "
        "(docs/datasets.md#images)",
    ]
    irregular_set(tmp_path, images=12)
    with (tmp_path / "captions.csv").open("a") as handle:
        handle.write("gone.jpg,a cat\nimg_000.jpg,\n")
    lines = len((tmp_path / "captions.csv").read_text().splitlines())
    plain = compose_plain(["experiment=captions_cpu", f"data.source.captions={tmp_path / 'captions.csv'}"], tmp_path)
    assert [str(p) for p in preflight.problems(plain)] == [
        f"{tmp_path / 'captions.csv'} line {lines - 1}: image not found: {tmp_path / 'gone.jpg'}; fix the captions "
        "file (docs/datasets.md#your-own-images)",
        f"{tmp_path / 'captions.csv'} line {lines}: empty caption; fix the captions file "
        "(docs/datasets.md#your-own-images)",
    ]  # read for train, val and test: listed once


def test_images_all_elsewhere_are_one_line_and_a_file_broken_on_every_row_is_listed_up_to_a_page(
    tmp_path: Path,
) -> None:
    # The images in another folder than the file's: one line saying so, not one per image (a terminal of 40,000).
    (tmp_path / "captions.csv").write_text("image,caption\n" + "".join(f"p{k}.jpg,a dog\n" for k in range(150)))
    captions = f"data.source.captions={tmp_path / 'captions.csv'}"
    found = [str(p) for p in preflight.problems(compose_plain(["experiment=captions_cpu", captions], tmp_path))]
    assert found == [
        f"{tmp_path / 'captions.csv'}: its images: 0 of 150 images found under {tmp_path} (e.g. {tmp_path}/p0.jpg): "
        f"the paths are relative to the file's folder, {tmp_path}; give the folder they are relative to with "
        "data.source.images=DIR; fix the captions file (docs/datasets.md#your-own-images)"
    ]
    # one of them there: each of the others is a problem of its own line, the first 100 listed, then a count
    write_images(tmp_path, ["p0.jpg"])
    found = [str(p) for p in preflight.problems(compose_plain(["experiment=captions_cpu", captions], tmp_path))]
    assert len(found) == 101 and found[0].startswith(f"{tmp_path / 'captions.csv'} line 3: image not found")
    assert found[-1] == (
        "... and 49 more problems of the same file, not listed; fix the captions file "
        "(docs/datasets.md#your-own-images)"
    )


def test_the_recipes_run_where_the_user_is_under_names_of_their_own(tmp_path: Path) -> None:
    cpu = compose_plain(["experiment=captions_cpu"], tmp_path)
    demo = compose_plain([], tmp_path)
    gpu = compose_plain(["experiment=captions_gpu"], tmp_path)
    coco = compose_plain(["experiment=coco_soft"], tmp_path)
    assert cpu["model"]["encoder"] == demo["model"]["encoder"] and cpu["model"]["encoder"]["weights"] is None
    assert cpu["model"]["decoder"] == demo["model"]["decoder"] and cpu["trainer"]["accelerator"] == "cpu"
    assert gpu["model"] == coco["model"] and gpu["data"]["image_size"] == coco["data"]["image_size"] == 448
    assert (cpu["task_name"], gpu["task_name"]) == ("captions_cpu", "captions_gpu")
    for plain in (cpu, gpu):
        assert plain["data"]["source"]["_target_"] == "captioner.data.sources.CaptionsSource"
        assert plain["data"]["source"]["write_split"] == str(tmp_path / "out" / SPLIT_FILE)  # the run's folder
    with pytest.raises(ConfigError, match="data.source.captoins is not a known key; valid keys: captions, split_from"):
        CaptionsSource("c.csv", captoins="x")


# ------------------------------------------------------------------------------- the README's three commands
def readme_commands() -> list[str]:
    """The command lines of the README's "Your own images" section, in order."""
    section = (ROOT / "README.md").read_text().split("## Your own images\n")[1].split("\n## ")[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    return [line.strip() for line in block.splitlines() if line.strip()]


# What makes the README's run tiny: the datasets guide's tiny run (a small decoder on a 2x2 grid of 64 px images, one
# epoch), without sample pictures, logging to CSV only.
TINY_RUN = [*GUIDE_TINY_RUN, "callbacks.samples=null", "logger=csv"]
QUICK = ["--workers", "0", "--max-len", "4", "--no-progress"]


@pytest.mark.slow
def test_the_readme_s_own_images_commands_run_as_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from captioner import cli

    train, caption, evaluate = readme_commands()
    assert train.startswith("python train.py experiment=captions_cpu data.source.captions=")
    photos = tmp_path / Path(shlex.split(train)[3].split("=", 1)[1]).parent
    irregular_set(photos, images=30)
    spoiled = spoil_one(photos, CaptionsSource(str(photos / "captions.csv")))
    write_images(tmp_path / shlex.split(caption)[2], ["new_1.jpg", "new_2.jpg"])

    command = [sys.executable, str(ROOT / "train.py"), *shlex.split(train)[2:], *TINY_RUN]
    proc = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = (tmp_path / "outputs" / "captions_cpu" / "runs").iterdir()  # under the recipe's own name
    assert f"skipped 1 unreadable image: {Path(spoiled).relative_to(tmp_path)}" in proc.stdout
    test_images = [
        entry["id"] for entry in json.loads((run / SPLIT_FILE).read_text())["images"] if entry["split"] == "test"
    ]
    assert len(test_images) == 3

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        capsys.readouterr()
        assert cli.main([*shlex.split(caption.replace("<run>", run.name))[1:], *QUICK]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 2  # a caption for each new photo
        assert cli.main([*shlex.split(evaluate.replace("<run>", run.name))[1:], *QUICK, "--no-coco"]) == 0
    out = tmp_path / shlex.split(evaluate)[-1]
    assert [row["image_id"] for row in json.loads((out / "per_image.json").read_text())] == sorted(test_images)
    assert json.loads((out / "metrics.json").read_text())["images"] == 3


@pytest.mark.slow
def test_train_py_refuses_a_broken_file_before_any_run_folder_exists(tmp_path: Path) -> None:
    irregular_set(tmp_path / "photos", images=6)
    with (tmp_path / "photos" / "captions.csv").open("a") as handle:
        handle.write("missing.jpg,a cat\nimg_001.jpg,\n")
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "experiment=captions_cpu",
        "data.source.captions=photos/captions.csv",
    ]
    proc = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: photos/captions.csv line ") for line in lines), lines
    assert "image not found: photos/missing.jpg" in lines[0] and "empty caption" in lines[1]
    assert not (tmp_path / "outputs").exists()
