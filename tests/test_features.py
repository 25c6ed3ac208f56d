"""The feature cache: built once and atomically, keyed by what determines it, read back by the dataset."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from captioner.data import features
from captioner.data.dataset import Skipped, collate
from captioner.data.features import FeatureCache, FeatureCaptionDataset, cache_key
from captioner.data.readers import Record
from captioner.data.vocab import Vocabulary
from captioner.errors import DataError

IMAGES = [torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]  # image ids 0..3


def _batches() -> list[dict]:
    """Two loader batches of the four images, the second with an image that could not be read."""
    items = [
        {"image": image, "captions": [torch.tensor([1, 4, 2])], "image_id": i, "index": i}
        for i, image in enumerate(IMAGES)
    ]
    return [collate(items[:2]), collate([*items[2:], Skipped("gone.png", "file not found")])]


def _encode(images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """Stand-in for Captioner.encode: each pixel a location, its 3 colours the channels."""
    return images.flatten(2).transpose(1, 2), (8, 8)  # (B, 64, 3)


def test_feature_cache_build_is_atomic_and_never_deletes_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def killed(path: Path, obj: object) -> None:
        raise KeyboardInterrupt

    cache = FeatureCache(tmp_path / "cache" / "train-key")
    with monkeypatch.context() as patch:
        patch.setattr(features, "write_json", killed)  # features.npy written, index.json not yet
        with pytest.raises(KeyboardInterrupt):
            cache.build(_encode, _batches(), "cpu")
    assert not cache.exists() and list((tmp_path / "cache").iterdir()) == []
    cache.build(_encode, _batches(), "cpu")
    assert 3 in cache and cache.skip_reason("gone.png") == "file not found"
    assert cache.get(3).dtype == torch.float16  # stored and handed out in fp16
    assert torch.allclose(cache.get(3).float(), IMAGES[3].flatten(1).T, atol=1e-2)
    FeatureCache(cache.folder).build(_encode, _batches(), "cpu")  # a cache finished by another process wins
    in_the_way = FeatureCache(tmp_path / "cache" / "val-key")
    in_the_way.folder.mkdir()
    (in_the_way.folder / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="is in the way of the feature cache"):
        in_the_way.build(_encode, _batches(), "cpu")
    assert (in_the_way.folder / "notes.txt").read_text() == "mine"


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
    cache.build(_encode, _batches(), "cpu")
    vocab = Vocabulary(["a", "red", "circle", "square"])
    records = [
        Record("0.png", 0, ("a red circle", "a square"), "train"),
        Record("gone.png", 7, ("a",), "train"),
        Record("3.png", 3, ("red square",), "train"),
        Record("new.png", 9, ("a",), "train"),
    ]
    dataset = FeatureCaptionDataset(records, vocab, cache, max_len=2)
    assert len(dataset) == 4
    item = dataset[0]
    assert item["image_id"] == 0 and item["index"] == 0 and item["features"].shape == (64, 3)
    assert torch.equal(item["features"], cache.get(0))
    a, red, square = (vocab.stoi[w] for w in ("a", "red", "square"))
    assert [c.tolist() for c in item["captions"]] == [[1, a, red, 2], [1, a, square, 2]]  # cut at max_len words
    assert dataset[1] == Skipped("gone.png", "file not found")  # the reason recorded when the cache was built
    assert dataset[3] == Skipped("new.png", "not in the feature cache")
    per_caption = FeatureCaptionDataset(records, vocab, cache, max_len=2, per_caption=True)
    assert len(per_caption) == 5 and [c.tolist() for c in per_caption[1]["captions"]] == [[1, a, square, 2]]
    assert per_caption[3]["image_id"] == 3 and per_caption[3]["index"] == 2
    assert isinstance(per_caption[2], Skipped) and isinstance(per_caption[4], Skipped)


def test_a_cache_handed_to_a_worker_opens_its_own_memory_map(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path / "cache")
    cache.build(_encode, _batches(), "cpu")
    assert 1 in cache and cache.grid == (8, 8)  # opened: its memory map is not pickled along
    clone = pickle.loads(pickle.dumps(cache))
    assert clone._features is None and clone.grid == (8, 8)
    assert torch.equal(clone.get(1), cache.get(1)) and clone.skip_reason("gone.png") == "file not found"
