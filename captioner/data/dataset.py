"""Image-caption dataset, transforms and batching: each image decoded once with all its captions.

An unreadable image never stops training: the dataset returns ``Skipped(path, reason)`` in its
place, ``collate`` lists it in ``batch["skipped"]`` (a training batch keeps a masked row in its place, so its
shapes never change) and a ``SkipCounter`` reports them.
With ``encoded`` (``data.decode``) a dataset leaves a JPEG's decoding to the model's device: its item holds the
file's bytes (``device_decoding.Encoded``), the loader's batch is ``Undecoded``, and ``Undecoded.decoded`` makes
on the device the batch ``collate`` would have made.
Everything here is picklable (no lambdas), so DataLoader workers can be used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset
from torchvision.transforms import v2

from captioner.config import MAX_LEN
from captioner.data.device_decoding import DecodeTally, Encoded, decode_jpegs, read_for_device
from captioner.data.images import ImageError, load_rgb
from captioner.data.readers import Record
from captioner.data.vocab import PAD_ID, Vocabulary
from captioner.errors import check_range

# The input normalisation the torchvision ImageNet weights expect (per RGB channel, on [0, 1] pixels): every
# image the encoder sees is normalised with it (``build_transform``).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def build_transform(image_size: int, train: bool, augment: bool = False) -> v2.Compose:
    """PIL RGB image -> normalised float tensor (3, image_size, image_size).

    With ``train`` and ``augment``: a mild random resized crop (80-100 % of the area) and colour
    jitter. Never a horizontal flip: captions say "left" and "right". ``image_size`` is one its owner checked
    (``DataConfig``, a bundle's ``preprocess``: at least ``MIN_IMAGE_SIZE``).
    """
    if train and augment:
        steps = [
            v2.RandomResizedCrop((image_size, image_size), scale=(0.8, 1.0), antialias=True),
            v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.02),
        ]
    else:
        steps = [v2.Resize((image_size, image_size), antialias=True)]
    return v2.Compose(
        [*steps, v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )


@dataclass(frozen=True)
class Skipped:
    """An image that could not be read, in place of a dataset item."""

    path: str
    reason: str


def item_image(
    path: str, transform: Callable[[Image.Image], torch.Tensor], encoded: bool, data: bytes | None = None
) -> dict[str, Any]:
    """The ``image`` of a dataset item: the file ``path`` (or its bytes ``data``) decoded by ``load_rgb`` and
    preprocessed by ``transform`` (3, H, W); with ``encoded``, a JPEG the device decodes as its bytes
    (``Encoded``), and any other image preprocessed with ``pillow``, why Pillow decoded it. ImageError as
    ``load_rgb`` raises it."""
    if not encoded:
        return {"image": transform(load_rgb(path, data=data))}
    read = read_for_device(path, data=data)
    if isinstance(read, Encoded):
        return {"image": read}
    return {"image": transform(read.image), "pillow": read.reason}


class CaptionDataset(Dataset):
    """Images of ``records`` with their encoded captions.

    ``per_caption=False``: one item per image carrying all its captions, so a batch decodes (and the
    encoder runs on) each image once. ``per_caption=True``: one item per (image, caption) pair. ``encoded``: the
    model's device decodes its JPEGs (``item_image``); batch it with ``defer``.
    """

    def __init__(
        self,
        records: Sequence[Record],
        vocab: Vocabulary,
        transform: Callable[[Image.Image], torch.Tensor],
        max_len: int = MAX_LEN,
        per_caption: bool = False,
        encoded: bool = False,
    ) -> None:
        check_range("max_len", max_len, 1, kind=int)
        self.records = list(records)
        self.vocab = vocab
        self.transform = transform
        self.max_len = max_len
        self.encoded = encoded
        self.items: list[tuple[int, int | None]] = (
            [(i, k) for i, r in enumerate(self.records) for k in range(len(r.captions))]
            if per_caption
            else [(i, None) for i in range(len(self.records))]
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict | Skipped:
        """``{"image" (3, H, W), "captions" [LongTensor (len_k,)], "image_id", "index"}`` or Skipped.

        ``index`` is the position of the image's record in ``records``. With ``encoded``, ``image`` is an
        ``Encoded`` JPEG or the (3, H, W) of an image Pillow decoded, then with ``pillow`` (``item_image``).
        """
        i, k = self.items[index]
        record = self.records[i]
        try:
            image = item_image(record.image_path, self.transform, self.encoded)
        except ImageError as exc:
            return Skipped(record.image_path, exc.reason)
        captions = record.captions if k is None else (record.captions[k],)
        return {
            **image,  # "image": (3, H, W)
            "captions": [torch.tensor(self.vocab.encode(c, self.max_len), dtype=torch.long) for c in captions],
            "image_id": record.image_id,
            "index": i,
        }


def collate(
    items: list[dict | Skipped],
    pad_to: int | None = None,
    captions_per_image: int | None = None,
    rows: int | None = None,
) -> dict:
    """Batch dataset items: images stacked, their captions flattened and padded.

    Returns ``images`` (B, 3, H, W) (or ``features`` (B, L, C) for items that carry cached features),
    ``captions`` (N, T) padded with ``<pad>`` to the longest caption, or to T = ``pad_to`` when given (the
    same T for every batch: ``DataConfig.pad_to``), ``lengths`` (N,) including ``<start>``/``<end>``,
    ``caption_weights`` (N,) what each caption counts in the loss (1 or 0), ``image_index`` (N,) the image of
    each caption, ``captions_per_image`` (K when every image has K captions, which are then rows bK .. bK + K - 1
    for image b; else None), ``real`` (B,) whether a row is an image (not a masked one), ``image_ids`` (B,),
    ``indices`` (B,) and ``skipped`` (the Skipped items).

    Without ``captions_per_image`` (validation and test: the captions are references) every caption of every
    image is kept and the Skipped items are dropped from the batch. With it (training: static shapes), each
    image has exactly K = ``captions_per_image`` captions (``fixed_captions``) and a Skipped item becomes a
    masked row (zero image, K empty captions of weight 0, image id -1, index 0) in its place; ``rows`` pads the
    batch with masked rows to that many (an epoch's last, smaller batch). B may be 0 when every image was
    skipped (no image gives the masked rows their shape).
    """
    skipped = [item for item in items if isinstance(item, Skipped)]
    kept = [item for item in items if not isinstance(item, Skipped)]
    if not kept:
        return _empty_batch(skipped)
    if captions_per_image is None:
        weights = [torch.ones(len(item["captions"])) for item in kept]
    else:
        kept, weights = _static_rows(items, kept[0], captions_per_image, rows)
    captions = [c for item in kept for c in item["captions"]]
    counts = torch.tensor([len(item["captions"]) for item in kept])
    key = "features" if "features" in kept[0] else "image"
    padded = pad_sequence(captions, batch_first=True, padding_value=PAD_ID)  # (N, longest)
    if pad_to is not None:
        if padded.size(1) > pad_to:
            raise ValueError(f"a caption of {padded.size(1)} tokens does not fit pad_to={pad_to}")
        padded = F.pad(padded, (0, pad_to - padded.size(1)), value=PAD_ID)  # (N, pad_to)
    caption_weights = torch.cat(weights)  # (N,)
    return {
        "images" if key == "image" else "features": torch.stack([item[key] for item in kept]),
        "captions": padded,  # (N, T)
        "lengths": torch.tensor([len(c) for c in captions], dtype=torch.long),  # (N,)
        "caption_weights": caption_weights,  # (N,)
        "image_index": torch.repeat_interleave(torch.arange(len(kept)), counts),  # (N,)
        "captions_per_image": int(counts[0]) if bool((counts == counts[0]).all()) else None,
        "real": torch.tensor([not item.get("masked", False) for item in kept]),  # (B,)
        "image_ids": torch.tensor([item["image_id"] for item in kept], dtype=torch.long),  # (B,)
        "indices": torch.tensor([item["index"] for item in kept], dtype=torch.long),  # (B,)
        "skipped": skipped,
    }


@dataclass
class Undecoded:
    """A batch as the loader worker left it, its JPEGs for the model's device to decode (``decoded``): what the
    collate function of an ``encoded`` dataset gives (``defer``)."""

    items: list[dict | Skipped]  # the dataset's items: an Encoded ``image`` for the device, None for one in ``pixels``
    collate: Callable[[list[dict | Skipped]], dict]  # ``collate`` with the loader's settings
    transform: Callable[[torch.Tensor], torch.Tensor]  # the dataset's: a decoded image (3, H, W) -> (3, S, S)
    pixels: torch.Tensor | None = None  # (P, 3, S, S): the images Pillow decoded in the worker, in item order

    def pin_memory(self) -> Undecoded:
        """The batch with ``pixels`` in pinned memory (the DataLoader's ``pin_memory`` calls it), to cross to the
        device in one asynchronous copy, as a batch of decoded images does."""
        return self if self.pixels is None else replace(self, pixels=self.pixels.pin_memory())

    def decoded(self, device: torch.device, tally: DecodeTally) -> dict:
        """The batch ``collate`` makes of the items, their JPEGs decoded on ``device`` in one call and preprocessed
        there, the images Pillow decoded moved there (each counted in ``tally``): ``images`` (B, 3, S, S) on
        ``device``, the rest where ``collate`` leaves it. A JPEG neither the device nor Pillow decodes is Skipped,
        as the worker would have found it (a masked row in a training batch)."""
        items = list(self.items)
        pillowed = [i for i, item in enumerate(items) if _image(item) is None]
        moved = [] if self.pixels is None else self.pixels.to(device, non_blocking=True).unbind()  # P x (3, S, S)
        for i, pixels in zip(pillowed, moved):
            tally.add(items[i]["pillow"])
            items[i] = {**items[i], "image": pixels}
        jpegs = [i for i, item in enumerate(items) if isinstance(_image(item), Encoded)]
        for i, image in zip(jpegs, decode_jpegs([items[i]["image"] for i in jpegs], device, tally)):
            if isinstance(image, ImageError):
                items[i] = Skipped(items[i]["image"].path, image.reason)
            else:
                items[i] = {**items[i], "image": self.transform(image)}  # (3, S, S)
        return self.collate(items)


def defer(
    items: list[dict | Skipped],
    collate: Callable[[list[dict | Skipped]], dict],
    transform: Callable[[torch.Tensor], torch.Tensor],
) -> Undecoded:
    """The DataLoader collate function of an ``encoded`` dataset (with ``collate`` and ``transform`` bound): its
    items left ``Undecoded``, the bytes of their JPEGs gathered into one tensor and the images Pillow decoded
    stacked into another (a block of shared memory each to the main process, not one an image)."""
    gathered = list(items)
    jpegs = [i for i, item in enumerate(items) if isinstance(_image(item), Encoded)]
    if jpegs:
        sizes = [items[i]["image"].data.numel() for i in jpegs]
        parts = torch.cat([items[i]["image"].data for i in jpegs]).split(sizes)  # views of one (N,) uint8
        for i, part in zip(jpegs, parts):
            gathered[i] = {**items[i], "image": replace(items[i]["image"], data=part)}
    pillowed = [i for i, item in enumerate(items) if not isinstance(item, Skipped) and "pillow" in item]
    pixels = torch.stack([items[i]["image"] for i in pillowed]) if pillowed else None  # (P, 3, S, S)
    for i in pillowed:
        gathered[i] = {**items[i], "image": None}
    return Undecoded(gathered, collate, transform, pixels)


def _image(item: dict | Skipped) -> Any:
    """The ``image`` of a dataset item; a Skipped item's is its Skipped record."""
    return item if isinstance(item, Skipped) else item["image"]


def fixed_captions(captions: Sequence[torch.Tensor], k: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Exactly ``k`` of an image's ``captions`` and their loss weights (k,).

    Exactly k: all of them, in order, weights 1, and no random number drawn. More: k of them drawn without
    replacement by torch's generator (in a loader worker, the worker's: a seeded run draws the same, each epoch
    afresh), weights 1. Fewer: all of them, then repeated in turn up to k with weight 0, so every caption counts
    once and a repeat never does.
    """
    n = len(captions)
    if n >= k:
        chosen = range(k) if n == k else torch.randperm(n)[:k].tolist()
        return [captions[i] for i in chosen], torch.ones(k)
    weights = torch.cat([torch.ones(n), torch.zeros(k - n)])  # (k,)
    return [captions[i % n] for i in range(k)], weights


def _static_rows(
    items: list[dict | Skipped], like: dict, k: int, rows: int | None
) -> tuple[list[dict], list[torch.Tensor]]:
    """``items`` as rows of K captions each (``fixed_captions``), a Skipped item and the padding up to ``rows`` as
    masked rows shaped as ``like``, with their caption weights."""
    key = "features" if "features" in like else "image"
    masked = {
        key: torch.zeros_like(like[key]),
        "captions": [torch.zeros(0, dtype=torch.long)] * k,  # all <pad> once padded
        "image_id": -1,
        "index": 0,
        "masked": True,
    }
    out, weights = [], []
    for item in [*items, *[None] * max(0, (rows or 0) - len(items))]:
        if item is None or isinstance(item, Skipped):
            out.append(masked)
            weights.append(torch.zeros(k))
            continue
        captions, weight = fixed_captions(item["captions"], k)
        out.append({**item, "captions": captions})
        weights.append(weight)
    return out, weights


def _empty_batch(skipped: list[Skipped]) -> dict:
    """A batch with no images (every item was skipped)."""
    empty = torch.zeros(0, dtype=torch.long)
    return {
        "images": torch.zeros(0, 3, 0, 0),
        "captions": torch.zeros(0, 0, dtype=torch.long),
        "lengths": empty,
        "caption_weights": torch.zeros(0),
        "image_index": empty,
        "captions_per_image": None,
        "real": torch.zeros(0, dtype=torch.bool),
        "image_ids": empty,
        "indices": empty,
        "skipped": skipped,
    }


class SkipCounter:
    """Unreadable images seen during a run, counted once per path, for one summary line."""

    def __init__(self) -> None:
        self._skipped: dict[str, Skipped] = {}

    def add(self, skipped: Sequence[Skipped]) -> list[Skipped]:
        """Record ``skipped`` (e.g. ``batch["skipped"]``); return those not seen before."""
        new = []
        for item in skipped:
            if item.path not in self._skipped:
                self._skipped[item.path] = item
                new.append(item)
        return new

    @property
    def count(self) -> int:
        """Number of distinct unreadable images."""
        return len(self._skipped)

    def first(self, n: int = 5) -> list[Skipped]:
        """The first ``n`` distinct unreadable images, in the order they were met."""
        return list(self._skipped.values())[:n]

    def report(self, n: int = 5) -> str:
        """One line: how many images were skipped and the first ``n`` with their reasons ("" if none)."""
        if not self._skipped:
            return ""
        shown = "; ".join(f"{s.path} ({s.reason})" for s in self.first(n))
        more = f"; and {self.count - n} more" if self.count > n else ""
        noun = "image" if self.count == 1 else "images"
        return f"skipped {self.count} unreadable {noun}: {shown}{more}"
