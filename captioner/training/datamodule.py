"""LightningDataModule: records from a source, the vocabulary, datasets, loaders and the feature cache."""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from captioner.config import MAX_AUTO_WORKERS, UNKNOWN_WORDS_WARNING, DataConfig
from captioner.data.dataset import CaptionDataset, Undecoded, build_transform, collate, defer
from captioner.data.device_decoding import DecodeTally, on_device
from captioner.data.features import Batches, FeatureCache, FeatureCaptionDataset, Share, cache_key
from captioner.data.readers import SPLITS, Box, Record
from captioner.data.sources import Source
from captioner.data.stream import Padding, ShardStream
from captioner.data.vocab import SPECIALS, Vocabulary, tokenize, word_counts
from captioner.errors import DataError

log = logging.getLogger(__name__)

NAMED_WORDS = 10  # the words a line about the vocabulary names at most


class FeatureEncoder(Protocol):
    """What fills a feature cache: the model being trained (``CaptionerModule``), which runs its own encoder."""

    def cached_stages(self) -> dict[str, Any]:
        """What the cache holds the output of (the encoder's settings and its frozen weights' fingerprint): part
        of the cache's key. DataError when the encoder has no frozen stages to cache."""

    def fill_cache(
        self, cache: FeatureCache, images: Dataset, batches: Batches, batch_size: int, dtype: str, share: Share
    ) -> None:
        """Write the output of the frozen stages for the images of ``share`` into ``cache`` (``FeatureCache.fill``)."""


class CaptionDataModule(L.LightningDataModule):
    """Train/val/test loaders over one ``Source``.

    Training batches hold each image once with K of its captions (``per_caption=False``;
    ``training_captions_per_image``), so the CNN runs once per image and every batch has the same shapes. With
    ``feature_cache`` set, the output of the encoder's frozen stages (all of a frozen encoder: the grid features)
    is computed once by the model being trained (``FeatureEncoder``, the processes of each node sharing the work)
    and the loaders yield ``features`` instead of ``images``; the model runs the stages it trains on them. A source
    that ``streams`` (``data=webdataset``) gives the training split as a stream of shards instead of records
    (``_train_stream``). The vocabulary, the share of the training words it reads as ``<unk>`` (logged) and the
    images' caption counts come from one pass over the training captions. Where the model's device decodes JPEGs
    (``data.decode``; on CUDA by default), the loaders' workers only read the files and the device decodes each
    batch's JPEGs as it receives the batch (``transfer_batch_to_device``), counted in ``decoded``; a feature cache
    is filled from images the workers decode.
    """

    def __init__(self, source: Source, settings: DataConfig, grow_vocab: bool = False) -> None:
        """Batches of the dataset ``source`` (built from ``settings.source``) as ``settings`` (the ``data``
        config, typed) say. ``grow_vocab`` (``init_vocab=grow``): the vocabulary of ``settings.vocab_file`` gains
        the training words it lacks (``Vocabulary.grow``) instead of being used as it is."""
        super().__init__()
        self.settings = settings
        self.grow_vocab = grow_vocab
        self.source = source
        self.eval_batch_size = self.settings.eval_batch_size or self.settings.batch_size
        self.vocab: Vocabulary | None = None
        self.splits: dict[str, list[Record]] = {}
        self.caption_counts: Counter[int] = Counter()  # training images by their number of captions
        self.streams: bool = getattr(source, "streams", False)  # the training split streams (data=webdataset)
        self._stream: ShardStream | None = None
        self.decoded = DecodeTally()  # where the device-decoding loaders' images were decoded since the last report

    def prepare_data(self) -> None:
        """Check the files exist, generating the built-in dataset on first use."""
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        """Read the records and build (or load, and with ``grow_vocab`` grow) the vocabulary from the training
        captions only; log the share of their words it reads as ``<unk>``."""
        if self.vocab is not None:
            return
        self.source.prepare()
        for split in SPLITS:
            self.splits[split] = [] if self.streams and split == "train" else self.source.records(split)
        if not self.streams and not self.splits["train"]:
            raise DataError("the training split has no images")
        lengths: Counter[int] = Counter()  # training captions by their number of words
        counts = word_counts(self._counted_captions(), lengths)  # word -> occurrences, one pass
        self._report_cut(lengths)
        given = Vocabulary.load(self.settings.vocab_file) if self.settings.vocab_file else None
        self.vocab = given
        if given is None or self.grow_vocab:
            self.vocab = (given or Vocabulary([])).grow(counts, self.settings.min_word_count, self.settings.max_vocab)
        if given is not None and self.grow_vocab:
            log.info(self._grown(given, counts))
        self._report_unknown(counts, fixed=given is not None)

    def _report_cut(self, lengths: Counter[int]) -> None:
        """Log how many training captions (``lengths``: captions by their number of words) are longer than
        ``data.max_len`` words, which training cuts to it, and the longest; nothing when none is."""
        limit = self.settings.max_len
        cut = sum(n for words, n in lengths.items() if words > limit)
        if cut:
            log.info(
                "training captions: %s of %s (%.1f%%) have more than data.max_len=%d words and are cut to %d "
                "(the longest has %s)",
                f"{cut:,}", f"{lengths.total():,}", 100 * cut / lengths.total(), limit, limit, f"{max(lengths):,}",
            )  # fmt: skip

    def _grown(self, given: Vocabulary, counts: Counter[str]) -> str:
        """What growing the vocabulary ``given`` with the training words of ``counts`` added, and left out."""
        added = self.vocab.itos[len(given) :]
        left_out = len(given.grow(counts, self.settings.min_word_count)) - len(self.vocab)  # by data.max_vocab
        rule = f"seen at least data.min_word_count={self.settings.min_word_count} times"
        line = f"init_vocab=grow: the vocabulary of {len(given)} tokens keeps their ids and "
        if added:
            line += (
                f"gains {len(added)} training words {rule}, ids {len(given)}..{len(self.vocab) - 1}, which start "
                f"untrained: {_named(added)}"
            )
        else:
            line += f"gains no training word {rule}" + ("" if left_out else ": it holds every one")
        if left_out:
            line += f"; data.max_vocab={self.settings.max_vocab} leaves out {left_out}{' more' if added else ''}"
        return line

    def _report_unknown(self, counts: Counter[str], fixed: bool) -> None:
        """Log the share of the training words (``counts``: word -> occurrences) the vocabulary reads as ``<unk>``;
        a warning naming the most frequent of them above ``UNKNOWN_WORDS_WARNING`` for a vocabulary ``fixed`` in
        advance (``data.vocab_file``: init_from's model's, or the user's)."""
        unknown = self.vocab.unknown(counts)
        missing, total = unknown.total(), counts.total()
        share = missing / total if total else 0.0
        data = self.settings
        if not fixed:
            admitted = sum(n >= data.min_word_count for n in counts.values())
            cap = (
                f", the data.max_vocab={data.max_vocab} most frequent"
                if admitted > len(self.vocab) - len(SPECIALS)
                else ""
            )
            whose = f"built from them (words seen at least data.min_word_count={data.min_word_count} times{cap})"
        else:
            whose = f"of data.vocab_file={data.vocab_file}" + (", grown" if self.grow_vocab else "")
        line = (
            f"training captions: {missing:,} of {total:,} words ({share:.1%}) read as <unk> by the vocabulary {whose}"
        )
        if not fixed or share <= UNKNOWN_WORDS_WARNING:
            log.info(line)
            return
        remedy = (
            f"each is seen fewer than data.min_word_count={data.min_word_count} times"
            if self.grow_vocab
            else "init_vocab=grow (with init_from) adds them to the model's vocabulary"
        )
        words = [f"{word} ({n:,})" for word, n in unknown.most_common()]
        log.warning(
            "%s: more than %.0f%%; the most frequent: %s; %s", line, UNKNOWN_WORDS_WARNING * 100, _named(words), remedy
        )

    def _training_captions(self) -> Iterator[Sequence[str]]:
        """Each training image's captions: its record's, or a stream's in one pass over the shards."""
        if self.streams:
            return self.source.captions()
        return (r.captions for r in self.splits["train"])

    def _counted_captions(self) -> Iterator[str]:
        """Every training caption, counting each image's in ``caption_counts`` on the way (one pass)."""
        for captions in self._training_captions():
            if captions:  # a sample without one is skipped in training
                self.caption_counts[len(captions)] += 1
            yield from captions

    def train_items(self) -> int:
        """Training items an epoch over all ranks: images (captions with ``per_caption``), a stream's samples."""
        if self.streams:
            return sum(shard.size for shard in self.source.shards)
        records = self.splits["train"]
        return sum(len(r.captions) for r in records) if self.settings.per_caption else len(records)

    def references(self, split: str) -> dict[int, list[list[str]]]:
        """Tokenised reference captions per image id, for BLEU."""
        return {r.image_id: [tokenize(c) for c in r.captions] for r in self.splits[split]}

    def boxes(self, split: str) -> dict[int, tuple[Box, ...]]:
        """Object boxes per image id (empty for datasets without instances)."""
        return {r.image_id: r.boxes for r in self.splits[split] if r.boxes}

    def image_dataset(
        self,
        split: str,
        train: bool = False,
        per_caption: bool = False,
        records: list[Record] | None = None,
        encoded: bool = False,
    ) -> CaptionDataset:
        """The image-decoding dataset of ``split`` (of its ``records`` only, when given); ``encoded``: its JPEGs
        left to the model's device."""
        transform = build_transform(self.settings.image_size, train=train, augment=self.settings.augment and train)
        chosen = self.splits[split] if records is None else records
        return CaptionDataset(
            chosen, self.vocab, transform, max_len=self.settings.max_len, per_caption=per_caption, encoded=encoded
        )

    def decodes_on_device(self) -> bool:
        """Whether the model's device decodes the loaders' JPEGs (``data.decode``: auto on a CUDA device)."""
        return on_device(self.settings.decode, self.device)

    @property
    def device(self) -> torch.device:
        """The model's device: the trainer's (the CPU when no trainer is attached)."""
        return torch.device("cpu") if self.trainer is None else self.trainer.strategy.root_device

    def _dataset(self, split: str, train: bool) -> Dataset:
        per_caption = self.settings.per_caption and train
        if self.settings.feature_cache is None:
            return self.image_dataset(split, train=train, per_caption=per_caption, encoded=self.decodes_on_device())
        cache = self._ensure_cache(split)
        return FeatureCaptionDataset(
            self.splits[split], self.vocab, cache, max_len=self.settings.max_len, per_caption=per_caption
        )

    def _ensure_cache(self, split: str) -> FeatureCache:
        """The feature cache of ``split``, filled by the model being trained (``FeatureEncoder``) on first use."""
        encoder: FeatureEncoder = self.trainer.lightning_module
        key = cache_key(
            encoder.cached_stages(), self.settings.image_size, self.splits[split], self.settings.feature_dtype.value
        )
        cache = FeatureCache(Path(self.settings.feature_cache) / f"{split}-{key}")
        # The processes of a node build its cache together, each its share of the chunks, into one file.
        share = Share(self.trainer.local_rank, self.trainer.num_devices)
        if not cache.exists():
            log.info(
                "computing the %s feature cache in %s (share %d of %d)",
                split,
                cache.folder,
                share.rank + 1,
                share.ranks,
            )
            # Its own generator: building the cache (or not) leaves the global RNG, so training, as it was.
            batches = functools.partial(self._loader, shuffle=False, generator=torch.Generator().manual_seed(0))
            dtype = self.settings.feature_dtype.value
            encoder.fill_cache(cache, self.image_dataset(split), batches, self.eval_batch_size, dtype, share)
        self.trainer.strategy.barrier("feature_cache")  # every share written
        if share.rank == 0:
            cache.finish()
        self.trainer.strategy.barrier("feature_cache_in_place")
        return cache

    def _loader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool,
        generator: torch.Generator | None = None,
        train: bool = False,
    ) -> DataLoader:
        """Batches of ``dataset``; ``train``: static ones (K captions per image, masked rows for unreadable images
        and, with ``pad_to``, for an epoch's last, smaller batch: ``collate``); ``Undecoded`` ones of a dataset
        whose JPEGs the device decodes (``encoded``)."""
        workers = loader_workers(self.settings.num_workers)
        static = {}
        if train:
            rows = batch_size if self.settings.pad_to is not None else None
            static = {"captions_per_image": self.training_captions_per_image(), "rows": rows}
        batches = functools.partial(collate, pad_to=self.settings.pad_to, **static)
        if getattr(dataset, "encoded", False):
            batches = functools.partial(defer, collate=batches, transform=dataset.transform)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            collate_fn=batches,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(),
            generator=generator,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (Lightning adds the distributed sampler under DDP; a stream splits itself)."""
        if self.streams:
            return self._loader(self._train_stream(), self.settings.batch_size, shuffle=False, train=True)
        return self._loader(self._dataset("train", train=True), self.settings.batch_size, shuffle=True, train=True)

    def training_captions_per_image(self) -> int:
        """K, the captions each training image takes per step: ``data.captions_per_image``, 1 with
        ``per_caption``, else when None the most common caption count of the training images (logged)."""
        if self.settings.per_caption:
            return 1
        if self.settings.captions_per_image is not None:
            return self.settings.captions_per_image
        if not self.caption_counts:  # setup counts them in its pass; records given without setup are counted here
            self.caption_counts.update(len(captions) for captions in self._training_captions() if captions)
        counts = self.caption_counts
        k = max(counts, key=lambda n: (counts[n], n))
        log.info(
            "data.captions_per_image=%d, the most common caption count of the training images (%d of %d): "
            "images with more take %d drawn afresh each epoch, those with fewer repeat theirs with weight 0",
            k,
            counts[k],
            counts.total(),
            k,
        )
        return k

    def _train_stream(self) -> IterableDataset:
        """This rank's share of the training shards, at the trainer's epoch (``set_epoch`` moves it on); ConfigError
        when there are fewer shards than ranks x loader workers."""
        transform = build_transform(self.settings.image_size, train=True, augment=self.settings.augment)
        self._stream = ShardStream.of(
            self.source,
            self.vocab,
            transform,
            max_len=self.settings.max_len,
            batch_size=self.settings.batch_size,
            rank=self.trainer.global_rank,
            ranks=self.trainer.world_size,
            workers=loader_workers(self.settings.num_workers),
            encoded=self.decodes_on_device(),
        )
        self._stream.set_epoch(self.trainer.current_epoch)
        return self._stream

    def set_epoch(self, epoch: int) -> bool:
        """The streamed training split reads ``epoch``'s shard order from its next pass (records: nothing to do);
        whether that changed the epoch it was set to read."""
        if self._stream is None or self._stream.epoch == epoch:
            return False
        self._stream.set_epoch(epoch)
        return True

    def val_dataloader(self) -> DataLoader:
        """Validation images in order, each with all its captions."""
        return self._loader(self._dataset("val", train=False), self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test images in order, each with all its captions."""
        return self._loader(self._dataset("test", train=False), self.eval_batch_size, shuffle=False)

    def transfer_batch_to_device(self, batch: dict | Undecoded, device: torch.device, dataloader_idx: int) -> dict:
        """Move the tensors; ``batch["skipped"]`` (the unreadable images' names) stays as it is.

        Lightning refuses to walk into the frozen ``Skipped`` records, so they are set aside meanwhile. An
        ``Undecoded`` batch is first decoded on ``device`` (``Undecoded.decoded``, counted in ``decoded``): here,
        not in ``on_after_batch_transfer``, since its JPEGs' bytes must stay on the host, where the decoder reads them.
        """
        if isinstance(batch, Undecoded):
            batch = batch.decoded(device, self.decoded)
        skipped = [item for item in batch.pop("skipped") if not isinstance(item, Padding)]  # padding is no image
        batch = super().transfer_batch_to_device(batch, device, dataloader_idx)
        batch["skipped"] = skipped
        return batch

    def decoding_report(self) -> str:
        """One line: where the images of the batches decoded since the last report were decoded ("" when the
        device decodes none); the count starts again."""
        line = self.decoded.report(self.device)
        self.decoded = DecodeTally()
        return line

    def state_dict(self) -> dict[str, Any]:
        """The vocabulary travels in Lightning checkpoints, so a resumed run uses the same ids."""
        return {"vocab": self.vocab.to_dict()} if self.vocab is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the vocabulary of the checkpoint; it must match the one rebuilt from the data."""
        if "vocab" in state_dict and self.vocab is not None:
            saved = Vocabulary.from_dict(state_dict["vocab"])
            if saved.itos != self.vocab.itos:
                raise DataError(
                    "the checkpoint's vocabulary differs from the one built from this dataset; "
                    "resume with the same data configuration"
                )


def _named(words: Sequence[str]) -> str:
    """``words`` joined, the first ``NAMED_WORDS`` of them and how many more."""
    more = f" and {len(words) - NAMED_WORDS} more" if len(words) > NAMED_WORDS else ""
    return ", ".join(words[:NAMED_WORDS]) + more


def loader_workers(num_workers: int | None) -> int:
    """``num_workers``, or when None the CPUs this process may use less one (the main process), at most
    ``MAX_AUTO_WORKERS``."""
    if num_workers is not None:
        return num_workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(cpus - 1, MAX_AUTO_WORKERS))
