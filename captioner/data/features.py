"""Feature cache for the frozen stages of the encoder: computed once, stored in fp16, read memory-mapped.

With a frozen CNN every epoch would recompute the same (L, C) grid for every image; with its last
stages trained, the same input to them. The cache runs the frozen stages once per image
(``Captioner.encode``), writes ``features.npy`` (N, L, C) beside ``index.json`` (image ids, grid, dtype),
and later epochs train from it. A cache is keyed by everything that changes its content
(encoder config, image size, the images), so a stale cache is never read; it is written into a temporary
folder and renamed into place, so an interrupted build never leaves a half cache behind, and an existing
folder is never deleted or overwritten. Images that could not be read are listed in ``index.json`` with
the reason, and the dataset reports them as ``Skipped`` items, as the image dataset does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from captioner.config import MAX_LEN
from captioner.data.dataset import Skipped
from captioner.data.readers import Record
from captioner.data.vocab import Vocabulary
from captioner.errors import DataError
from captioner.fileio import atomic_write, read_json, write_json


def cache_key(encoder_config: dict, image_size: int, records: Iterable[Record], dtype: str) -> str:
    """A short hash of everything that determines the cached features."""
    payload = {
        "encoder": encoder_config,
        "image_size": image_size,
        "dtype": dtype,
        "images": [(r.image_id, r.image_path) for r in records],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


class FeatureCache:
    """A folder holding ``features.npy`` (N, L, C) and ``index.json`` {image_ids, grid, dtype, skipped}."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self._features: np.ndarray | None = None
        self._row: dict[int, int] | None = None
        self._skipped: dict[str, str] | None = None
        self.grid: tuple[int, int] | None = None

    def exists(self) -> bool:
        """True when a complete cache is in place."""
        return (self.folder / "index.json").is_file() and (self.folder / "features.npy").is_file()

    @torch.no_grad()
    def build(
        self,
        encode: Callable[[torch.Tensor], tuple[torch.Tensor, tuple[int, int]]],
        loader: DataLoader,
        device: torch.device | str,
        dtype: str = "float16",
    ) -> None:
        """Run ``encode`` over every image of ``loader`` once and store the features atomically.

        Images the loader could not read are recorded with their reason. Another process that finished
        the same cache first wins; a folder in the way that is not a complete cache is never deleted.
        """
        ids: list[int] = []
        chunks: list[np.ndarray] = []
        skipped: list[Skipped] = []
        grid: tuple[int, int] = (0, 0)
        for batch in loader:
            skipped.extend(batch["skipped"])
            if batch["images"].numel() == 0:
                continue
            features, grid = encode(batch["images"].to(device))  # (B, L, C)
            chunks.append(features.to("cpu", getattr(torch, dtype)).numpy())
            ids.extend(int(i) for i in batch["image_ids"])
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.folder.name}.", dir=self.folder.parent))
        try:
            with atomic_write(tmp / "features.npy") as handle:
                np.save(handle, np.concatenate(chunks) if chunks else np.zeros((0, 0, 0), dtype))
            write_json(
                tmp / "index.json",
                {
                    "image_ids": ids,
                    "grid": list(grid),
                    "dtype": dtype,
                    "skipped": [[s.path, s.reason] for s in skipped],
                },
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.replace(tmp, self.folder)  # fails when the folder exists and is not empty
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not self.exists():
                raise DataError(
                    f"{self.folder} is in the way of the feature cache and is not a complete one; "
                    "move it away or point data.feature_cache elsewhere"
                ) from None

    def _open(self) -> None:
        index = read_json(self.folder / "index.json", "feature cache index")
        self._row = {image_id: row for row, image_id in enumerate(index["image_ids"])}
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
