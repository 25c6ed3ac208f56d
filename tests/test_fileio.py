"""fileio: atomic writes, new run folders, and reads that fail with one line naming the file."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from captioner.errors import BundleError, DataError
from captioner.fileio import atomic_write, load_torch, new_folder, read_json, save_torch, write_json


def test_an_interrupted_write_leaves_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    write_json(path, {"bleu4": 0.25})
    with pytest.raises(TypeError):
        write_json(path, {"bleu4": 0.5, "oops": object()})  # fails half way through the dump
    assert json.loads(path.read_text()) == {"bleu4": 0.25}
    with pytest.raises(KeyboardInterrupt), atomic_write(path, "w") as handle:  # noqa: PT012  interrupted mid-write
        handle.write('{"bleu4": 0.')
        raise KeyboardInterrupt
    assert json.loads(path.read_text()) == {"bleu4": 0.25}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]  # no temporary file left
    (tmp_path / "plain.txt").write_text("")
    assert path.stat().st_mode == (tmp_path / "plain.txt").stat().st_mode  # not private like mkstemp's


def test_a_file_of_the_longest_name_is_written(tmp_path: Path) -> None:
    """A name of 255 bytes is a file's longest: the temporary file beside it, named after it, was past that."""
    target = tmp_path / ("x" * 251 + ".png")  # captioner attend photo.jpg --out <such a name>
    with atomic_write(target, "wb") as handle:
        handle.write(b"drawn")
    assert target.read_bytes() == b"drawn" and os.listdir(tmp_path) == [target.name]


def test_run_folders_are_never_shared(tmp_path: Path) -> None:
    folders: list[Path] = []
    threads = [
        threading.Thread(target=lambda: folders.append(new_folder(tmp_path / "runs" / "same-second"))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(folders)) == 8 and all(f.is_dir() and not any(f.iterdir()) for f in folders)
    assert new_folder(tmp_path / "runs" / "same-second") == tmp_path / "runs" / "same-second_8"


def test_read_json_names_a_missing_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"^split file not found: {tmp_path / 'none.json'}$"):
        read_json(tmp_path / "none.json", "split file")
    (tmp_path / "half.json").write_text('{"images": [')
    with pytest.raises(DataError, match=f"^split file {tmp_path / 'half.json'} is not valid JSON: Expecting value"):
        read_json(tmp_path / "half.json", "split file")
    (tmp_path / "latin1.json").write_bytes('{"caption": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(DataError, match="latin1.json is not valid JSON"):
        read_json(tmp_path / "latin1.json", "split file")
    (tmp_path / "notepad.json").write_bytes(b"\xef\xbb\xbf" + '{"caption": "caf\u00e9"}'.encode())  # a BOM: read
    assert read_json(tmp_path / "notepad.json") == {"caption": "caf\u00e9"}


@pytest.mark.parametrize(
    "write,message",
    [
        (None, "model file not found: {path}"),
        (lambda path: path.mkdir(), "model file {path} is not a file"),
        (lambda path: path.write_bytes(b""), "model file {path} is empty"),
        (
            lambda path: save_torch({"hook": os.system}, path),
            "model file {path} was refused: it contains pickled Python "
            "objects (posix.system) that could run code when loaded",
        ),
        (lambda path: path.write_bytes(b"\x80\x04K\x01."), "model file {path} is truncated or corrupt"),
        (lambda path: path.write_text("notes"), "model file {path} is not a model file (torch.save did not write it)"),
    ],
)
def test_load_torch_refuses_with_one_line_naming_the_file(write, message: str, tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    if write is not None:
        write(path)
    with pytest.raises(BundleError) as info:
        load_torch(path, what="model file")
    assert str(info.value).startswith(message.format(path=path)) and "\n" not in str(info.value)


def test_a_torch_load_error_is_cut_to_its_first_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_torch({"w": torch.ones(2)}, tmp_path / "model.pt")

    def failing(*args, **kwargs) -> None:
        raise RuntimeError(
            "PytorchStreamReader failed reading zip archive: failed finding central directory. "
            "This is a long advice\non two lines"
        )

    monkeypatch.setattr(torch, "load", failing)
    with pytest.raises(BundleError) as info:
        load_torch(tmp_path / "model.pt", what="checkpoint")
    assert str(info.value) == (
        f"checkpoint {tmp_path / 'model.pt'} is truncated or corrupt (RuntimeError: "
        "PytorchStreamReader failed reading zip archive: failed finding central directory)"
    )
