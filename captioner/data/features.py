"""Feature cache for a frozen encoder: grid features computed once, stored in fp16, read memory-mapped.

With a frozen CNN every epoch would recompute the same (L, C) grid for every image. The cache runs the
encoder once per image, writes ``features.npy`` (N, L, C) beside ``index.json`` (image ids, grid, key),
and later epochs train the decoder from it. A cache is keyed by everything that changes its content
(encoder config, image size, the images), so a stale cache is never read; it is written into a temporary
folder and renamed into place, so an interrupted build never leaves a half cache behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from captioner.data.dataset import Skipped
from captioner.data.readers import Record
from captioner.data.vocab import Vocabulary
from captioner.fileio import read_json, write_json


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
    """A folder holding ``features.npy`` (N, L, C) and ``index.json`` {key, image_ids, grid}."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self._features: np.ndarray | None = None
        self._row: dict[int, int] | None = None
        self.grid: tuple[int, int] | None = None

    def exists(self) -> bool:
        """True when a complete cache is in place."""
        return (self.folder / "index.json").is_file() and (self.folder / "features.npy").is_file()

    @torch.no_grad()
    def build(self, encode: Callable[[torch.Tensor], tuple[torch.Tensor, tuple[int, int]]],
              loader: DataLoader, device: torch.device | str, dtype: str = "float16") -> None:
        """Run ``encode`` over every image of ``loader`` once and store the features atomically."""
        ids: list[int] = []
        chunks: list[np.ndarray] = []
        grid: tuple[int, int] = (0, 0)
        for batch in loader:
            if batch["images"].numel() == 0:
                continue
            features, grid = encode(batch["images"].to(device))  # (B, L, C)
            chunks.append(features.to("cpu", getattr(torch, dtype)).numpy())
            ids.extend(int(i) for i in batch["image_ids"])
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.folder.name}.", dir=self.folder.parent))
        try:
            np.save(tmp / "features.npy", np.concatenate(chunks) if chunks else np.zeros((0, 0, 0), dtype))
            write_json(tmp / "index.json", {"image_ids": ids, "grid": list(grid), "dtype": dtype})
            if self.folder.exists():
                shutil.rmtree(self.folder)
            os.replace(tmp, self.folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _open(self) -> None:
        index = read_json(self.folder / "index.json", "feature cache index")
        self._row = {image_id: row for row, image_id in enumerate(index["image_ids"])}
        self.grid = tuple(index["grid"])
        self._features = np.load(self.folder / "features.npy", mmap_mode="r")

    def __contains__(self, image_id: int) -> bool:
        if self._row is None:
            self._open()
        return image_id in self._row

    def get(self, image_id: int) -> torch.Tensor:
        """The (L, C) float32 features of one image."""
        if self._features is None:
            self._open()
        return torch.from_numpy(np.array(self._features[self._row[image_id]], dtype=np.float32))

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers re-open the memory map themselves.
        return {"folder": self.folder, "_features": None, "_row": None, "grid": self.grid}


class FeatureCaptionDataset(Dataset):
    """Like ``CaptionDataset`` but yields cached ``features`` (L, C) instead of decoding the image."""

    def __init__(self, records: list[Record], vocab: Vocabulary, cache: FeatureCache, max_len: int = 20,
                 per_caption: bool = False) -> None:
        self.records = records
        self.vocab = vocab
        self.cache = cache
        self.max_len = max_len
        self.items = ([(i, k) for i, r in enumerate(records) for k in range(len(r.captions))]
                      if per_caption else [(i, None) for i in range(len(records))])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict | Skipped:
        i, k = self.items[index]
        record = self.records[i]
        if record.image_id not in self.cache:
            return Skipped(record.image_path, "not in the feature cache (the image could not be read)")
        captions = record.captions if k is None else (record.captions[k],)
        return {
            "features": self.cache.get(record.image_id),
            "captions": [torch.tensor(self.vocab.encode(c, self.max_len)) for c in captions],
            "image_id": record.image_id,
            "index": i,
        }
