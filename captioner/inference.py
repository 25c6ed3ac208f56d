"""Batched captioning of image files: decode in worker processes, encode and decode a batch at a time."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from captioner.data.dataset import Skipped, build_transform
from captioner.data.images import ImageError, load_rgb
from captioner.data.vocab import Vocabulary


class ImageFiles(Dataset):
    """Decodes image files for batched captioning; an unreadable file becomes a ``Skipped``."""

    def __init__(self, paths: Sequence[str], image_size: int) -> None:
        self.paths = list(paths)
        self.transform = build_transform(image_size, train=False)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor] | Skipped:
        path = self.paths[index]
        try:
            return path, self.transform(load_rgb(path))
        except ImageError as exc:
            return Skipped(path, str(exc).removeprefix(f"{path}: "))


def _as_list(items: list) -> list:
    return items


@dataclass
class Captioned:
    """One captioned image."""

    path: str
    words: list[str]
    score: float
    alphas: torch.Tensor  # (T, L)
    grid: tuple[int, int]


def caption_files(model: torch.nn.Module, vocab: Vocabulary, image_size: int, paths: Sequence[str], device: torch.device,
                  batch_size: int, workers: int, progress: bool, **decode) -> Iterator[Captioned | Skipped]:
    """Caption ``paths`` in batches (decoding in worker processes), yielding results in input order."""
    loader = DataLoader(ImageFiles(paths, image_size), batch_size=batch_size, num_workers=workers,
                        collate_fn=_as_list)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(paths), unit="img", file=sys.stderr, desc="captioning")
    for items in loader:
        good = [x for x in items if not isinstance(x, Skipped)]
        results: dict[str, Captioned] = {}
        if good:
            images = torch.stack([tensor for _, tensor in good]).to(device)
            with torch.inference_mode():
                generation, grid = model.generate(images, start_id=vocab.start_id, end_id=vocab.end_id,
                                                  **decode)
            tokens, scores, alphas = generation.tokens.cpu(), generation.scores.cpu(), generation.alphas.cpu()
            for row, (path, _) in enumerate(good):
                words = vocab.decode(tokens[row].tolist())
                results[path] = Captioned(path, words, float(scores[row]), alphas[row, : len(words)].float(), grid)
        for item in items:
            yield item if isinstance(item, Skipped) else results[item[0]]
        if bar is not None:
            bar.update(len(items))
    if bar is not None:
        bar.close()
