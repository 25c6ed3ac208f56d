"""Captioning with a trained model: ``load_model`` gives the Python API's ``LoadedModel``; batched captioning
of image files (decoded in worker processes) and of images given in memory (``LoadedModel.caption``), the
encoder and the decoder run once per batch. The files are read by ``captioner.bundle``."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.bundle import TrainedModel, load_trained
from captioner.config import (
    CAPTIONING_BATCH_SIZE,
    CAPTIONING_WORKERS,
    DecodingConfig,
    EnsembleMean,
    HardInference,
    ImageDecoding,
    captioning_settings,
)
from captioner.data.dataset import Skipped, build_transform
from captioner.data.device_decoding import DecodeTally, Encoded, Pillowed, decode_jpegs, on_device, read_for_device
from captioner.data.images import ImageError, load_rgb, to_rgb
from captioner.data.vocab import UNK_ID
from captioner.errors import ConfigError, check_range
from captioner.model.captioner import Captioner
from captioner.model.decoding import seeded_generator
from captioner.model.ensemble import EnsembleCaptioner
from captioner.model.steps import Generation

# a file, a PIL image, a tensor (3, H, W) or a numpy array (H, W, 3) of uint8 (as PIL and OpenCV give, in RGB)
ImageLike = str | os.PathLike | Image.Image | torch.Tensor | np.ndarray
# one image, a list, a batch tensor (B, 3, H, W) or a batch array (B, H, W, 3)
Images = ImageLike | Iterable[ImageLike] | torch.Tensor | np.ndarray
# what a model reads of one image: (3, S, S); an ensemble, one per member (3, S_m, S_m)
Pixels = torch.Tensor | tuple[torch.Tensor, ...]


class ImageFiles(Dataset):
    """Decodes image files for batched captioning; an unreadable file becomes a ``Skipped``. ``max_pixels``: the
    pixel limit of ``load_rgb`` (None: Pillow's). ``transform``: what the model reads of the RGB image (None: it
    resized to ``image_size`` and normalised, ``build_transform``'s; an ensemble's: ``LoadedEnsemble.transform``).
    ``encoded``: a JPEG the model's device decodes is left as its bytes (``device_decoding.read_for_device``)."""

    def __init__(
        self,
        paths: Sequence[str],
        image_size: int,
        max_pixels: int | None = None,
        transform: Callable[[Image.Image], Pixels] | None = None,
        encoded: bool = False,
    ) -> None:
        self.paths = list(paths)
        self.image_size = image_size
        self.max_pixels = max_pixels
        self.transform = transform or build_transform(image_size, train=False)
        self.encoded = encoded

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Pixels | Encoded | Pillowed | Skipped:
        """The image as a normalised tensor (3, S, S) (``transform``'s), or ``Skipped(path as given, reason)``;
        with ``encoded``, a JPEG's ``Encoded`` bytes, and any other image as ``Pillowed`` pixels."""
        path = self.paths[index]
        try:
            if not self.encoded:
                return self.transform(load_rgb(path, self.max_pixels, self.image_size))
            read = read_for_device(path, self.max_pixels, self.image_size)
        except ImageError as exc:
            return Skipped(path, exc.reason)
        return read if isinstance(read, Encoded) else Pillowed(self.transform(read.image), read.reason)


def _on_device(
    items: list[Pixels | Encoded | Pillowed | Skipped],
    loaded: LoadedModel,
    tally: DecodeTally,
) -> list[Pixels | Skipped]:
    """A batch of ``ImageFiles`` on the model's device: its JPEGs decoded there in one call and preprocessed there
    (``loaded.transform``), the images Pillow decoded moved there, each counted in ``tally``; a JPEG neither the
    device nor Pillow decodes is Skipped."""
    device, transform = next(loaded.model.parameters()).device, loaded.transform
    jpegs = [i for i, item in enumerate(items) if isinstance(item, Encoded)]
    done = list(items)
    for i, image in zip(jpegs, decode_jpegs([items[i] for i in jpegs], device, tally)):
        done[i] = Skipped(items[i].path, image.reason) if isinstance(image, ImageError) else transform(image)
    for i, item in enumerate(items):
        if isinstance(item, Pillowed):
            tally.add(item.reason)
            pixels = item.image
            done[i] = pixels.to(device) if isinstance(pixels, torch.Tensor) else tuple(p.to(device) for p in pixels)
    return done


def _keep_list(items: list) -> list:
    """DataLoader collate function that leaves the batch a list (good images and Skipped mixed)."""
    return items


@dataclass
class Hypothesis:
    """One of the n best captions of an image (``Captioned.n_best``)."""

    words: list[str]
    score: float  # as ``Captioned.score``: summed log-probability over the length penalty

    @property
    def caption(self) -> str:
        """The caption as one string."""
        return " ".join(self.words)


@dataclass
class Captioned:
    """One captioned image; or, with ``error`` set, an input of a list that could not be captioned: no words,
    ``caption`` None (never "", which is the caption of a model that ends at once), ``score`` NaN."""

    path: str | None  # the image file; None for an image given in memory
    words: list[str]
    score: float  # the decoder's score: summed log-probability (beam: with its length penalty)
    alphas: torch.Tensor  # (T, L): the attention used for each word, T = len(words)
    grid: tuple[int, int]  # (H, W) with H * W = L
    locations: list[int] | None = None  # hard attention decoded by argmax: the cell each word attended
    image: Image.Image | torch.Tensor | np.ndarray | None = None  # the image given in memory (files: see path)
    error: str | None = None  # why this input of a list could not be captioned (a file's path is ``path``)
    # with ``n_best`` N > 1 (beam and diverse beam search): the N best captions, best first (the first is this one;
    # fewer where the vocabulary and the constraints leave fewer with a finite score); None otherwise
    n_best: list[Hypothesis] | None = None

    @property
    def caption(self) -> str | None:
        """The caption as one string (its words joined by spaces: "" for a caption of no words); None for an
        input that could not be captioned (``error`` says why)."""
        return None if self.error is not None else " ".join(self.words)

    def __repr__(self) -> str:
        where = self.path if self.path is not None else f"<{type(self.image).__name__}>"
        if self.error is not None:
            return f"Captioned({where!r}, error={self.error!r})"
        return f"Captioned({where!r}, {self.caption!r}, score={self.score:.3f}, grid={self.grid})"


def _failed(item: object, reason: str) -> Captioned:
    """The result of an input of a list that could not be captioned."""
    path = os.fspath(item) if isinstance(item, (str, os.PathLike)) else None
    image = None if path is not None else item
    return Captioned(path, [], float("nan"), torch.empty(0, 0), (0, 0), image=image, error=reason)


@dataclass(frozen=True)
class LoadedModel(TrainedModel):
    """A trained captioner ready for inference (``model`` in eval mode, ``vocab``, ``config``, ``image_size``,
    and ``source``, the file it was loaded from)."""

    source: str | None = None

    def caption(
        self,
        images: Images,
        batch_size: int = CAPTIONING_BATCH_SIZE,
        raise_errors: bool = False,
        max_pixels: int | None = None,
        **settings: Any,
    ) -> Captioned | list[Captioned]:
        """Caption image files, PIL images, image tensors or numpy arrays; see :func:`caption_images`.

        One image gives one :class:`Captioned` (``.caption``, ``.score``, ``.alphas`` (T, H*W) on ``.grid``),
        a list (or a tuple, a generator: any iterable of them) or a batch a list of them, one per input. A single
        image that cannot be captioned raises (ImageError for a file, TypeError or ValueError for another object);
        an input of a list gets a result with ``.error`` (the reason) and ``.caption`` None instead, unless
        ``raise_errors``. ``settings`` are the
        command line's decoding options as ``DecodingConfig`` fields over the model's ``decoding`` (how its run
        decoded its final scores: method, beam_size, max_len, seed, ...), checked as the command line checks its
        flags (``captioning_settings``): TypeError for an unknown name (naming the nearest), ConfigError for one
        the method does not read or a bad value.
        ``max_pixels``: the most pixels a file may decode to (None: Pillow's limit), a guard against
        decompression bombs; raise it for a very large photo you trust (``data.images.load_rgb``). A bad one is a
        ConfigError for the call, whatever the images.

        Threads may call it on one model at once and get what the same calls one after another get: they take
        turns at each batch's decoding graph (``model.graphs.GraphCache.lock``), the rest runs side by side.
        """
        decoding = captioning_settings(settings, base=self.decoding)
        return caption_images(self, images, batch_size, raise_errors, decoding, max_pixels)

    @property
    def read_size(self) -> int:
        """The side a large JPEG is decoded to at least (``load_rgb``'s ``size``): the model's input side."""
        return self.image_size

    @property
    def transform(self) -> Callable[[Image.Image], Pixels]:
        """What the model reads of an RGB image: it resized to ``image_size`` and normalised, (3, S, S)."""
        return build_transform(self.image_size, train=False)

    @cached_property
    def grid(self) -> tuple[int, int]:
        """The (H, W) grid of attention locations at the model's image size."""
        device = next(self.model.parameters()).device
        with torch.no_grad():
            features = self.model.encoder.feature_map(
                torch.zeros(1, 3, self.image_size, self.image_size, device=device)
            )
        return tuple(features.shape[-2:])

    def __repr__(self) -> str:
        encoder, decoder = self.model.encoder, self.model.decoder
        stage = f"{encoder.stage}" if encoder.stage else "last stage"
        blocks = self.model.self_attention
        attending = f", {len(blocks.blocks)} self-attention blocks" if blocks is not None else ""
        scorer = type(decoder.attention).__name__
        height, width = self.grid
        return (
            f"LoadedModel: {encoder.name} ({stage}) -> a {height}x{width} grid of {encoder.out_channels} channels at "
            f"{self.image_size} px{attending}; {decoder.mode} attention ({scorer}); {len(self.vocab):,} words; "
            f"loaded from {self.source or 'memory'}"
        )


class MemberTransforms:
    """An ensemble's preprocessing: an RGB image resized and normalised for each member, (3, S_m, S_m) in turn
    (one transform per distinct size)."""

    def __init__(self, image_sizes: Sequence[int]) -> None:
        self.image_sizes = tuple(image_sizes)
        self.transforms = {size: build_transform(size, train=False) for size in self.image_sizes}

    def __call__(self, picture: Image.Image) -> tuple[torch.Tensor, ...]:
        done = {size: transform(picture) for size, transform in self.transforms.items()}
        return tuple(done[size] for size in self.image_sizes)


@dataclass(frozen=True)
class LoadedEnsemble(LoadedModel):
    """Several trained captioners decoding together (``load_model`` of a list): at every word the mean of their
    log-probabilities (``captioner.model.ensemble``), each model reading the image at its own input size.

    ``members`` are the models as loaded; ``model`` is their ``EnsembleCaptioner``; ``vocab``, ``config``,
    ``image_size`` and ``decoding`` are the first member's (the ensemble decodes with the first model's settings
    unless a call gives others); the attention maps lie on the first member's grid (the mean of the members'
    maps, each resampled onto that grid when theirs differs)."""

    members: tuple[LoadedModel, ...] = ()

    @property
    def read_size(self) -> int:
        """The largest of the members' input sides."""
        return max(member.image_size for member in self.members)

    @property
    def transform(self) -> Callable[[Image.Image], Pixels]:
        """Each member's input of an RGB image, in turn (``MemberTransforms``)."""
        return MemberTransforms([member.image_size for member in self.members])

    @cached_property
    def grid(self) -> tuple[int, int]:
        """The first member's grid, where the ensemble's attention maps lie."""
        return self.members[0].grid

    def __repr__(self) -> str:
        lines = "\n".join(f"  {number}. {member!r}" for number, member in enumerate(self.members, 1))
        return (
            f"LoadedEnsemble of {len(self.members)} models decoding with the mean of their "
            f"{'log-probabilities' if self.model.decoder.mean == EnsembleMean.log else 'probabilities'} "
            f"(the first's decoding settings; attention on its {self.grid[0]}x{self.grid[1]} grid):\n{lines}"
        )


def load_model(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    map_location: str | torch.device = "cpu",
    mean: EnsembleMean | str = EnsembleMean.log,
) -> LoadedModel:
    """Load a model to caption with: an inference bundle, a Lightning checkpoint written by training, or a
    training run's folder (its bundle); ``captioner.bundle.load_trained`` says what is read and refused.

    A list of them loads an ensemble (``LoadedEnsemble``, even of one model): the models must share one
    vocabulary (ConfigError otherwise); ``mean`` says how their word distributions are averaged (``EnsembleMean``:
    "log", the normalised mean of their log-probabilities, or "prob", of their probabilities); another ``mean`` with
    one model is a ConfigError, as ``--ensemble-mean`` with one ``--model`` is."""
    if not isinstance(path, (str, os.PathLike)):
        return load_ensemble(path, map_location, mean)
    if mean != EnsembleMean.log:
        raise ConfigError(f"mean={mean!r} goes with a list of models (an ensemble's): one model has nothing to average")
    trained = load_trained(path, map_location)
    fields = {field.name: getattr(trained, field.name) for field in dataclasses.fields(trained)}
    return LoadedModel(**fields, source=os.fspath(path))


def load_ensemble(
    paths: Sequence[str | os.PathLike],
    map_location: str | torch.device = "cpu",
    mean: EnsembleMean | str = EnsembleMean.log,
) -> LoadedEnsemble:
    """The models of ``paths`` (``load_model``'s files) as one ensemble averaging their word distributions as
    ``mean`` says; ConfigError for no path, an unknown ``mean`` or models whose vocabularies differ."""
    if not paths:
        raise ConfigError("an ensemble needs at least one model")
    if mean not in tuple(EnsembleMean):
        raise ConfigError(f"mean={mean!r}: an ensemble averages {' or '.join(map(repr, map(str, EnsembleMean)))}")
    members = tuple(load_model(path, map_location) for path in paths)
    first = members[0]
    for member in members[1:]:
        if member.vocab.fingerprint() != first.vocab.fingerprint():
            raise ConfigError(
                f"{member.source} and {first.source} have different vocabularies ({len(member.vocab):,} and "
                f"{len(first.vocab):,} words): an ensemble's models must share one vocabulary"
            )
    sizes = [member.image_size for member in members]
    model = EnsembleCaptioner([member.model for member in members], sizes, EnsembleMean(mean))
    return LoadedEnsemble(
        model.eval(),
        first.vocab,
        first.config,
        first.image_size,
        first.decoding,
        source=", ".join(str(member.source) for member in members),
        members=members,
    )


def _call_decoding(
    loaded: LoadedModel, decoding: DecodingConfig | None
) -> tuple[DecodingConfig, torch.Generator | None]:
    """How one call decodes (None: the model's own, ``loaded.decoding``), and sampling's generator for all its
    batches, seeded with the settings' ``seed`` (torch's state left alone; None without a seed)."""
    decoding = loaded.decoding if decoding is None else decoding
    return decoding, seeded_generator(decoding, next(loaded.model.parameters()).device)


def _check_max_pixels(max_pixels: int | None) -> None:
    """ConfigError for the call, before any image is read, unless ``max_pixels`` is None or a count >= 1: it
    limits files only, so an image given in memory would pass a bad value by and a file fail on it alone."""
    if max_pixels is not None:
        check_range("max_pixels", max_pixels, 1, kind=int)


def _stacked(items: Sequence[Pixels]) -> Pixels:
    """A batch of preprocessed images: (B, 3, S, S), or for an ensemble's one per member."""
    if isinstance(items[0], torch.Tensor):
        return torch.stack(items)
    return tuple(torch.stack(column) for column in zip(*items))


def _caption_batch(
    loaded: LoadedModel, pixels: Pixels, decoding: DecodingConfig, generator: torch.Generator | None
) -> list[Captioned]:
    """Caption preprocessed images (B, 3, S, S) (an ensemble: one batch per member) in one encoder and decoder
    call; ``path`` left None."""
    model, vocab = loaded.model, loaded.vocab
    device = next(model.parameters()).device
    inputs = pixels.to(device) if isinstance(pixels, torch.Tensor) else [batch.to(device) for batch in pixels]
    generation, grid = model.generate(inputs, decoding, generator, unk_id=UNK_ID)
    tokens, scores, alphas = generation.tokens.cpu(), generation.scores.cpu(), generation.alphas.cpu()
    results = []
    for row in range(tokens.size(0)):
        words = vocab.decode(tokens[row].tolist())
        maps = alphas[row, : len(words)].float()  # (T, L)
        result = Captioned(None, words, float(scores[row]), maps, grid, locations=attended_cells(model, maps))
        result.n_best = _n_best(generation, row, loaded)
        results.append(result)
    return results


def _n_best(generation: Generation, row: int, loaded: LoadedModel) -> list[Hypothesis] | None:
    """The n best captions of image ``row`` of ``generation`` with a finite score, best first; None when it has
    only its best (``DecodingConfig.n_best`` 1, or a method that finds one)."""
    if generation.n_best_tokens is None:
        return None
    tokens, scores = generation.n_best_tokens[row].tolist(), generation.n_best_scores[row].tolist()
    return [Hypothesis(loaded.vocab.decode(ids), score) for ids, score in zip(tokens, scores) if math.isfinite(score)]


def attended_cells(model: Captioner | EnsembleCaptioner, maps: torch.Tensor) -> list[int] | None:
    """The cell each word read, for hard attention decoded by argmax (one cell per word: its one-hot map's
    argmax), from the attention ``maps`` (T, L) of one caption; None for every other attention. An ensemble of
    such models: the cell of the mean map's largest weight (the cell most members read)."""
    argmax = model.decoder.hard_read == HardInference.argmax
    return maps.argmax(dim=1).tolist() if argmax else None


def caption_files(
    loaded: LoadedModel,
    paths: Sequence[str],
    batch_size: int = CAPTIONING_BATCH_SIZE,
    workers: int = CAPTIONING_WORKERS,
    progress: bool = False,
    decoding: DecodingConfig | None = None,
    max_pixels: int | None = None,
    decode: ImageDecoding = ImageDecoding.auto,
    tally: DecodeTally | None = None,
) -> Iterator[Captioned | Skipped]:
    """Caption ``paths`` a batch at a time, yielding one result per path in input order.

    Images are decoded in ``workers`` processes and resized to the model's ``image_size``; each batch
    runs the encoder and the decoder once on the model's device. An unreadable file yields
    ``Skipped(path, reason)``. ``decoding``: how (None: the model's, ``loaded.decoding``).
    ``progress`` shows a bar on stderr. ``max_pixels``: the pixel limit of ``load_rgb`` (None: Pillow's; a bad
    one: ConfigError before the first result). ``decode``: where the images are decoded (``ImageDecoding``: on a
    CUDA device by default the workers only read the files and the device decodes each batch's JPEGs), counted
    in ``tally`` when given.
    """
    _check_max_pixels(max_pixels)
    batches = math.ceil(len(paths) / batch_size)
    encoded = on_device(ImageDecoding(decode), next(loaded.model.parameters()).device)
    loader = DataLoader(
        ImageFiles(paths, loaded.read_size, max_pixels, loaded.transform, encoded),
        batch_size=batch_size,
        num_workers=min(workers, batches),
        collate_fn=_keep_list,
    )
    decoding, generator = _call_decoding(loaded, decoding)
    tally = DecodeTally() if tally is None else tally
    with tqdm(total=len(paths), unit="img", file=sys.stderr, desc="captioning", disable=not progress) as bar:
        for number, items in enumerate(loader):
            if encoded:
                items = _on_device(items, loaded, tally)
            first = number * batch_size  # index in ``paths`` of the batch's first item
            good = [i for i, item in enumerate(items) if not isinstance(item, Skipped)]
            captioned: dict[int, Captioned] = {}
            if good:
                pixels = _stacked([items[i] for i in good])  # (B, 3, S, S)
                for i, result in zip(good, _caption_batch(loaded, pixels, decoding, generator)):
                    result.path = paths[first + i]
                    captioned[i] = result
            for i, item in enumerate(items):
                yield captioned.get(i, item)
            bar.update(len(items))


def _one_image(images: Images) -> bool:
    """False for images given together: a list, a tuple or another iterable of them (a generator, ``Path.glob``'s),
    or a batch (a tensor (B, C, H, W), an array (B, H, W, C)); True for one image (a path, a PIL image, a tensor or
    an array of another shape) and anything that is no iterable."""
    if isinstance(images, torch.Tensor):
        return images.dim() != 4
    if isinstance(images, np.ndarray):
        return images.ndim != 4
    return isinstance(images, (str, bytes, os.PathLike, Image.Image)) or not isinstance(images, Iterable)


def to_picture(item: ImageLike, max_pixels: int | None = None, size: int | None = None) -> Image.Image:
    """One image of any accepted kind as an RGB PIL image; ImageError, TypeError or ValueError saying why not.
    A file is read by ``load_rgb`` with ``max_pixels`` and ``size``."""
    if isinstance(item, (str, os.PathLike)):
        return load_rgb(item, max_pixels, size)
    if isinstance(item, np.ndarray):
        if item.dtype != np.uint8 or item.ndim not in (2, 3) or (item.ndim == 3 and item.shape[2] not in (1, 3, 4)):
            raise ValueError(
                f"a numpy image must be uint8 of shape (H, W, 3), (H, W, 4) or (H, W), got {item.dtype} {item.shape}"
            )
        return to_rgb(Image.fromarray(item[..., 0] if item.ndim == 3 and item.shape[2] == 1 else item))
    if not isinstance(item, (Image.Image, torch.Tensor)):
        raise TypeError(
            f"an image is a file path, a PIL image, a tensor or a numpy array, not {type(item).__name__} ({item!r:.40})"
        )
    return to_rgb(item)


def caption_images(
    loaded: LoadedModel,
    images: Images,
    batch_size: int = CAPTIONING_BATCH_SIZE,
    raise_errors: bool = False,
    decoding: DecodingConfig | None = None,
    max_pixels: int | None = None,
) -> Captioned | list[Captioned]:
    """Caption image files, PIL images, image tensors or numpy arrays, ``batch_size`` at a time, on the model's
    device.

    ``images`` is one image or a list of them (mixed kinds allowed), or a batch: a tensor (B, 3, H, W) or an
    array (B, H, W, 3). A tensor is a torchvision image, not normalised: uint8 in [0, 255] or float in [0, 1];
    an array is uint8 (H, W, 3) as PIL, imageio or OpenCV (after its BGR-to-RGB conversion) give. Every image
    is brought to RGB (``data.images``) and preprocessed as in training (``data.dataset.build_transform``).
    Returns one Captioned per image (a single one for a single image): the caption, its score, the attention
    maps ``alphas`` (T, H*W) on ``grid``; an image given in memory is kept in ``image`` for ``show_attention``.
    ``decoding``: how (None: the model's, ``loaded.decoding``). A single image that
    cannot be captioned raises ImageError (a file), TypeError or ValueError (another kind of object); in a list
    it gets a result with ``error`` set and ``caption`` None, or raises those with ``raise_errors``.
    ``max_pixels``: the pixel limit of a file (``load_rgb``; None: Pillow's); a bad one is a ConfigError for the
    call, before any image.
    """
    check_range("batch_size", batch_size, 1, kind=int)
    _check_max_pixels(max_pixels)
    single = _one_image(images)
    items = [images] if single else list(images)
    transform = loaded.transform
    decoding, generator = _call_decoding(loaded, decoding)
    results: list[Captioned] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        pixels, good = [], []
        failed: dict[int, Captioned] = {}
        for index, item in enumerate(chunk):
            try:
                pixels.append(transform(to_picture(item, max_pixels, loaded.read_size)))
                good.append(index)
            except (ImageError, TypeError, ValueError) as exc:
                if single or raise_errors:
                    raise
                failed[index] = _failed(item, exc.reason if isinstance(exc, ImageError) else str(exc))
        captioned = dict(zip(good, _caption_batch(loaded, _stacked(pixels), decoding, generator))) if pixels else {}
        for index, item in enumerate(chunk):
            result = failed.get(index) or captioned[index]
            if result.error is None and isinstance(item, (str, os.PathLike)):
                result.path = os.fspath(item)
            elif result.error is None:
                result.image = item
            results.append(result)
    return results[0] if single else results
