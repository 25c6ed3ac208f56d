"""The training samples of WebDataset shards as a stream of ``CaptionDataset``'s items, each read once an epoch
across every rank and loader worker, every reader yielding the same number of items.

Per epoch and reader (a rank's loader worker; ``rank * workers + worker``): the shards in the epoch's order, cut
into equal runs of samples (``shards.epoch_plan``) -> this reader's run, read by the ``webdataset`` library ->
a shuffle buffer -> decode (``images.load_rgb``: an unreadable image becomes ``Skipped``, counted; with ``encoded``,
a JPEG's bytes left for the model's device: ``dataset.item_image``) -> the items ``CaptionDataset`` yields ->
padding (``PADDING``) up to the declared length, a whole number of batches the same on every reader, so every
rank runs the same number of steps. The epoch comes from ``set_epoch`` through shared memory, so persistent loader
workers see it too.
"""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice, repeat
from typing import Any

import torch
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from captioner.data.dataset import Skipped, item_image
from captioner.data.images import ImageError
from captioner.data.shards import (
    IMAGE_EXTENSIONS,
    Piece,
    Shard,
    WebDatasetSource,
    broken_off,
    epoch_plan,
    image_id,
    items_per_reader,
    readers_needed,
    sample_captions,
)
from captioner.data.vocab import Vocabulary


@dataclass(frozen=True)
class Padding(Skipped):
    """An item that fills a reader's last batches up to the epoch's declared length: a masked row, not an
    unreadable image (``CaptionDataModule`` leaves it out of the skipped images it reports)."""


PADDING = Padding("", "padding up to the epoch's declared length")


class ShardStream(IterableDataset):
    """The items of ``shards`` that rank ``rank`` of ``ranks`` reads through ``workers`` loader workers (0: in the
    loading process), ``len()`` of them every epoch (a whole number of ``batch_size`` batches).

    ConfigError when there are fewer shards than readers (``ranks`` x workers). ``encoded``: the model's device
    decodes the JPEGs (``CaptionDataset``'s ``encoded``).
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        vocab: Vocabulary,
        transform: Callable[[Image.Image], torch.Tensor],
        *,
        max_len: int,
        batch_size: int,
        rank: int,
        ranks: int,
        workers: int,
        seed: int,
        shuffle_buffer: int,
        captions_field: str,
        encoded: bool = False,
    ) -> None:
        self.shards = list(shards)
        self.vocab = vocab
        self.transform = transform
        self.encoded = encoded
        self.max_len = max_len
        self.rank = rank
        self.workers = max(1, workers)
        self.readers = ranks * self.workers
        readers_needed(self.shards, self.readers, ranks, self.workers)
        self.per_reader = items_per_reader(self.shards, self.readers, batch_size)
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.captions_field = captions_field
        self._epoch = multiprocessing.Value("q", 0)  # shared memory: persistent loader workers read it too

    @classmethod
    def of(
        cls,
        source: WebDatasetSource,
        vocab: Vocabulary,
        transform: Callable[[Image.Image], torch.Tensor],
        encoded: bool = False,
        **reading: int,
    ) -> ShardStream:
        """The training stream of one rank over ``source``'s shards, read as it says (seed, shuffle buffer, captions
        field); ``reading``: ``max_len``, ``batch_size``, ``rank``, ``ranks``, ``workers``; ``encoded``: the model's
        device decodes the JPEGs."""
        return cls(
            source.shards,
            vocab,
            transform,
            seed=source.seed,
            shuffle_buffer=source.shuffle_buffer,
            captions_field=source.captions_field,
            encoded=encoded,
            **reading,
        )

    def set_epoch(self, epoch: int) -> None:
        """Read the shards in ``epoch``'s order from the next ``iter()`` on (the loader's workers included)."""
        self._epoch.value = epoch

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` reads."""
        return self._epoch.value

    def __len__(self) -> int:
        """The items this rank yields an epoch: every worker's, padding included."""
        return self.per_reader * self.workers

    def __iter__(self) -> Iterator[dict[str, Any] | Skipped]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if workers != self.workers:
            raise RuntimeError(f"the stream was planned for {self.workers} loader workers, the loader has {workers}")
        epoch, reader = self.epoch, self.rank * self.workers + worker
        pieces = epoch_plan(self.shards, epoch, self.seed, self.readers)[reader]
        rng = random.Random(f"{self.seed}/{epoch}/{reader}")
        samples = _shuffled(_read(pieces), self.shuffle_buffer, rng)
        items = (self._item(sample) for sample in samples)
        return islice(chain(items, repeat(PADDING)), self.per_reader)

    def _item(self, sample: dict[str, Any]) -> dict[str, Any] | Skipped:
        """``CaptionDataset``'s item of a sample (``{"image" (3, H, W), "captions", "image_id", "index"}``), or
        Skipped naming ``<shard>#<key>.<ext>`` when it has no image, no caption or an unreadable image."""
        key = sample["__key__"]
        ext = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)
        name = f"{sample['__url__']}#{key}.{ext or IMAGE_EXTENSIONS[0]}"
        if ext is None:
            return Skipped(name, f"no image member ({', '.join(IMAGE_EXTENSIONS)})")
        captions = sample_captions(sample, self.captions_field)
        if not captions:
            return Skipped(name, f"no caption (a txt member, or {self.captions_field} or caption in its json)")
        try:
            image = item_image(name, self.transform, self.encoded, data=sample[ext])
        except ImageError as exc:
            return Skipped(name, exc.reason)
        return {
            **image,  # "image": (3, H, W), or an Encoded JPEG
            "captions": [torch.tensor(self.vocab.encode(c, self.max_len), dtype=torch.long) for c in captions],
            "image_id": image_id(key),
            "index": sample["__index__"],
        }


def _read(pieces: Sequence[Piece]) -> Iterator[dict[str, Any]]:
    """The samples of ``pieces`` in order, each with ``__index__`` (its position among all the shards' samples);
    a shard that breaks off is warned about and left (``broken_off``: its reader pads instead)."""
    from webdataset.tariterators import tarfile_samples

    for piece in pieces:
        samples = tarfile_samples([{"url": piece.shard.url}], handler=broken_off(piece.shard.url))
        try:
            wanted = islice(samples, piece.skip, piece.skip + piece.take)
            for position, sample in enumerate(wanted, piece.skip):
                sample["__index__"] = piece.shard.offset + position
                yield sample
        finally:
            samples.close()


def _shuffled(samples: Iterator[dict[str, Any]], buffer: int, rng: random.Random) -> Iterator[dict[str, Any]]:
    """``samples`` through webdataset's shuffle buffer of ``buffer`` samples, drawn with ``rng``."""
    from webdataset.filters import _shuffle

    return _shuffle(samples, bufsize=buffer, initial=buffer, rng=rng)
