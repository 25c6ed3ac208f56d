"""Preflight: every file and device a training run needs is checked before its folder is made, and every
problem is listed at once, one line each with its remedy and the guide's section."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from captioner.training.preflight import GUIDE, PreflightError, check, problems
from conftest import ROOT, compose_plain, subprocess_env, write_bundle, write_run

NO_WEIGHTS = "model.encoder.weights=null"


def _lines(overrides: list[str], tmp_path: Path) -> list[str]:
    return [str(problem) for problem in problems(compose_plain(overrides, tmp_path))]


def _karpathy_tree(data: Path, present: dict[str, int], sizes: dict[str, int]) -> None:
    """A Karpathy COCO split file of ``sizes`` images per split, of which ``present[split]`` exist as JPEGs."""
    entries = []
    for split, count in sizes.items():
        folder = "train2014" if split == "train" else "val2014"
        (data / "coco" / folder).mkdir(parents=True, exist_ok=True)
        for k in range(count):
            image_id = len(entries) + 1
            name = f"COCO_{folder}_{image_id:012d}.jpg"
            if k < present[split]:
                Image.new("RGB", (8, 8), (k, 0, 0)).save(data / "coco" / folder / name)
            sentence = {"tokens": ["a"], "raw": "a"}
            entries.append({"filepath": folder, "filename": name, "cocoid": image_id, "split": split,
                            "sentences": [sentence]})  # fmt: skip
    (data / "karpathy").mkdir(parents=True)
    (data / "karpathy" / "dataset_coco.json").write_text(json.dumps({"images": entries}))


def test_a_missing_dataset_names_each_file_with_how_to_get_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    lines = _lines(["experiment=coco_soft", f"paths.data_dir={data}", NO_WEIGHTS, "trainer=cpu"], tmp_path)
    split_file = data / "karpathy" / "dataset_coco.json"
    assert lines == [
        f"data.source.split_file='{split_file}': file not found; write it with: captioner splits coco "
        f"--captions-dir {data / 'coco' / 'annotations'} --out {split_file} ({GUIDE}#split-files)",
        f"data.source.image_root='{data / 'coco'}': folder not found; unzip the dataset's images there "
        f"({GUIDE}#images)",
    ]
    coco = _lines(["experiment=coco_soft", "data=coco", f"paths.data_dir={data}", NO_WEIGHTS, "trainer=cpu"], tmp_path)
    assert [line.split(":")[0] for line in coco] == [
        f"data.source.splits.{split}.{key}='{data}/coco/{where}" for split in ("train", "val") for key, where in
        (("captions", f"annotations/captions_{split}2014.json'"), ("images", f"{split}2014'"))
    ]  # fmt: skip
    # COCO's caption files come in annotations_trainval2014.zip, which the guide's section on images downloads
    assert coco[0].endswith(f"file not found; unzip annotations_trainval2014.zip into {data / 'coco'} ({GUIDE}#images)")
    assert all(line.endswith(f"({GUIDE}#images)") for line in coco)


def test_each_split_s_images_are_counted_and_a_sample_decodes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _karpathy_tree(data, present={"train": 3, "val": 0, "test": 2}, sizes={"train": 4, "val": 5, "test": 2})
    (data / "coco" / "val2014" / "COCO_val2014_000000000999.jpg").mkdir()  # a folder is not an image
    broken = data / "coco" / "val2014" / "COCO_val2014_000000000011.jpg"  # the last test image
    broken.write_bytes(b"not a jpeg")
    unreadable = _lines(["experiment=coco_soft", f"paths.data_dir={data}", NO_WEIGHTS, "trainer=cpu"], tmp_path)
    assert not [line for line in unreadable if line.startswith("test")]  # the first decodes: skipped in training
    (data / "coco" / "val2014" / "COCO_val2014_000000000010.jpg").write_bytes(b"")  # and now the first too
    lines = _lines(["experiment=coco_soft", f"paths.data_dir={data}", NO_WEIGHTS, "trainer=cpu"], tmp_path)
    assert lines == [
        f"val: 0 of 5 images found under {data / 'coco' / 'val2014'} (e.g. {data}/coco/val2014/COCO_val2014_"
        "000000000005.jpg); unzip the dataset's images there, or point data.source at the folder that holds them "
        f"({GUIDE}#images)",
        f"test: none of the 2 sample images decodes: {data / 'coco' / 'val2014' / 'COCO_val2014_000000000010.jpg'}: "
        f"file is empty; download it again ({GUIDE}#images)",
    ]
    # test=false: the test split is not read; train=false: nor is train
    assert len(_lines(["experiment=coco_soft", f"paths.data_dir={data}", NO_WEIGHTS, "trainer=cpu", "test=false"],
                      tmp_path)) == 1  # fmt: skip


def test_the_files_the_config_names_and_the_loggers_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "wandb" else real(name))
    overrides = [
        "logger=wandb",
        f"data.vocab_file={tmp_path}/v.json",
        f"init_from={tmp_path}/run",
        f"data.source.root={tmp_path}/s",
    ]
    assert _lines(overrides, tmp_path) == [
        f"data.vocab_file='{tmp_path}/v.json': file not found; give a vocabulary JSON file written by "
        f"Vocabulary.save, or null to build one from the captions ({GUIDE}#train)",
        f"init_from='{tmp_path}/run' does not exist; give a run folder, a .ckpt or a bundle ({GUIDE}#train)",
        f'logger.wandb needs the wandb package, which is not installed; pip install -e ".[wandb]" ({GUIDE}#train)',
    ]
    (tmp_path / "file.txt").write_text("x")
    assert _lines([f"data.source.root={tmp_path}/file.txt"], tmp_path) == [
        f"data.source.root='{tmp_path}/file.txt' is not a folder; give a folder: the built-in dataset is generated "
        f"there on first use ({GUIDE}#images)"
    ]
    check(compose_plain([f"data.source.root={tmp_path}/shapes"], tmp_path))  # the demo needs nothing: no error


def test_the_checkpoint_or_bundle_a_run_starts_from_is_checked_without_loading_it(tmp_path: Path) -> None:
    root = f"data.source.root={tmp_path}/s"
    bundle = write_bundle(tmp_path / "bundle.pt", ["a", "circle"])
    (tmp_path / "empty").mkdir()
    assert _lines([root, f"ckpt_path={bundle}"], tmp_path) == [
        f"ckpt_path='{bundle}' is an inference bundle (weights for captioning, no optimiser or training state), "
        "which no run resumes; to resume a run give its folder or its checkpoints/last.ckpt; to start a new run "
        f"from this bundle's weights give init_from={bundle} instead ({GUIDE}#train)"
    ]
    assert _lines([root, f"ckpt_path={tmp_path / 'empty'}"], tmp_path) == [
        f"ckpt_path='{tmp_path / 'empty'}' is a folder without checkpoints/last.ckpt, the checkpoint a run resumes "
        "from (a run saves it as it trains); give the folder of a run that saved one, or one of its .ckpt files "
        f"({GUIDE}#train)"
    ]
    assert _lines(["experiment=demo_scst", root], tmp_path) == [
        "model.objective=scst fine-tunes a trained captioner; give ckpt_path=<a cross-entropy run folder, its "
        "checkpoint or bundle.pt>, or train with cross-entropy first in the same run (model.scst.after_epochs=N) "
        f"({GUIDE}#train)"
    ]
    assert _lines(["experiment=demo_scst", root, f"ckpt_path={bundle}"], tmp_path) == []  # SCST starts from it
    assert _lines([root, f"init_from={bundle}"], tmp_path) == []


def _flickr_split(folder: Path, splits: tuple[str, ...], sentence: object) -> Path:
    """A Karpathy split file (Flickr's layout) of two images per split, each with ``sentence``, and their images."""
    (folder / "images").mkdir(parents=True)
    entries = []
    for split in splits:
        for k in range(2):
            name = f"{split}{k}.jpg"
            Image.new("RGB", (8, 8), (k, 0, 0)).save(folder / "images" / name)
            entries.append({"filename": name, "imgid": len(entries), "split": split, "sentences": [sentence]})
    (folder / "split.json").write_text(json.dumps({"images": entries}))
    return folder


def test_a_split_file_s_problems_are_listed_once_each_with_the_fix(tmp_path: Path) -> None:
    def lines(folder: Path, *overrides: str) -> list[str]:
        source = [f"data.source.split_file={folder / 'split.json'}", f"data.source.image_root={folder / 'images'}"]
        return _lines(["experiment=flickr8k_soft", NO_WEIGHTS, "trainer=cpu", *source, *overrides], tmp_path)

    sentence = {"raw": "a red square", "tokens": ["a", "red", "square"]}
    no_test = _flickr_split(tmp_path / "no_test", ("train", "val"), sentence)
    assert lines(no_test) == [
        f"test: the dataset lists no image of this split; give it test images, or train without a test split: "
        f"test=false ({GUIDE}#split-files)"
    ]
    assert lines(no_test, "test=false") == []
    strings = _flickr_split(tmp_path / "strings", ("train", "val", "test"), "a red square")
    assert lines(strings) == [  # once, not once per split read from the file
        f"{strings / 'split.json'}: image 0 sentence 0 is a JSON str, expected an object: each sentence is an object "
        'with its caption under "raw", as in {"raw": "A dog runs.", "tokens": ["a", "dog", "runs"]}; give the '
        f"dataset's own annotation files, or write yours in their format ({GUIDE}#split-files)"
    ]
    assert lines(_flickr_split(tmp_path / "fixed", ("train", "val", "test"), sentence)) == []


def test_a_missing_weight_file_says_where_to_save_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no weight file there
    offline = ["model.encoder.weights=IMAGENET1K_V1", "model.encoder.download=false"]  # downloads: test_pretrained
    lines = _lines([*offline, f"data.source.root={tmp_path}/s"], tmp_path)
    assert lines == [
        "model.encoder.weights='IMAGENET1K_V1': the ImageNet weights of resnet18 are not on disk "
        "(model.encoder.download=false); download "
        "https://download.pytorch.org/models/resnet18-f37072fd.pth and save it as "
        f"{tmp_path / 'hub' / 'checkpoints' / 'resnet18-f37072fd.pth'} (TORCH_HOME moves that folder) "
        f"({GUIDE}#encoder-weights)"
    ]


def test_a_run_from_a_checkpoint_needs_no_weight_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no weight file there: the checkpoint's weights replace them
    offline = ["model.encoder.weights=IMAGENET1K_V1", "model.encoder.download=false", f"data.source.root={tmp_path}/s"]
    ce = write_run(tmp_path / "ce", "cross_entropy")
    assert _lines([*offline, f"init_from={write_run(tmp_path / 'run', None)}"], tmp_path) == []
    assert _lines([*offline, f"ckpt_path={ce}", "model.objective=cross_entropy"], tmp_path) == []
    assert len(_lines(offline, tmp_path)) == 1  # from scratch: the file is needed


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_an_accelerator_this_machine_lacks(tmp_path: Path) -> None:
    with pytest.raises(PreflightError) as info:
        check(compose_plain(["trainer=gpu", f"data.source.root={tmp_path}/s"], tmp_path))
    assert str(info.value) == (
        "trainer.accelerator='gpu' but this machine has no usable CUDA GPU; use trainer=cpu (slow for these "
        f"recipes) or a machine with a GPU ({GUIDE}#gpu)"
    )


@pytest.mark.slow
def test_train_py_lists_every_problem_at_once_and_makes_no_run_folder(tmp_path: Path) -> None:
    data, logs = tmp_path / "data", tmp_path / "logs"
    args = ["experiment=coco_soft", f"paths.data_dir={data}", f"paths.log_dir={logs}"]
    env = {**subprocess_env(), "TORCH_HOME": str(tmp_path / "torch")}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and all(line.startswith("error: ") for line in lines), proc.stderr
    keys = [line.split("=")[0].removeprefix("error: ") for line in lines]
    gpu = [] if torch.cuda.is_available() else ["trainer.accelerator"]
    assert keys == ["data.source.split_file", "data.source.image_root", *gpu]  # the weights: downloaded once it can run
    assert not logs.exists() and not (tmp_path / "torch").exists()  # nothing downloaded


def test_a_null_file_or_an_unreadable_folder_is_a_problem_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    coco = ["experiment=coco_soft", "data=coco", f"paths.data_dir={data}", NO_WEIGHTS, "trainer=cpu"]
    lines = _lines([*coco, "data.source.splits.train.captions=null"], tmp_path)
    assert lines[0] == f"data.source.splits.train.captions is null; give the file's path ({GUIDE}#images)"
    _karpathy_tree(data, present={"train": 2, "val": 2, "test": 2}, sizes={"train": 2, "val": 2, "test": 2})

    def denied(folder: str) -> list[str]:
        raise PermissionError(13, "Permission denied", folder)

    monkeypatch.setattr("os.listdir", denied)  # as for another user's folder (root reads every folder)
    lines = _lines(["experiment=coco_soft", f"paths.data_dir={data}", NO_WEIGHTS, "trainer=cpu"], tmp_path)
    assert lines == [
        "the dataset could not be checked: PermissionError: [Errno 13] Permission denied: "
        f"'{data / 'coco' / 'train2014'}'; check that this user can read it ({GUIDE}#split-files)"
    ]


def test_any_other_error_of_a_check_is_one_problem_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(name: str, weights: str) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("captioner.model.pretrained.resolve_weights", broken)
    overrides = [
        f"data.source.root={tmp_path}/s",
        f"data.vocab_file={tmp_path}/v.json",
        "model.encoder.weights=DEFAULT",
    ]
    assert _lines(overrides, tmp_path) == [
        f"data.vocab_file='{tmp_path}/v.json': file not found; give a vocabulary JSON file written by "
        f"Vocabulary.save, or null to build one from the captions ({GUIDE}#train)",
        "the encoder's weights could not be checked: ZeroDivisionError: division by zero; see the encoder's config "
        f"in conf/model ({GUIDE}#encoder-weights)",
    ]
    with pytest.raises(PreflightError):
        check(compose_plain(overrides[::2], tmp_path))


# ``python -c SCRIPT ARGS...``: train.py with ARGS, the dataset's check raising what preflight never expects.
BROKEN_CHECK = f"""import runpy, sys
from captioner.data.sources import ShapesSource
def broken(self):
    raise RuntimeError("the dataset's check broke")
ShapesSource.paths = broken
sys.argv[0] = {str(ROOT / "train.py")!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("sweep", [False, True])
def test_train_py_stops_on_an_error_preflight_does_not_expect_with_one_line(sweep: bool, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    tiny = ["+trainer.fast_dev_run=true", "data.source.n_train=4", "data.source.n_val=2", "data.source.n_test=2"]
    args = [
        *["-m"] * sweep,
        f"paths.log_dir={logs}",
        f"data.source.root={tmp_path}/s",
        f"hydra.sweep.dir={logs}",
        *tiny,
    ]
    proc = subprocess.run([sys.executable, "-c", BROKEN_CHECK, *args], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: the dataset could not be checked: RuntimeError: the dataset's check broke; see the dataset's config "
        f"in conf/data ({GUIDE}#split-files)"
    ]
    assert not (tmp_path / "s").exists()  # the run never started: nothing generated
    assert sweep or not logs.exists()


def test_a_grid_larger_than_the_feature_map_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    message = (
        "model.encoder.grid=40 is larger than the 12x12 feature map of resnet18 (layer2 of data.image_size=96 px "
        "images); the grid only shrinks: set model.encoder.grid to at most 12, or read larger images "
        f"({GUIDE}#train)"
    )
    root = f"data.source.root={tmp_path}/s"
    assert _lines(["model.encoder.grid=40", root], tmp_path) == [message]
    assert _lines(["model.encoder.grid=12", root], tmp_path) == []
    run = f"init_from={write_run(tmp_path / 'run', None)}"
    assert _lines(["model.encoder.grid=40", root, run], tmp_path) == []  # the checkpoint's grid
