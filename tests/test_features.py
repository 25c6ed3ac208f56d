"""The feature cache: written chunk by chunk as it is computed, resumed after a kill, built in shares by several
processes, put in place whole; keyed by what determines it, read back by the dataset.

    python tests/test_features.py OUT IMAGES --devices 2   # the DDP test's run: Lightning re-runs it per rank
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from test_datamodule import ListSource, _attach, _datamodule
from torch.utils.data import DataLoader, Dataset

from captioner.config import ModelConfig, from_dict
from captioner.data import features
from captioner.data.dataset import Skipped, collate
from captioner.data.features import FeatureCache, FeatureCaptionDataset, Share, cache_key
from captioner.data.readers import Record
from captioner.data.vocab import Vocabulary
from captioner.errors import DataError
from captioner.training.module import CaptionerModule
from conftest import run_script

IMAGES = [torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(7)]
GONE = 3  # the item whose image could not be read
BATCH = 2  # images per chunk: rows 0-1, 2-3, 4-5, 6


def _items() -> list[dict | Skipped]:
    """Seven items as ``CaptionDataset`` yields them (image ids 100 + position), the fourth unreadable."""
    return [
        Skipped("gone.png", "file not found")
        if i == GONE
        else {"image": image, "captions": [torch.tensor([1, 4, 2])], "image_id": 100 + i, "index": i}
        for i, image in enumerate(IMAGES)
    ]


def _batches(images: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(images, batch_size=batch_size, collate_fn=collate)


class Encoder:
    """Stand-in for Captioner.encode (each pixel a location, its 3 colours the channels) that counts its calls
    and, as a killed build, raises at call ``killed_at``."""

    def __init__(self, killed_at: int | None = None) -> None:
        self.calls = 0
        self.killed_at = killed_at

    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        self.calls += 1
        if self.calls == self.killed_at:
            raise KeyboardInterrupt
        return images.flatten(2).transpose(1, 2), (8, 8)  # (B, 64, 3)


def _build(cache: FeatureCache, encode: Encoder, batch_size: int = BATCH) -> None:
    cache.build(encode, _items(), _batches, batch_size, "cpu")


def _files(folder: Path) -> dict[str, bytes]:
    """Each file of ``folder``: its bytes."""
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture
def whole(tmp_path: Path) -> dict[str, bytes]:
    """The files of the cache built without interruption."""
    cache = FeatureCache(tmp_path / "whole" / "train-key")
    _build(cache, Encoder())
    return _files(cache.folder)


def test_a_killed_build_resumes_where_it_stopped_and_ends_as_an_uninterrupted_one(
    tmp_path: Path, whole: dict[str, bytes]
) -> None:
    cache = FeatureCache(tmp_path / "cache" / "train-key")
    killed = Encoder(killed_at=3)  # chunks 0-1 and 2-3 written and recorded, killed while encoding 4-5
    with pytest.raises(KeyboardInterrupt):
        _build(cache, killed)
    assert not cache.exists() and not cache.folder.exists()  # a half-built cache is never read
    assert sorted(p.stem for p in (cache.partial / "chunks").glob("*.json")) == [
        "000000000000-000000000002",
        "000000000002-000000000004",
    ]
    assert FeatureCache(cache.folder).exists() is False
    resumed = Encoder()
    _build(cache, resumed)
    assert resumed.calls == 2  # only the chunks the kill left: rows 4-5 and 6
    assert _files(cache.folder) == whole  # byte for byte
    assert sorted(whole) == ["features.npy", "index.json"] and not cache.partial.exists()
    assert cache.skip_reason("gone.png") == "file not found"  # skipped before the kill, recorded across it
    assert 103 not in cache and 106 in cache and cache.grid == (8, 8)
    assert cache.get(106).dtype == torch.float16  # stored and handed out in fp16
    assert torch.allclose(cache.get(106).float(), IMAGES[6].flatten(1).T, atol=1e-2)
    index = json.loads(whole["index.json"])
    assert index["image_ids"] == [100, 101, 102, None, 104, 105, 106]  # one per row, the unreadable one's empty
    assert index["skipped"] == [["gone.png", "file not found"]]


def test_a_build_killed_before_it_was_put_in_place_is_put_in_place_without_encoding_again(
    tmp_path: Path, whole: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = FeatureCache(tmp_path / "cache" / "train-key")
    rename = os.replace

    def killed(source: Path, target: Path) -> None:
        if Path(source) == cache.partial:
            raise KeyboardInterrupt
        rename(source, target)

    with monkeypatch.context() as patch:
        patch.setattr(features.os, "replace", killed)
        with pytest.raises(KeyboardInterrupt):
            _build(cache, Encoder())
    assert {"features.npy", "index.json"} <= {p.name for p in cache.partial.iterdir()} and not cache.exists()
    again = Encoder()
    _build(cache, again)
    assert again.calls == 0 and _files(cache.folder) == whole


def test_a_complete_cache_is_never_rebuilt_and_a_folder_in_the_way_is_never_deleted(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path / "cache" / "train-key")
    _build(cache, Encoder())
    modified = (cache.folder / "features.npy").stat().st_mtime_ns
    again = Encoder(killed_at=1)
    _build(cache, again)  # in place already (or finished by another process first): nothing encoded
    assert again.calls == 0 and (cache.folder / "features.npy").stat().st_mtime_ns == modified

    in_the_way = FeatureCache(tmp_path / "cache" / "val-key")
    in_the_way.folder.mkdir()
    (in_the_way.folder / "notes.txt").write_text("mine")
    refused = Encoder()
    with pytest.raises(DataError, match="is in the way of the feature cache"):
        _build(in_the_way, refused)
    assert refused.calls == 0 and not in_the_way.partial.exists()  # refused before any work
    assert (in_the_way.folder / "notes.txt").read_text() == "mine"

    late = FeatureCache(tmp_path / "cache" / "test-key")  # a folder made there while the cache was built
    late.fill(Encoder(), _items(), _batches, BATCH, "cpu")
    late.folder.mkdir()
    (late.folder / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="is in the way of the feature cache"):
        late.finish()
    assert (late.folder / "notes.txt").read_text() == "mine" and not late.exists()
    (late.folder / "notes.txt").rename(tmp_path / "notes.txt")
    after = Encoder()
    _build(late, after)  # the features kept in the partial folder are put in place
    assert after.calls == 0 and late.exists()


def test_processes_build_their_shares_of_the_chunks_into_one_cache(tmp_path: Path, whole: dict[str, bytes]) -> None:
    cache = FeatureCache(tmp_path / "cache" / "train-key")
    shares = [Encoder(), Encoder()]
    for rank, encode in enumerate(shares):
        cache.fill(encode, _items(), _batches, BATCH, "cpu", share=Share(rank, 2))
        assert not cache.exists()
    assert [encode.calls for encode in shares] == [2, 2]  # rank 0: rows 0-1 and 4-5; rank 1: rows 2-3 and 6
    cache.finish()
    assert _files(cache.folder) == whole

    unfinished = FeatureCache(tmp_path / "cache" / "val-key")
    unfinished.fill(Encoder(), _items(), _batches, BATCH, "cpu", share=Share(0, 2))
    with pytest.raises(DataError, match=r"is unfinished \(3 of 7 images not encoded yet\): building it again"):
        unfinished.finish()
    resumed = Encoder()
    _build(unfinished, resumed, batch_size=4)  # started again with other batches: rows 0-3 and 4-6 lacked a row
    assert resumed.calls == 2 and _files(unfinished.folder) == whole


def _source(images: Path) -> ListSource:
    """Two training images and seven validation images (the fourth missing) at ``images``."""
    paths = [images / f"{i}.png" for i in range(7)]
    records = [
        Record(str(path), 100 + i, ("a red square",) if i % 2 else ("a blue circle",), "val")
        for i, path in enumerate(paths)
    ]
    return ListSource({"train": records[:2], "val": records, "test": []})


def _captioner(vocab: Vocabulary) -> CaptionerModule:
    """A ResNet-18 (random weights) that trains its layer2: the cache holds its layer1's 8x8x64 maps."""
    torch.manual_seed(0)
    return CaptionerModule(
        vocab, from_dict(ModelConfig, {"encoder": {"name": "resnet18", "stage": "layer2", "trainable_stages": 1}})
    )


def ddp_cache(images: Path, folder: Path, devices: int) -> dict:
    """Validate the tiny captioner on ``devices`` gloo processes with the validation split's feature cache in
    ``folder``, built by the data module as training builds it; this process's rank and its calls of the encoder."""
    datamodule = _datamodule(_source(images), feature_cache=str(folder), feature_dtype="float32", eval_batch_size=BATCH)
    datamodule.setup("validate")
    module = _captioner(datamodule.vocab)
    calls = []
    encode = module.model.encode
    module.model.encode = lambda batch: calls.append(len(batch)) or encode(batch)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(module, datamodule=datamodule, verbose=False)
    return {"rank": trainer.global_rank, "calls": calls}


@pytest.mark.slow
def test_two_ddp_processes_build_a_cache_between_them_as_one_process_does(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    for i in range(7):
        if i != GONE:
            Image.new("RGB", (40, 30), (30 * i, 200 - 20 * i, 90)).save(images / f"{i}.png")
    out = tmp_path / "ranks"
    run_script(__file__, str(out), str(images), str(tmp_path / "ddp"), "--devices", "2", timeout=300)
    ranks = sorted((json.loads(path.read_text()) for path in out.iterdir()), key=lambda result: result["rank"])
    assert [r["calls"] for r in ranks] == [[2, 2], [1, 1]]  # rank 0: rows 0-1 and 4-5; rank 1: rows 2-3 (one gone), 6
    (built,) = (tmp_path / "ddp").iterdir()  # in place, no partial folder left
    datamodule = _datamodule(
        _source(images), feature_cache=str(tmp_path / "one"), feature_dtype="float32", eval_batch_size=BATCH
    )
    datamodule.setup("validate")
    _attach(datamodule, _captioner(datamodule.vocab))
    datamodule.val_dataloader()
    (alone,) = (tmp_path / "one").iterdir()
    assert built.name == alone.name and sorted(p.name for p in built.iterdir()) == ["features.npy", "index.json"]
    assert (built / "index.json").read_text() == (alone / "index.json").read_text()
    torch.testing.assert_close(
        torch.from_numpy(np.load(built / "features.npy")), torch.from_numpy(np.load(alone / "features.npy"))
    )


def test_batches_out_of_order_or_a_partial_file_of_another_shape_are_refused(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path / "cache" / "train-key")

    def reversed_batches(images: Dataset, batch_size: int) -> DataLoader:
        return DataLoader(images, batch_size=batch_size, sampler=range(len(images) - 1, -1, -1), collate_fn=collate)

    with pytest.raises(ValueError, match="the batch of rows 0..1 holds other rows: batches must keep the order"):
        cache.build(Encoder(), _items(), reversed_batches, BATCH, "cpu")
    cache.fill(Encoder(), _items()[:2], _batches, BATCH, "cpu")  # a partial file of 2 rows at this place
    with pytest.raises(DataError, match=r"features.npy holds a float16 array of shape \(2, 64, 3\), not float16"):
        _build(cache, Encoder())


def test_a_cache_of_unreadable_images_only_holds_none(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path / "cache")
    cache.build(Encoder(), [Skipped("a.png", "not an image"), Skipped("b.png", "file not found")], _batches, 2, "cpu")
    assert cache.exists() and 0 not in cache and cache.skip_reason("b.png") == "file not found"


def test_the_cache_key_changes_with_everything_that_changes_the_features() -> None:
    records = [Record(f"images/{i}.png", i, ("a red circle",), "train") for i in range(3)]
    encoder = {"name": "resnet18", "stage": "layer1", "grid": None}
    key = cache_key(encoder, 96, records, "float16")
    assert len(key) == 16 and int(key, 16) >= 0
    assert cache_key(dict(reversed(encoder.items())), 96, list(records), "float16") == key
    relabelled = [Record(r.image_path, r.image_id, ("another caption",), "train") for r in records]
    assert cache_key(encoder, 96, relabelled, "float16") == key  # captions do not change the features
    others = [
        cache_key({**encoder, "stage": "layer2"}, 96, records, "float16"),
        cache_key(encoder, 128, records, "float16"),
        cache_key(encoder, 96, records[:2], "float16"),
        cache_key(encoder, 96, [Record("elsewhere/0.png", 0, ("a",), "train"), *records[1:]], "float16"),
        cache_key(encoder, 96, records, "bfloat16"),
    ]
    assert len({key, *others}) == 6


def test_the_dataset_gives_cached_features_with_encoded_captions(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path / "cache")
    _build(cache, Encoder())
    vocab = Vocabulary(["a", "red", "circle", "square"])
    records = [
        Record("0.png", 100, ("a red circle", "a square"), "train"),
        Record("gone.png", 103, ("a",), "train"),
        Record("6.png", 106, ("red square",), "train"),
        Record("new.png", 9, ("a",), "train"),
    ]
    dataset = FeatureCaptionDataset(records, vocab, cache, max_len=2)
    assert len(dataset) == 4
    item = dataset[0]
    assert item["image_id"] == 100 and item["index"] == 0 and item["features"].shape == (64, 3)
    assert torch.equal(item["features"], cache.get(100))
    a, red, square = (vocab.stoi[w] for w in ("a", "red", "square"))
    assert [c.tolist() for c in item["captions"]] == [[1, a, red, 2], [1, a, square, 2]]  # cut at max_len words
    assert dataset[1] == Skipped("gone.png", "file not found")  # the reason recorded when the cache was built
    assert dataset[3] == Skipped("new.png", "not in the feature cache")
    per_caption = FeatureCaptionDataset(records, vocab, cache, max_len=2, per_caption=True)
    assert len(per_caption) == 5 and [c.tolist() for c in per_caption[1]["captions"]] == [[1, a, square, 2]]
    assert per_caption[3]["image_id"] == 106 and per_caption[3]["index"] == 2
    assert isinstance(per_caption[2], Skipped) and isinstance(per_caption[4], Skipped)


def test_a_cache_handed_to_a_worker_opens_its_own_memory_map(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path / "cache")
    _build(cache, Encoder())
    assert 101 in cache and cache.grid == (8, 8)  # opened: its memory map is not pickled along
    clone = pickle.loads(pickle.dumps(cache))
    assert clone._features is None and clone.grid == (8, 8)
    assert torch.equal(clone.get(101), cache.get(101)) and clone.skip_reason("gone.png") == "file not found"


def main() -> None:
    """Build the cache as ``ddp_cache`` does and write each rank's result to OUT/rank-<r>.json."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("images", type=Path)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    result = ddp_cache(args.images, args.folder, args.devices)
    args.out.mkdir(exist_ok=True)
    (args.out / f"rank-{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
