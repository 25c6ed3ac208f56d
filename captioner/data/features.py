"""Feature cache for the frozen stages of the encoder: computed once, stored in fp16, read memory-mapped.

With a frozen CNN every epoch would recompute the same (L, C) grid for every image; with its last
stages trained, the same input to them. The cache runs the frozen stages once per image
(``Captioner.encode``), writes ``features.npy`` (N, L, C) beside ``index.json`` (image ids, grid, dtype),
and later epochs train from it. A cache is keyed by everything that changes its content
(encoder config, image size, the images), so a stale cache is never read.

It is built in bounded memory and survives a kill: in a partial folder beside its own (``.<name>.partial``),
``features.npy`` is preallocated at its full size (one row per image) and each chunk of images (one loader
batch) is written into it as soon as it is encoded, then recorded as finished (``chunks/<rows>.json``: its
image ids and the images it could not read); a build started again skips the recorded chunks. Processes
can build shares of the chunks at once (``Share``: the ranks of a node under DDP). Once every chunk is
recorded the partial folder is renamed into place, so a half-built cache is never read, and an existing
folder is never deleted or overwritten. Images that could not be read keep an empty row, are listed in
``index.json`` with the reason, and the dataset reports them as ``Skipped`` items, as the image dataset does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from captioner.config import MAX_LEN
from captioner.data.dataset import Skipped
from captioner.data.readers import Record
from captioner.data.vocab import Vocabulary
from captioner.errors import DataError
from captioner.fileio import atomic_write, read_json, write_json

log = logging.getLogger(__name__)

# What fills the cache: (B, 3, H, W) images -> (B, L, C) features and the (H', W') grid they come from.
Encode = Callable[[torch.Tensor], tuple[torch.Tensor, tuple[int, int]]]
# The batches of a dataset (collated as ``collate`` does: images, image_ids, indices, skipped), its items in
# order, the given number at a time (a DataLoader without shuffling).
Batches = Callable[[Dataset, int], Iterable[dict]]
CHUNKS = "chunks"  # the partial folder's records of finished chunks, one file each, named by their rows
PLAN = "plan.json"  # the partial folder's record of what is built: {rows, dtype}
ROW_DIGITS = 12  # the rows in a record's name, zero-padded: the names sort as the rows do


def cache_key(encoder_config: dict, image_size: int, records: Iterable[Record], dtype: str) -> str:
    """A short hash of everything that determines the cached features."""
    payload = {
        "encoder": encoder_config,
        "image_size": image_size,
        "dtype": dtype,
        "images": [(r.image_id, r.image_path) for r in records],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Share:
    """The chunks one of ``ranks`` processes building a cache together encodes: ``rank``, ``rank + ranks``, ...
    (a chunk is ``batch_size`` consecutive images)."""

    rank: int = 0
    ranks: int = 1


class FeatureCache:
    """A folder holding ``features.npy`` (N, L, C) and ``index.json`` {image_ids (one per row, null for an image
    that could not be read), grid, dtype, skipped}."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.partial = self.folder.parent / f".{self.folder.name}.partial"  # where it is built
        self._features: np.ndarray | None = None
        self._row: dict[int, int] | None = None
        self._skipped: dict[str, str] | None = None
        self.grid: tuple[int, int] | None = None

    def exists(self) -> bool:
        """True when a complete cache is in place."""
        return (self.folder / "index.json").is_file() and (self.folder / "features.npy").is_file()

    def build(
        self,
        encode: Encode,
        images: Dataset,
        batches: Batches,
        batch_size: int,
        device: torch.device | str,
        dtype: str = "float16",
    ) -> None:
        """Encode every image of ``images`` (``batch_size`` at a time) that is not cached yet, then put the cache
        in place: ``fill`` and ``finish`` in one process."""
        self.fill(encode, images, batches, batch_size, device, dtype)
        self.finish()

    @torch.no_grad()
    def fill(
        self,
        encode: Encode,
        images: Dataset,
        batches: Batches,
        batch_size: int,
        device: torch.device | str,
        dtype: str = "float16",
        share: Share = Share(),
    ) -> None:
        """Encode the chunks of ``share`` not recorded as finished in the partial folder, each written into its
        rows of ``features.npy`` and recorded as soon as it is encoded (nothing for a cache already in place).

        ``images`` yields items as ``CaptionDataset`` does (``image``, ``image_id``, ``index``: its position) or
        ``Skipped``; ``batches(subset, batch_size)`` batches them in order. Memory holds one chunk at a time.
        DataError, before anything is encoded, when a folder that is not a complete cache is in the way.
        """
        if self.exists():
            return
        self._refuse_what_is_in_the_way()
        rows = len(images)
        write_json(self.partial / PLAN, {"rows": rows, "dtype": dtype})
        chunks = self._chunks_left(rows, batch_size, share)
        log.info(
            "feature cache %s: %d chunks of %d images to encode in this process", self.folder, len(chunks), batch_size
        )
        subset = Subset(images, [row for start, stop in chunks for row in range(start, stop)])
        for (start, stop), batch in zip(chunks, batches(subset, batch_size) if chunks else (), strict=True):
            self._write_chunk(start, stop, batch, encode, device, getattr(torch, dtype), rows)

    def finish(self) -> None:
        """Put a cache whose every chunk is recorded in place (``index.json`` written, the partial folder renamed).

        Another process that finished the same cache first wins. DataError when a chunk is missing (the build
        was cut short: building again resumes it), or when a folder that is not a complete cache is in the
        way (it is never deleted; the features stay in the partial folder for the next try).
        """
        if not self.exists():
            try:
                self._write_index()
                os.replace(self.partial, self.folder)  # fails when the folder exists and is not empty
            except (OSError, DataError):
                if not self.exists():
                    self._refuse_what_is_in_the_way()
                    raise
        shutil.rmtree(self.partial, ignore_errors=True)
        shutil.rmtree(self.folder / CHUNKS, ignore_errors=True)  # the build's records, not needed any more
        (self.folder / PLAN).unlink(missing_ok=True)

    def _refuse_what_is_in_the_way(self) -> None:
        """DataError when something that is not a complete cache (a file, a folder with content) is at its place."""
        occupied = self.folder.is_file() or (self.folder.is_dir() and any(self.folder.iterdir()))
        if occupied and not self.exists():
            raise DataError(
                f"{self.folder} is in the way of the feature cache and is not a complete one; "
                "move it away or point data.feature_cache elsewhere"
            )

    def _chunks_left(self, rows: int, batch_size: int, share: Share) -> list[tuple[int, int]]:
        """The (start, stop) rows of the chunks of ``share`` that no record covers yet, in order."""
        done = np.zeros(rows, dtype=bool)  # (N,)
        for start, stop in self._recorded():
            done[start:stop] = True
        starts = range(share.rank * batch_size, rows, share.ranks * batch_size)
        chunks = [(start, min(start + batch_size, rows)) for start in starts]
        return [(start, stop) for start, stop in chunks if not done[start:stop].all()]

    def _record(self, start: int, stop: int) -> Path:
        """The record of the chunk of rows ``start`` .. ``stop - 1``."""
        return self.partial / CHUNKS / f"{start:0{ROW_DIGITS}d}-{stop:0{ROW_DIGITS}d}.json"

    def _recorded(self) -> list[tuple[int, int]]:
        """The rows of every chunk recorded as finished, by their records' names, in order."""
        names = sorted(path.stem for path in (self.partial / CHUNKS).glob(f"{'[0-9]' * ROW_DIGITS}-*.json"))
        return [(int(start), int(stop)) for start, stop in (name.split("-") for name in names)]

    def _write_chunk(
        self,
        start: int,
        stop: int,
        batch: dict,
        encode: Encode,
        device: torch.device | str,
        dtype: torch.dtype,
        rows: int,
    ) -> None:
        """Encode one chunk's images, write them into their rows (an unreadable image's row stays zero), flush,
        then record the chunk (its image ids, null for an unreadable image, and the images it skipped)."""
        ids: list[int | None] = [None] * (stop - start)
        grid = None
        if batch["images"].numel():
            features, grid = encode(batch["images"].to(device))  # (B, L, C)
            offsets = batch["indices"].numpy() - start  # (B,) the images' rows in the chunk
            if offsets.min() < 0 or offsets.max() >= stop - start:
                raise ValueError(f"the batch of rows {start}..{stop - 1} holds other rows: batches must keep the order")
            computed = features.to("cpu", dtype).numpy()  # (B, L, C)
            block = np.zeros((stop - start, *computed.shape[1:]), computed.dtype)  # (stop - start, L, C)
            block[offsets] = computed
            for offset, image_id in zip(offsets.tolist(), batch["image_ids"].tolist(), strict=True):
                ids[offset] = image_id
            self._write_rows(start, block, rows)
        record = {
            "rows": [start, stop],
            "ids": ids,
            "grid": grid and list(grid),
            "skipped": [[s.path, s.reason] for s in batch["skipped"]],
        }
        write_json(self._record(start, stop), record, indent=None)

    def _write_rows(self, start: int, block: np.ndarray, rows: int) -> None:
        """Write ``block`` (n, L, C) into rows ``start`` .. ``start + n - 1`` of the partial ``features.npy``
        (made at its full size of ``rows`` rows by the first chunk) and flush it to disk.

        The file is mapped for this chunk only: pages of a mapped file count in the process's resident memory,
        so a mapping kept open would grow with every chunk written through it.
        """
        path = self.partial / "features.npy"
        shape = (rows, *block.shape[1:])
        if not path.exists():
            _preallocate(path, shape, block.dtype)
        features = np.lib.format.open_memmap(path, mode="r+")  # (N, L, C)
        if features.shape != shape or features.dtype != block.dtype:
            raise DataError(
                f"{path} holds a {features.dtype} array of shape {features.shape}, not {block.dtype} {shape}: "
                f"delete {self.partial} and build the cache again"
            )
        features[start : start + len(block)] = block
        features.flush()
        del features

    def _write_index(self) -> None:
        """Write ``index.json`` into the partial folder from the chunks' records; DataError when a row is missing."""
        plan = read_json(self.partial / PLAN, "feature cache plan")
        ids: list[int | None] = [None] * plan["rows"]
        done = np.zeros(plan["rows"], dtype=bool)  # (N,)
        grid, skipped = None, {}
        for start, stop in self._recorded():
            record = read_json(self._record(start, stop), "feature cache record")
            ids[start:stop] = record["ids"]
            done[start:stop] = True
            grid = grid or record["grid"]
            skipped.update(record["skipped"])
        if not done.all():
            raise DataError(
                f"the feature cache in {self.partial} is unfinished ({int((~done).sum())} of {len(done)} images not "
                "encoded yet): building it again resumes it"
            )
        if not (self.partial / "features.npy").exists():  # no image could be read
            with atomic_write(self.partial / "features.npy") as handle:
                np.save(handle, np.zeros((0, 0, 0), plan["dtype"]))
        index = {"image_ids": ids, "grid": grid or [0, 0], "dtype": plan["dtype"], "skipped": list(skipped.items())}
        write_json(self.partial / "index.json", index)

    def _open(self) -> None:
        index = read_json(self.folder / "index.json", "feature cache index")
        self._row = {image_id: row for row, image_id in enumerate(index["image_ids"]) if image_id is not None}
        self._skipped = {path: reason for path, reason in index.get("skipped", [])}
        self.grid = tuple(index["grid"])
        self._features = np.load(self.folder / "features.npy", mmap_mode="r")

    def __contains__(self, image_id: int) -> bool:
        if self._row is None:
            self._open()
        return image_id in self._row

    def skip_reason(self, path: str) -> str:
        """Why the image at ``path`` has no features (recorded when the cache was built)."""
        if self._row is None:
            self._open()
        return self._skipped.get(path, "not in the feature cache")

    def get(self, image_id: int) -> torch.Tensor:
        """The (L, C) features of one image, in the dtype they were stored in (fp16 by default).

        They stay in that dtype through the loader and the host-to-device copy (half the bytes);
        the training module casts them to the model's dtype on the device.
        """
        if self._features is None:
            self._open()
        return torch.from_numpy(np.array(self._features[self._row[image_id]]))

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers re-open the memory map themselves.
        return {"folder": self.folder, "_features": None, "_row": None, "_skipped": None, "grid": self.grid}


def _preallocate(path: Path, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Make the ``.npy`` file ``path`` of ``shape`` and ``dtype``, zeros (sparse: no disk written for them), unless
    another process did first: made under a name of its own and linked into place, so it appears whole and one
    process's file never replaces another's that is being written into."""
    made = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        np.lib.format.open_memmap(made, mode="w+", dtype=dtype, shape=shape).flush()
        with open(made, "rb+") as handle:
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(made, path)
    finally:
        made.unlink(missing_ok=True)


class FeatureCaptionDataset(Dataset):
    """Like ``CaptionDataset`` but yields cached ``features`` (L, C) instead of decoding the image."""

    def __init__(
        self,
        records: list[Record],
        vocab: Vocabulary,
        cache: FeatureCache,
        max_len: int = MAX_LEN,
        per_caption: bool = False,
    ) -> None:
        self.records = records
        self.vocab = vocab
        self.cache = cache
        self.max_len = max_len
        self.items = (
            [(i, k) for i, r in enumerate(records) for k in range(len(r.captions))]
            if per_caption
            else [(i, None) for i in range(len(records))]
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict | Skipped:
        i, k = self.items[index]
        record = self.records[i]
        if record.image_id not in self.cache:
            return Skipped(record.image_path, self.cache.skip_reason(record.image_path))
        captions = record.captions if k is None else (record.captions[k],)
        return {
            "features": self.cache.get(record.image_id),
            "captions": [torch.tensor(self.vocab.encode(c, self.max_len)) for c in captions],
            "image_id": record.image_id,
            "index": i,
        }
