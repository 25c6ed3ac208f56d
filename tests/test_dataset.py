"""CaptionDataset, collate, transforms and SkipCounter, including DataLoader workers."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from captioner.data.dataset import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CaptionDataset,
    SkipCounter,
    Skipped,
    build_transform,
    collate,
)
from captioner.data.readers import Record
from captioner.data.vocab import UNK_ID, Vocabulary
from conftest import features_for, make_decoder, make_loss

SIZE = 8
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]


def normalised(colour) -> torch.Tensor:
    """The (3,) value a pixel of ``colour`` has after the eval transform."""
    return (torch.tensor(colour) / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Four good images (plain colours, odd sizes) and four unreadable ones."""
    paths = {}
    for k, colour in enumerate(COLOURS):
        paths[f"good{k}"] = tmp_path / f"good{k}.png"
        Image.new("RGB", (12 + k, 10), colour).save(paths[f"good{k}"])
    paths["missing"] = tmp_path / "missing.jpg"
    paths["empty"] = tmp_path / "empty.jpg"
    paths["empty"].write_bytes(b"")
    paths["folder"] = tmp_path / "folder.jpg"
    paths["folder"].mkdir()
    paths["truncated"] = tmp_path / "truncated.png"
    noise = np.random.default_rng(0).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    Image.fromarray(noise).save(paths["truncated"])
    paths["truncated"].write_bytes(paths["truncated"].read_bytes()[:300])
    return paths


@pytest.fixture
def vocab() -> Vocabulary:
    return Vocabulary(["a", "red", "green", "blue", "white", "square", "big"])


def make_records(files) -> list[Record]:
    """good0 (2 captions), missing, good1 (1), empty, good2 (3), folder, truncated, good3 (1)."""
    spec = [
        ("good0", ("a red square", "red")),
        ("missing", ("a square",)),
        ("good1", ("a green square",)),
        ("empty", ("a square",)),
        ("good2", ("blue", "a big blue square", "a blue thing")),
        ("folder", ("a square",)),
        ("truncated", ("a square",)),
        ("good3", ("a white square",)),
    ]
    return [Record(str(files[name]), 100 + i, captions, "train") for i, (name, captions) in enumerate(spec)]


BAD = ("missing", "empty", "folder", "truncated")


def test_eval_transform_values_and_shape():
    transform = build_transform(SIZE, train=False)
    out = transform(Image.new("RGB", (20, 14), (255, 0, 0)))
    assert out.shape == (3, SIZE, SIZE) and out.dtype == torch.float32
    red_image = normalised((255, 0, 0))[:, None, None].expand(3, SIZE, SIZE)
    assert torch.allclose(out, red_image, atol=1e-5)
    assert build_transform(SIZE, train=True, augment=False)(Image.new("RGB", (9, 9), (0, 0, 255))).equal(
        transform(Image.new("RGB", (9, 9), (0, 0, 255)))
    )


def test_augmentation_never_flips():
    transform = build_transform(16, train=True, augment=True)
    names = [type(t).__name__ for t in transform.transforms]
    assert not any("Flip" in name for name in names) and "RandomResizedCrop" in names
    half = np.zeros((16, 32, 3), dtype=np.uint8)
    half[:, :16] = (255, 0, 0)  # red on the left, blue on the right
    half[:, 16:] = (0, 0, 255)
    image = Image.fromarray(half)
    torch.manual_seed(0)
    for _ in range(20):
        out = transform(image)
        assert out[0, :, 0].mean() > out[2, :, 0].mean()  # left edge stays red
        assert out[2, :, -1].mean() > out[0, :, -1].mean()  # right edge stays blue


def test_item_holds_the_image_once_with_all_captions(files, vocab):
    records = make_records(files)
    dataset = CaptionDataset(records, vocab, build_transform(SIZE, train=False), max_len=2)
    assert len(dataset) == len(records)
    item = dataset[4]
    assert set(item) == {"image", "captions", "image_id", "index"}
    assert item["image_id"] == 104 and item["index"] == 4
    blue_image = normalised((0, 0, 255))[:, None, None].expand(3, SIZE, SIZE)
    assert torch.allclose(item["image"], blue_image, atol=1e-5)
    a, blue, big = vocab.stoi["a"], vocab.stoi["blue"], vocab.stoi["big"]
    assert [c.tolist() for c in item["captions"]] == [[1, blue, 2], [1, a, big, 2], [1, a, blue, 2]]
    assert all(c.dtype == torch.long for c in item["captions"])


@pytest.mark.parametrize(
    "name, reason",
    [
        ("missing", "file not found"),
        ("empty", "file is empty"),
        ("folder", "is a directory"),
        ("truncated", "truncated or corrupt"),
    ],
)
def test_unreadable_images_are_skipped_not_raised(files, vocab, name, reason):
    records = make_records(files)
    dataset = CaptionDataset(records, vocab, build_transform(SIZE, train=False))
    index = next(i for i, r in enumerate(records) if r.image_path == str(files[name]))
    item = dataset[index]
    assert isinstance(item, Skipped) and item.path == str(files[name]) and reason in item.reason


def test_per_caption_items(files, vocab):
    records = make_records(files)
    dataset = CaptionDataset(records, vocab, build_transform(SIZE, train=False), per_caption=True)
    assert len(dataset) == sum(len(r.captions) for r in records) == 11
    items = [dataset[i] for i in range(len(dataset))]
    good = [item for item in items if not isinstance(item, Skipped)]
    assert [(item["image_id"], item["index"]) for item in good] == [
        (100, 0),
        (100, 0),
        (102, 2),
        (104, 4),
        (104, 4),
        (104, 4),
        (107, 7),
    ]
    assert all(len(item["captions"]) == 1 for item in good)
    decoded = [vocab.decode(item["captions"][0]) for item in good[3:6]]
    assert decoded == [["blue"], ["a", "big", "blue", "square"], ["a", "blue", "<unk>"]]


def test_collate_shapes_and_values(files, vocab):
    records = make_records(files)
    dataset = CaptionDataset(records, vocab, build_transform(SIZE, train=False))
    batch = collate([dataset[i] for i in (0, 1, 4, 5)])
    a, red, blue, big, square = (vocab.stoi[w] for w in ("a", "red", "blue", "big", "square"))
    u = UNK_ID
    expected = torch.tensor(
        [
            [1, a, red, square, 2, 0],
            [1, red, 2, 0, 0, 0],
            [1, blue, 2, 0, 0, 0],
            [1, a, big, blue, square, 2],
            [1, a, blue, u, 2, 0],
        ]
    )
    assert batch["captions"].equal(expected)
    assert batch["lengths"].equal(torch.tensor([5, 3, 3, 6, 5]))
    assert batch["image_index"].equal(torch.tensor([0, 0, 1, 1, 1]))
    assert batch["image_ids"].equal(torch.tensor([100, 104])) and batch["indices"].equal(torch.tensor([0, 4]))
    assert batch["images"].shape == (2, 3, SIZE, SIZE)
    assert torch.allclose(batch["images"][1, :, 0, 0], normalised((0, 0, 255)), atol=1e-5)
    assert [s.path for s in batch["skipped"]] == [str(files["missing"]), str(files["folder"])]
    assert batch["captions_per_image"] is None  # 2 and 3 captions: read gathered
    assert batch["caption_weights"].equal(torch.ones(5)) and batch["real"].equal(torch.tensor([True, True]))
    integers = {k: t for k, t in batch.items() if k not in ("images", "skipped", "captions_per_image")}
    assert all(t.dtype == torch.long for k, t in integers.items() if k not in ("caption_weights", "real"))


def test_collate_pads_to_a_fixed_length_when_asked(files, vocab):
    dataset = CaptionDataset(make_records(files), vocab, build_transform(SIZE, train=False))
    items = [dataset[i] for i in (0, 1, 4, 5)]
    longest, fixed = collate(items), collate(items, pad_to=9)
    assert fixed["captions"].shape == (5, 9) and fixed["captions"][:, :6].equal(longest["captions"])
    assert not fixed["captions"][:, 6:].any() and fixed["lengths"].equal(longest["lengths"])
    with pytest.raises(ValueError, match="a caption of 6 tokens does not fit pad_to=5"):
        collate(items, pad_to=5)


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_a_padded_training_step_has_the_loss_and_gradients_of_the_unpadded_one(mode):
    decoder = make_decoder(mode, seed=3).train()  # hard attention samples locations
    decoder.dropout.p = 0.3  # and dropout draws masks: both repeat for a seed, whatever the padding
    loss = make_loss(reinforce_weight=0.1, entropy_weight=0.01)
    items = [
        {
            "features": features_for(1, seed=k)[0],
            "captions": [torch.tensor([1, *range(4, 4 + n), 2])],
            "image_id": k,
            "index": k,
        }
        for k, n in enumerate((1, 5, 3))
    ]
    results = []
    for batch in (collate(items), collate(items, pad_to=12)):
        torch.manual_seed(0)
        decoder.zero_grad()
        terms = loss(decoder(batch["features"], batch["captions"], batch["image_index"]), batch["captions"])
        terms["loss"].backward()
        results.append((terms, {n: p.grad.clone() for n, p in decoder.named_parameters() if p.grad is not None}))
    (short, short_grads), (padded, padded_grads) = results
    assert collate(items)["captions"].size(1) == 7  # padded: 12
    for key in short:
        torch.testing.assert_close(padded[key], short[key])
    assert padded_grads.keys() == short_grads.keys() and len(short_grads) > 5
    for name, grad in short_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, msg=name)


def test_collate_of_only_skipped_items_is_an_empty_batch():
    batch = collate([Skipped("a.jpg", "file not found")])
    assert batch["images"].numel() == 0 and batch["captions"].shape == (0, 0)
    assert batch["image_index"].numel() == 0 and batch["skipped"] == [Skipped("a.jpg", "file not found")]


def test_collate_stacks_cached_features():
    items = [
        {"features": torch.full((4, 2), float(k)), "captions": [torch.tensor([1, 5, 2])], "image_id": k, "index": k}
        for k in range(3)
    ]
    batch = collate(items)
    assert "images" not in batch and batch["features"].shape == (3, 4, 2)
    assert batch["features"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_skip_counter_dedupes_and_reports_once_per_image():
    counter = SkipCounter()
    assert counter.count == 0 and counter.report() == ""
    first = [Skipped(f"img{k}.jpg", "file is empty") for k in range(7)]
    assert counter.add(first[:3]) == first[:3]
    assert counter.add(first[:2]) == []  # the same images in a later epoch are not counted again
    counter.add(first)
    assert counter.count == 7 and counter.first(2) == first[:2]
    report = counter.report()
    assert report.startswith("skipped 7 unreadable images: img0.jpg (file is empty); ")
    assert "img4.jpg" in report and "img5.jpg" not in report and report.endswith("and 2 more")
    assert "\n" not in report


def test_dataloader_with_workers(files, vocab):
    records = make_records(files)
    dataset = CaptionDataset(records, vocab, build_transform(SIZE, train=True, augment=True))
    clone = pickle.loads(pickle.dumps(dataset))  # what spawn-started workers receive
    assert isinstance(clone[7], dict) and isinstance(clone[1], Skipped)
    loader = DataLoader(dataset, batch_size=3, num_workers=2, collate_fn=collate)
    counter = SkipCounter()
    ids, captions = [], 0
    for batch in loader:
        counter.add(batch["skipped"])
        ids += batch["image_ids"].tolist()
        captions += batch["captions"].shape[0]
        assert batch["image_index"].max().item() < batch["images"].shape[0]
    assert sorted(ids) == [100, 102, 104, 107] and captions == 7
    assert counter.count == 4 and {s.path for s in counter.first(10)} == {str(files[n]) for n in BAD}


def test_transform_is_picklable():
    transform = pickle.loads(pickle.dumps(build_transform(SIZE, train=True, augment=True)))
    assert isinstance(transform, v2.Compose)
    assert transform(Image.new("RGB", (10, 10))).shape == (3, SIZE, SIZE)
