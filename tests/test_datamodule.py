"""CaptionDataModule: records from its source, the vocabulary from the training captions, loaders, the feature cache."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from captioner.config import MAX_AUTO_WORKERS, DataConfig, ModelConfig, from_dict
from captioner.data.dataset import Skipped
from captioner.data.readers import Box, Record
from captioner.data.stream import PADDING
from captioner.data.vocab import Vocabulary
from captioner.errors import ConfigError, DataError
from captioner.training.datamodule import CaptionDataModule, loader_workers
from captioner.training.module import CaptionerModule

SIZE = 32
COLOURS = {"red": (215, 48, 39), "green": (40, 160, 70), "blue": (40, 90, 215)}


@dataclass
class ListSource:
    """A Source over records held in memory; counts how often it was prepared."""

    splits: dict[str, list[Record]]
    prepared: int = field(default=0)

    def paths(self) -> list:
        """No files."""
        return []

    def prepare(self) -> None:
        self.prepared += 1

    def records(self, split: str) -> list[Record]:
        return self.splits[split]


@pytest.fixture
def source(tmp_path: Path) -> ListSource:
    """Three training images (one with two captions), two validation images (one of them missing), one test image."""
    paths = {}
    for name, colour in COLOURS.items():
        paths[name] = tmp_path / f"{name}.png"
        Image.new("RGB", (40, 30), colour).save(paths[name])
    box = Box("square", 0.25, 0.25, 0.75, 0.75)
    train = [
        Record(str(paths["red"]), 1, ("a red square", "a red box"), "train", (box,)),
        Record(str(paths["green"]), 2, ("a green square",), "train"),
        Record(str(paths["blue"]), 3, ("a blue square",), "train"),
    ]
    val = [
        Record(str(paths["blue"]), 4, ("a blue square", "a purple square"), "val", (box,)),
        Record(str(tmp_path / "gone.png"), 5, ("a red square",), "val"),
    ]
    return ListSource({"train": train, "val": val, "test": [Record(str(paths["red"]), 6, ("a red square",), "test")]})


def _datamodule(source: ListSource, **options: object) -> CaptionDataModule:
    settings = {"image_size": SIZE, "batch_size": 2, "num_workers": 0, "min_word_count": 1, **options}
    return CaptionDataModule(source, from_dict(DataConfig, settings, "data"))


def test_setup_reads_each_split_once_and_builds_the_vocabulary_from_training_captions(source: ListSource) -> None:
    datamodule = _datamodule(source, min_word_count=2)
    datamodule.setup("fit")
    datamodule.setup("validate")  # a second stage reuses what the first read
    assert source.prepared == 1
    assert datamodule.vocab.itos[4:] == ["a", "square", "red"]  # words seen twice in training; "purple" only in val
    assert datamodule.references("val") == {
        4: [["a", "blue", "square"], ["a", "purple", "square"]],
        5: [["a", "red", "square"]],
    }
    assert datamodule.boxes("val") == {4: (Box("square", 0.25, 0.25, 0.75, 0.75),)}  # images without boxes left out


def test_a_vocabulary_file_is_used_as_it_is(source: ListSource, tmp_path: Path) -> None:
    saved = Vocabulary(["a", "purple", "circle"])
    saved.save(tmp_path / "vocab.json")
    datamodule = _datamodule(source, vocab_file=str(tmp_path / "vocab.json"))
    datamodule.setup("fit")
    assert datamodule.vocab == saved


def _unknown_lines(caplog: pytest.LogCaptureFixture, datamodule: CaptionDataModule) -> list[tuple[int, str]]:
    """Set ``datamodule`` up; the level and text of each line it logged about the vocabulary."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="captioner.training.datamodule"):
        datamodule.setup("fit")
    return [(r.levelno, r.getMessage()) for r in caplog.records if "vocabulary" in r.getMessage()]


def test_the_share_of_training_words_read_as_unk_is_logged_and_above_5_percent_warned_of(
    source: ListSource, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # training words: a 4, square 3, red 2, box 1, green 1, blue 1 (12)
    path = tmp_path / "vocab.json"
    Vocabulary(["a", "square"]).save(path)
    fixed = _datamodule(source, vocab_file=str(path))
    assert _unknown_lines(caplog, fixed) == [
        (
            logging.WARNING,
            f"training captions: 5 of 12 words (41.7%) read as <unk> by the vocabulary of data.vocab_file={path}: "
            "more than 5%; the most frequent: red (2), box (1), green (1), blue (1); init_vocab=grow (with init_from) "
            "adds them to the model's vocabulary",
        )
    ]
    assert fixed.vocab.itos[4:] == ["a", "square"]
    built = _datamodule(source, min_word_count=2)  # the vocabulary's own rule: said, not warned of
    assert _unknown_lines(caplog, built) == [
        (
            logging.INFO,
            "training captions: 3 of 12 words (25.0%) read as <unk> by the vocabulary built from them (words seen at "
            "least data.min_word_count=2 times)",
        )
    ]
    capped = _datamodule(source, min_word_count=1, max_vocab=4)
    assert _unknown_lines(caplog, capped)[0][1].endswith(
        "2 of 12 words (16.7%) read as <unk> by the vocabulary built from them (words seen at least "
        "data.min_word_count=1 times, the data.max_vocab=4 most frequent)"
    )
    Vocabulary(["a", "square", "red", "green", "blue", "box"]).save(path)
    assert _unknown_lines(caplog, _datamodule(source, vocab_file=str(path))) == [
        (
            logging.INFO,
            f"training captions: 0 of 12 words (0.0%) read as <unk> by the vocabulary of data.vocab_file={path}",
        )
    ]


def test_training_captions_longer_than_max_len_are_counted_when_cut(
    source: ListSource, caplog: pytest.LogCaptureFixture
) -> None:
    # training captions of 3, 3, 3 and 3 words: cut at 2 words, every one is; at 3, none (and nothing is said)
    lines = []
    for max_len in (2, 3):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="captioner.training.datamodule"):
            _datamodule(source, max_len=max_len).setup("fit")
        lines.append([r.getMessage() for r in caplog.records if "data.max_len" in r.getMessage()])
    assert lines == [
        ["training captions: 4 of 4 (100.0%) have more than data.max_len=2 words and are cut to 2 (the longest has 3)"],
        [],
    ]


def test_grow_vocab_appends_the_training_words_a_vocabulary_file_lacks(
    source: ListSource, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "vocab.json"
    Vocabulary(["square", "purple", "a"]).save(path)
    settings = from_dict(DataConfig, {"vocab_file": str(path), "min_word_count": 1, "num_workers": 0}, "data")
    grown = CaptionDataModule(source, settings, grow_vocab=True)
    assert _unknown_lines(caplog, grown) == [
        (
            logging.INFO,
            "init_vocab=grow: the vocabulary of 7 tokens keeps their ids and gains 4 training words seen at least "
            "data.min_word_count=1 times, ids 7..10, which start untrained: red, blue, box, green",
        ),
        (
            logging.INFO,
            f"training captions: 0 of 12 words (0.0%) read as <unk> by the vocabulary of data.vocab_file={path}, grown",
        ),
    ]
    assert grown.vocab.itos[4:] == ["square", "purple", "a", "red", "blue", "box", "green"]
    settings.min_word_count, settings.max_vocab = 2, 3  # red, the one new word seen twice, finds no room
    capped = CaptionDataModule(source, settings, grow_vocab=True)
    assert _unknown_lines(caplog, capped)[0][1] == (
        "init_vocab=grow: the vocabulary of 7 tokens keeps their ids and gains no training word seen at least "
        "data.min_word_count=2 times; data.max_vocab=3 leaves out 1"
    )
    assert capped.vocab.itos[4:] == ["square", "purple", "a"]


def test_a_training_split_without_images_is_refused(source: ListSource) -> None:
    source.splits["train"] = []
    with pytest.raises(DataError, match="the training split has no images"):
        _datamodule(source).setup("fit")


def test_the_vocabulary_travels_in_checkpoints_and_must_match(source: ListSource) -> None:
    datamodule = _datamodule(source)
    assert datamodule.state_dict() == {}  # nothing before setup
    datamodule.setup("fit")
    state = datamodule.state_dict()
    assert Vocabulary.from_dict(state["vocab"]) == datamodule.vocab
    datamodule.load_state_dict(state)
    other = Vocabulary(["a", "red", "square", "green"])  # the same words in another order: other ids
    with pytest.raises(DataError, match="the checkpoint's vocabulary differs from the one built from this dataset"):
        datamodule.load_state_dict({"vocab": other.to_dict()})


def test_loaders_hold_each_image_once_with_k_training_captions(source: ListSource) -> None:
    datamodule = _datamodule(source, eval_batch_size=4, captions_per_image=2)
    datamodule.setup("fit")
    batches = list(datamodule.train_dataloader())
    assert [b["images"].shape[0] for b in batches] == [2, 1] and batches[0]["images"].shape[1:] == (3, SIZE, SIZE)
    assert sorted(i for b in batches for i in b["image_ids"].tolist()) == [1, 2, 3]
    assert all(b["captions_per_image"] == 2 and b["captions"].shape[0] == 2 * b["images"].shape[0] for b in batches)
    assert sum(b["caption_weights"].sum() for b in batches) == 4  # every caption once: the repeats weigh 0
    most_common = _datamodule(source)  # K: the most common count, 1 caption; image 1's drawn each epoch
    most_common.setup("fit")
    assert sum(b["captions"].shape[0] for b in most_common.train_dataloader()) == 3
    (val,) = list(datamodule.val_dataloader())  # in order, in one batch of 4
    assert val["image_ids"].tolist() == [4] and val["captions"].shape[0] == 2
    assert val["skipped"] == [Skipped(str(Path(source.splits["val"][1].image_path)), "file not found")]
    (test,) = list(datamodule.test_dataloader())
    assert test["image_ids"].tolist() == [6]
    per_caption = _datamodule(source, per_caption=True)
    per_caption.setup("fit")
    train = list(per_caption.train_dataloader())
    assert sum(b["images"].shape[0] for b in train) == 4 and all(
        b["captions"].shape[0] == b["images"].shape[0] for b in train
    )
    assert list(per_caption.val_dataloader())[0]["captions"].shape[0] == 2  # validation stays per image


def test_the_longest_training_caption_s_width_has_one_owner() -> None:
    settings = DataConfig(max_len=8)
    assert settings.caption_tokens == len(Vocabulary(["a"]).encode("a " * 20, settings.max_len)) == 10
    assert DataConfig(max_len=8, pad_to=10).pad_to == 10
    with pytest.raises(ConfigError, match=r"pad_to=9 must be >= 10"):
        DataConfig(max_len=8, pad_to=9)


def test_pad_to_gives_every_batch_the_same_caption_length(source: ListSource) -> None:
    datamodule = _datamodule(source, pad_to=10, max_len=8, num_workers=1)  # the partial collate reaches a worker
    datamodule.setup("fit")
    widths = {
        b["captions"].shape[1]
        for loader in (datamodule.train_dataloader(), datamodule.val_dataloader())
        for b in loader
    }
    assert widths == {10}
    # static training batches: the last one's missing image is a masked row
    assert [b["real"].tolist() for b in datamodule.train_dataloader()] == [[True, True], [True, False]]
    with pytest.raises(ConfigError, match=r"data.pad_to=9 must be >= 10"):
        _datamodule(source, pad_to=9, max_len=8)


@pytest.mark.parametrize("cpus,workers", [(1, 0), (2, 1), (6, 5), (64, MAX_AUTO_WORKERS)])
def test_the_number_of_workers_defaults_from_the_cpus_this_process_may_use(monkeypatch, cpus, workers) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert DataConfig().num_workers is None and loader_workers(DataConfig().num_workers) == workers
    assert loader_workers(DataConfig(num_workers=3).num_workers) == 3


def test_moving_a_batch_to_the_device_keeps_the_skipped_images(source: ListSource) -> None:
    datamodule = _datamodule(source, eval_batch_size=2)
    datamodule.setup("fit")
    (batch,) = list(datamodule.val_dataloader())
    skipped = list(batch["skipped"])
    batch["skipped"].append(PADDING)  # a streamed epoch's padding is a masked row, not an unreadable image
    moved = datamodule.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert moved["skipped"] == skipped and torch.equal(moved["captions"], batch["captions"])


def _attach(datamodule: CaptionDataModule, module: CaptionerModule) -> None:
    """What Lightning's trainer gives the data module: the module, this process's rank on its node of one, a barrier."""
    datamodule.trainer = SimpleNamespace(
        lightning_module=module, local_rank=0, num_devices=1, strategy=SimpleNamespace(barrier=lambda name: None)
    )


def test_the_feature_cache_is_built_once_and_the_loaders_yield_features(source: ListSource, tmp_path: Path) -> None:
    datamodule = _datamodule(source, feature_cache=str(tmp_path / "cache"), feature_dtype="float32")
    datamodule.setup("fit")
    torch.manual_seed(0)
    module = CaptionerModule(
        datamodule.vocab,
        from_dict(ModelConfig, dict(encoder={"name": "resnet18", "stage": "layer2", "trainable_stages": 1})),
    )
    _attach(datamodule, module)
    batches = list(datamodule.train_dataloader())
    assert "images" not in batches[0] and batches[0]["features"].shape == (2, 64, 64)  # layer1: 8x8 map, 64 channels
    (folder,) = (tmp_path / "cache").iterdir()
    assert folder.name.startswith("train-")
    module.eval()
    image = datamodule.image_dataset("train")[2]["image"]
    features = {b: f for batch in batches for b, f in zip(batch["image_ids"].tolist(), batch["features"])}
    assert torch.allclose(features[3], module.model.encode(image[None])[0][0], atol=1e-5)
    modified = folder.stat().st_mtime_ns
    list(datamodule.train_dataloader())  # the next epoch reads the same cache
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name] and folder.stat().st_mtime_ns == modified
    (val,) = list(datamodule.val_dataloader())
    assert val["skipped"][0].reason == "file not found"  # an unreadable image is recorded in the cache


def test_the_frozen_weights_are_hashed_once_for_all_the_splits(
    source: ListSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datamodule = _datamodule(source, feature_cache=str(tmp_path / "cache"), feature_dtype="float32")
    datamodule.setup("fit")
    module = CaptionerModule(
        datamodule.vocab,
        from_dict(ModelConfig, dict(encoder={"name": "resnet18", "stage": "layer2", "trainable_stages": 1})),
    )
    _attach(datamodule, module)
    hashed = []
    fingerprint = module.model.encoder.frozen_fingerprint
    monkeypatch.setattr(module.model.encoder, "frozen_fingerprint", lambda: hashed.append(1) or fingerprint())
    for loader in (datamodule.train_dataloader, datamodule.val_dataloader, datamodule.test_dataloader):
        loader()
    assert len(hashed) == 1
    assert sorted(folder.name.split("-")[0] for folder in (tmp_path / "cache").iterdir()) == ["test", "train", "val"]


def test_a_feature_cache_of_an_encoder_trained_whole_is_refused(source: ListSource, tmp_path: Path) -> None:
    datamodule = _datamodule(source, feature_cache=str(tmp_path / "cache"))
    datamodule.setup("fit")
    _attach(
        datamodule,
        CaptionerModule(
            datamodule.vocab, from_dict(ModelConfig, dict(encoder={"name": "resnet18", "trainable_stages": -1}))
        ),
    )
    with pytest.raises(DataError, match="model.encoder.trainable_stages=-1 trains all of them: freeze some"):
        datamodule.train_dataloader()
    assert not (tmp_path / "cache").exists()
