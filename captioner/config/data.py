"""The ``data`` config group: the dataset source, batching and preprocessing."""

from __future__ import annotations

import codecs
import enum
from dataclasses import dataclass
from typing import Any

from captioner.config.decoding import MAX_LEN, MAX_VOCAB_SIZE, MAX_WORDS
from captioner.config.settings import Settings
from captioner.data.splits import SPLITS
from captioner.errors import ConfigError, check_choice, check_range

MIN_IMAGE_SIZE = 32  # pixels per side at least: every image the model reads, generates or stores
MAX_IMAGE_SIZE = 4096  # ... and at most (a bound on what a config or a bundle can make us allocate)
MAX_AUTO_WORKERS = 8  # DataConfig.num_workers=None uses at most this many loader workers
# A vocabulary fixed in advance (a model's, data.vocab_file) that reads more than this share of the training
# captions' words as <unk> is warned of when training starts, its most frequent missing words named.
UNKNOWN_WORDS_WARNING = 0.05


class ImageDecoding(enum.StrEnum):
    """Where training's and captioning's image files are decoded (``captioner.data.device_decoding``)."""

    auto = "auto"  # device when the model runs on a CUDA device, loader otherwise
    loader = "loader"  # every image decoded by Pillow in the DataLoader workers
    # the workers read each file's bytes and check its header; the model's device decodes a batch's JPEGs at once
    # (nvjpeg on CUDA; on a CPU, libjpeg-turbo in the main process) and resizes them; other images: Pillow
    device = "device"


class FeatureDtype(enum.StrEnum):
    """The dtype the feature cache stores grids in."""

    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


@dataclass
class DataConfig(Settings):
    """The ``data`` config group: the dataset source, batching and preprocessing (``CaptionDataModule``)."""

    source: Any = None  # the dataset: a ``_target_`` mapping of captioner.data.sources (train.py builds it)
    image_size: int = 224  # images are resized to image_size x image_size
    batch_size: int = 32  # training images (or captions with per_caption) per step and process
    eval_batch_size: int | None = 64  # validation/test images per step; None: batch_size
    # DataLoader worker processes; None: one per CPU this process may use, less one for the main process,
    # at most MAX_AUTO_WORKERS (``training.datamodule.loader_workers``)
    num_workers: int | None = None
    min_word_count: int = 5  # words seen fewer times in the training captions become <unk>
    max_vocab: int | None = 10000  # keep at most this many words (most frequent first); None: all
    max_len: int = MAX_LEN  # longer training captions are cut to this many words
    per_caption: bool = False  # one item per (image, caption); the CNN then runs once per caption
    # K: every training image takes exactly K captions per step (``captioner.data.dataset.collate``), so a batch's
    # shapes never depend on the data: an image with more has K drawn afresh each epoch, one with fewer has its
    # captions repeated up to K with weight 0 (every caption counts once in the loss). None: the most common
    # caption count of the training split (the larger on a tie; logged when training starts). 1 with per_caption.
    captions_per_image: int | None = None
    augment: bool = False  # mild colour jitter / crop; never flips (captions say left and right)
    # where images are decoded: loader (Pillow, in the loader workers), device (the workers read the files, the
    # model's device decodes each batch's JPEGs: nvjpeg on CUDA; other images by Pillow) or auto (device on a CUDA
    # device, loader otherwise); a feature cache is always filled from the loader's decoding
    decode: ImageDecoding = ImageDecoding.auto
    feature_cache: str | None = None  # a folder: cache the encoder's frozen stages' output there
    feature_dtype: FeatureDtype = FeatureDtype.float16  # the cache's dtype
    vocab_file: str | None = None  # load this vocabulary JSON instead of building one from the captions
    # Training captions padded to this many tokens (<start> and <end> included, so caption_tokens = max_len + 2
    # holds every caption) instead of the batch's longest: every step has the same shapes, what a captured CUDA
    # graph needs; the loss is unchanged (pad steps are masked). None: the batch's longest (fewer steps on a
    # CPU), or caption_tokens when model.graphs or model.compile is on.
    pad_to: int | None = None
    # Where the recipe that trains on this dataset is: the demo's recipe (``demo``) on any dataset but the
    # built-in shapes (``recipe: null``) stops at once, naming it.
    recipe: str | None = "experiment=coco_soft"

    def check(self) -> None:
        check_range("image_size", self.image_size, MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, kind=int)
        check_range("batch_size", self.batch_size, 1, kind=int)
        if self.eval_batch_size is not None:
            check_range("eval_batch_size", self.eval_batch_size, 1, kind=int)
        if self.num_workers is not None:
            check_range("num_workers", self.num_workers, 0, kind=int)
        check_range("min_word_count", self.min_word_count, 1, kind=int)
        if self.max_vocab is not None:
            check_range("max_vocab", self.max_vocab, 4, MAX_VOCAB_SIZE, kind=int)
        check_range("max_len", self.max_len, 1, MAX_WORDS, kind=int)
        if self.captions_per_image is not None:
            check_range("captions_per_image", self.captions_per_image, 1, kind=int)
        if self.pad_to is not None:
            check_range("pad_to", self.pad_to, self.caption_tokens, kind=int)

    @property
    def caption_tokens(self) -> int:
        """The tokens of the longest training caption: ``<start>``, ``max_len`` words, ``<end>``
        (``Vocabulary.encode``); the width of every batch when ``pad_to`` is on."""
        return self.max_len + 2


class SceneKind(enum.StrEnum):
    """Which scenes the built-in dataset holds."""

    simple = "simple"  # one to three shapes of three kinds in a 3x3 grid (captioner.data.scenes): the demo's
    cluttered = "cluttered"  # two to four shapes of six kinds placed freely, with clutter (captioner.data.cluttered)


@dataclass(frozen=True)
class ShapesSpec:
    """The built-in dataset's generator parameters (``data.source`` of ``conf/data/shapes.yaml`` and
    ``conf/data/scenes.yaml``, stored in its meta.json): its kind of scenes, size per split, image size and
    seed; the defaults are the demo's."""

    n_train: int = 3000  # training images
    n_val: int = 250  # validation images
    n_test: int = 250  # test images
    image_size: int = 96  # simple scenes: the square images' side in pixels
    seed: int = 0  # the same seed, the same files
    scenes: SceneKind = SceneKind.simple  # which scenes (the grid of the demo, or the harder cluttered ones)
    width: int = 160  # cluttered scenes: image width in pixels
    height: int = 120  # cluttered scenes: image height in pixels

    def __post_init__(self) -> None:
        check_choice("scenes", self.scenes, tuple(SceneKind))
        object.__setattr__(self, "scenes", SceneKind(self.scenes))  # a name given as a string becomes the member
        for split in SPLITS:
            check_range(f"n_{split}", getattr(self, f"n_{split}"), 1, kind=int)
        for side in ("image_size", "width", "height"):
            check_range(side, getattr(self, side), MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, kind=int)
        check_range("seed", self.seed, 0, kind=int)

    @property
    def size(self) -> tuple[int, int]:
        """The images' (width, height) in pixels."""
        if self.scenes is SceneKind.simple:
            return self.image_size, self.image_size
        return self.width, self.height

    def params(self) -> dict[str, Any]:
        """The parameters its kind of scenes uses, as meta.json stores them (a simple dataset's are the five
        it has always stored, so its meta.json is unchanged)."""
        common = {"n_train": self.n_train, "n_val": self.n_val, "n_test": self.n_test}
        if self.scenes is SceneKind.simple:
            return {**common, "image_size": self.image_size, "seed": self.seed}
        return {**common, "width": self.width, "height": self.height, "seed": self.seed, "scenes": str(self.scenes)}


@dataclass(frozen=True)
class CaptionsSpec:
    """How a user's captions file is read (``data.source`` of ``conf/data/captions.yaml``, besides the file
    itself): where its images are, the names of its columns, and how its images are split when it has no split
    column. The defaults read ``image,caption`` CSV files and JSON Lines of ``{"image", "caption"}``."""

    images: str | None = None  # the folder the file's image paths are relative to; None: the file's own folder
    image_column: str = "image"  # the column (CSV/TSV) or key (JSON Lines) of the image's path
    caption_column: str = "caption"  # the column or key of one caption
    captions_column: str = "captions"  # JSON Lines: the key of a list of captions (either key, or both, per line)
    split_column: str | None = "split"  # a column of train/val/test, used when the file has it; None: never
    # The file's text encoding, any Python codec's name (cp1252: a spreadsheet's plain 'CSV' on Windows); a file
    # that starts with a byte-order mark is read in the encoding it names (UTF-8, UTF-16, UTF-32) whatever this says
    encoding: str = "utf-8"
    # Without a split column the images (never their captions) are split by a seeded hash of their path:
    # a count of images (>= 1: 500) or a fraction of them (< 1: 0.05; at least one image), for val and test
    val: float = 0.1
    test: float = 0.1
    seed: int = 0  # the same seed and file, the same split, whatever the rows' order

    def __post_init__(self) -> None:
        for name in ("image_column", "caption_column", "captions_column"):
            if not getattr(self, name):
                raise ConfigError(f"{name}={getattr(self, name)!r} must name a column")
        try:
            codecs.lookup(self.encoding)
        except (LookupError, TypeError):
            raise ConfigError(
                f"encoding={self.encoding!r} is not a text encoding Python knows (utf-8, cp1252, ...)"
            ) from None
        for split in ("val", "test"):
            value = getattr(self, split)
            check_range(split, value, 0.0, kind=(int, float))
            if value >= 1 and value != int(value):
                raise ConfigError(f"{split}={value!r} must be a whole number of images (>= 1) or a fraction (< 1)")
            if value == 0:
                raise ConfigError(f"{split}={value!r} must be > 0: a count of images or a fraction of them")
        check_range("seed", self.seed, 0, kind=int)

    def held_out(self, split: str, images: int) -> int:
        """How many of ``images`` images go to ``split`` (val or test): its count, or its fraction rounded
        (at least one)."""
        value = getattr(self, split)
        return int(value) if value >= 1 else max(1, round(value * images))
