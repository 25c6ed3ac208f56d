"""Batched captioning of image files: decode in worker processes, encode and decode a batch at a time."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.dataset import Skipped, build_transform
from captioner.data.images import ImageError, load_rgb
from captioner.model.captioner import LoadedModel


class ImageFiles(Dataset):
    """Decodes image files for batched captioning; an unreadable file becomes a ``Skipped``."""

    def __init__(self, paths: Sequence[str], image_size: int) -> None:
        self.paths = list(paths)
        self.transform = build_transform(image_size, train=False)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor | Skipped:
        """The image as a normalised tensor (3, S, S), or ``Skipped(path as given, reason)``."""
        path = self.paths[index]
        try:
            return self.transform(load_rgb(path))
        except ImageError as exc:
            return Skipped(path, exc.reason)


def _keep_list(items: list) -> list:
    """DataLoader collate function that leaves the batch a list (good images and Skipped mixed)."""
    return items


@dataclass
class Captioned:
    """One captioned image."""

    path: str
    words: list[str]
    score: float  # the decoder's score: summed log-probability (beam: with its length penalty)
    alphas: torch.Tensor  # (T, L): the attention used for each word, T = len(words)
    grid: tuple[int, int]  # (H, W) with H * W = L


def caption_files(loaded: LoadedModel, paths: Sequence[str], batch_size: int = 32, workers: int = 0,
                  progress: bool = False, **decode) -> Iterator[Captioned | Skipped]:
    """Caption ``paths`` a batch at a time, yielding one result per path in input order.

    Images are decoded in ``workers`` processes and resized to the model's ``image_size``; each batch
    runs the encoder and the decoder once on the model's device. An unreadable file yields
    ``Skipped(path, reason)``. ``decode`` holds ``Captioner.generate`` options (method, beam_size,
    max_len, temperature, length_penalty, min_len, no_repeat_ngram_size). ``progress`` shows a bar on stderr.
    """
    model, vocab = loaded.model, loaded.vocab
    device = next(model.parameters()).device
    batches = math.ceil(len(paths) / batch_size)
    loader = DataLoader(ImageFiles(paths, loaded.image_size), batch_size=batch_size,
                        num_workers=min(workers, batches), collate_fn=_keep_list)
    with tqdm(total=len(paths), unit="img", file=sys.stderr, desc="captioning", disable=not progress) as bar:
        for number, items in enumerate(loader):
            first = number * batch_size  # index in ``paths`` of the batch's first item
            good = [i for i, item in enumerate(items) if not isinstance(item, Skipped)]
            captioned: dict[int, Captioned] = {}
            if good:
                images = torch.stack([items[i] for i in good]).to(device)  # (B, 3, S, S)
                generation, grid = model.generate(images, start_id=vocab.start_id, end_id=vocab.end_id,
                                                unk_id=vocab.unk_id, **decode)
                tokens, scores, alphas = generation.tokens.cpu(), generation.scores.cpu(), generation.alphas.cpu()
                for row, i in enumerate(good):
                    words = vocab.decode(tokens[row].tolist())
                    captioned[i] = Captioned(paths[first + i], words, float(scores[row]),
                                             alphas[row, : len(words)].float(), grid)
            for i, item in enumerate(items):
                yield captioned.get(i, item)
            bar.update(len(items))
