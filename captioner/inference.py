"""Captioning with a trained model: ``load_model`` gives the Python API's ``LoadedModel``; batched captioning
of image files (decoded in worker processes) and of images given in memory (``LoadedModel.caption``), the
encoder and the decoder run once per batch. The files are read by ``captioner.bundle``."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.bundle import TrainedModel, load_trained
from captioner.config import CAPTIONING_BATCH_SIZE, DecodingConfig
from captioner.data.dataset import Skipped, build_transform
from captioner.data.images import ImageError, load_rgb, to_rgb
from captioner.errors import check_range

ImageLike = str | os.PathLike | Image.Image | torch.Tensor  # a file, a PIL image or a tensor (3, H, W)
Images = ImageLike | Sequence[ImageLike] | torch.Tensor  # one image, a list, or a batch tensor (B, 3, H, W)


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

    path: str | None  # the image file; None for an image given in memory
    words: list[str]
    score: float  # the decoder's score: summed log-probability (beam: with its length penalty)
    alphas: torch.Tensor  # (T, L): the attention used for each word, T = len(words)
    grid: tuple[int, int]  # (H, W) with H * W = L
    locations: list[int] | None = None  # hard attention decoded by argmax: the cell each word attended
    image: Image.Image | torch.Tensor | None = None  # the image given in memory (files are read from path)

    @property
    def caption(self) -> str:
        """The caption as one string."""
        return " ".join(self.words)


class LoadedModel(TrainedModel):
    """A trained captioner ready for inference (``model`` in eval mode, ``vocab``, ``config``, ``image_size``)."""

    def caption(
        self, images: Images, batch_size: int = CAPTIONING_BATCH_SIZE, **settings: Any
    ) -> Captioned | list[Captioned]:
        """Caption image files, PIL images or image tensors; see :func:`caption_images`.

        One image gives one :class:`Captioned` (``.caption``, ``.score``, ``.alphas`` (T, H*W) on ``.grid``),
        a list or a batch tensor (B, 3, H, W) a list of them. ``settings`` are ``DecodingConfig`` fields over
        captioning's defaults (method, beam_size, max_len, ...): TypeError for an unknown one, ConfigError for
        a bad value.
        """
        return caption_images(self, images, batch_size, DecodingConfig.captioning(**settings))


def load_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> LoadedModel:
    """Load a model to caption with: an inference bundle, a Lightning checkpoint written by training, or a
    training run's folder (its bundle); ``captioner.bundle.load_trained`` says what is read and refused."""
    trained = load_trained(path, map_location)
    return LoadedModel(trained.model, trained.vocab, trained.config, trained.image_size)


def _caption_batch(loaded: LoadedModel, pixels: torch.Tensor, decoding: DecodingConfig | None) -> list[Captioned]:
    """Caption preprocessed images (B, 3, S, S) in one encoder and decoder call; ``path`` left None."""
    model, vocab = loaded.model, loaded.vocab
    device = next(model.parameters()).device
    generation, grid = model.generate(pixels.to(device), decoding, unk_id=vocab.unk_id)
    tokens, scores, alphas = generation.tokens.cpu(), generation.scores.cpu(), generation.alphas.cpu()
    # hard attention decoded by argmax attends to one cell per word: its one-hot map's argmax
    argmax = model.decoder.mode == "hard" and model.decoder.hard_inference == "argmax"
    results = []
    for row in range(tokens.size(0)):
        words = vocab.decode(tokens[row].tolist())
        maps = alphas[row, : len(words)].float()  # (T, L)
        results.append(
            Captioned(
                None, words, float(scores[row]), maps, grid, locations=maps.argmax(dim=1).tolist() if argmax else None
            )
        )
    return results


def caption_files(
    loaded: LoadedModel,
    paths: Sequence[str],
    batch_size: int = CAPTIONING_BATCH_SIZE,
    workers: int = 0,
    progress: bool = False,
    decoding: DecodingConfig | None = None,
) -> Iterator[Captioned | Skipped]:
    """Caption ``paths`` a batch at a time, yielding one result per path in input order.

    Images are decoded in ``workers`` processes and resized to the model's ``image_size``; each batch
    runs the encoder and the decoder once on the model's device. An unreadable file yields
    ``Skipped(path, reason)``. ``decoding``: how (None: captioning's ``DecodingConfig.captioning()``).
    ``progress`` shows a bar on stderr.
    """
    batches = math.ceil(len(paths) / batch_size)
    loader = DataLoader(
        ImageFiles(paths, loaded.image_size),
        batch_size=batch_size,
        num_workers=min(workers, batches),
        collate_fn=_keep_list,
    )
    with tqdm(total=len(paths), unit="img", file=sys.stderr, desc="captioning", disable=not progress) as bar:
        for number, items in enumerate(loader):
            first = number * batch_size  # index in ``paths`` of the batch's first item
            good = [i for i, item in enumerate(items) if not isinstance(item, Skipped)]
            captioned: dict[int, Captioned] = {}
            if good:
                pixels = torch.stack([items[i] for i in good])  # (B, 3, S, S)
                for i, result in zip(good, _caption_batch(loaded, pixels, decoding)):
                    result.path = paths[first + i]
                    captioned[i] = result
            for i, item in enumerate(items):
                yield captioned.get(i, item)
            bar.update(len(items))


def _one_image(images: Images) -> bool:
    """False for a list or tuple of images or a batch tensor (B, C, H, W), True for anything else."""
    if isinstance(images, torch.Tensor):
        return images.dim() != 4
    return not isinstance(images, (list, tuple))


def caption_images(
    loaded: LoadedModel,
    images: Images,
    batch_size: int = CAPTIONING_BATCH_SIZE,
    decoding: DecodingConfig | None = None,
) -> Captioned | list[Captioned]:
    """Caption image files, PIL images or image tensors, ``batch_size`` at a time, on the model's device.

    ``images`` is one image or a list of them (mixed kinds allowed), or a batch tensor (B, 3, H, W). A
    tensor is a torchvision image, not normalised: uint8 in [0, 255] or float in [0, 1]. Every image is
    brought to RGB (``data.images``) and preprocessed as in training (``data.dataset.build_transform``).
    Returns one Captioned per image (a single one for a single image): the caption, its score, the
    attention maps ``alphas`` (T, H*W) on ``grid``; an image given in memory is kept in ``image`` for
    ``show_attention``. ``decoding``: how (None: captioning's ``DecodingConfig.captioning()``).
    Raises ImageError for a file that cannot be read, TypeError or ValueError for another kind of object.
    """
    check_range("batch_size", batch_size, 1, kind=int)
    single = _one_image(images)
    items = [images] if single else list(images)
    transform = build_transform(loaded.image_size, train=False)
    results: list[Captioned] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        pictures = [load_rgb(item) if isinstance(item, (str, os.PathLike)) else to_rgb(item) for item in chunk]
        pixels = torch.stack([transform(picture) for picture in pictures])  # (B, 3, S, S)
        for item, result in zip(chunk, _caption_batch(loaded, pixels, decoding)):
            if isinstance(item, (str, os.PathLike)):
                result.path = os.fspath(item)
            else:
                result.image = item
            results.append(result)
    return results[0] if single else results
