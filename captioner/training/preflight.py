"""Preflight: every file and device a training run needs, checked before its folder is made.

``problems(cfg)`` takes the resolved config (plain data) and returns every problem at once, one line each with
its remedy and the section of ``docs/datasets.md`` that explains it: the dataset's split or caption files and
image folders, how many of each split's images are there (``val: 0 of 5,000 images found under
data/coco/val2014``), whether a sample of each split decodes, the vocabulary and logger packages the config names,
the checkpoint or bundle it starts from (that it is one, of the kind ``ckpt_path`` or ``init_from`` takes), the
encoder's weights (its file where ``model.encoder.download`` is false), whether the encoder's feature map holds the
attention grid asked for and the accelerator the trainer asks for; a check that fails in a way it does not expect
(a folder this user cannot list, a null where a path goes) is a problem too, naming the error, so the run never
starts on a traceback turned into a warning by Hydra. ``ValidateConfig``
(``training/validate.py``) runs it once the config's values are valid; ``train.py`` prints the lines and exits
with status 2 before any run folder exists. When nothing stops the run, ``check`` downloads the encoder's weights
file if it is missing and ``model.encoder.download`` is on, in the process that starts the run, before Lightning
starts the other processes of a DDP run (processes started together with it, torchrun's or SLURM's, take turns
with it on their machine: ``captioner.model.pretrained.download``); a failed download is the one problem then.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioner.data.readers import SPLITS
from captioner.errors import CaptionerError, ConfigError, DataProblems, first_line

GUIDE = "docs/datasets.md"
SAMPLES = 3  # images of each split decoded: the first, the middle and the last found; refused when none decodes
# How to fix a split without images: the test split is optional, the validation split is not.
EMPTY_SPLIT = {
    "train": "give it training images, or only evaluate a checkpoint: train=false ckpt_path=<run folder>",
    "val": "give it validation images: every run validates on them (checkpoint selection, early stopping)",
    "test": "give it test images, or train without a test split: test=false",
}
# The optional package each logger needs, and the extra of pyproject.toml that installs it.
LOGGER_PACKAGES: dict[str, str] = {"WandbLogger": "wandb", "MLFlowLogger": "mlflow"}


class Section(enum.StrEnum):
    """The sections of docs/datasets.md that a problem links to, by their anchors."""

    images = "images"
    split_files = "split-files"
    own_images = "your-own-images"
    encoder_weights = "encoder-weights"
    gpu = "gpu"
    train = "train"
    shards = "webdataset-shards-datawebdataset"


@dataclass(frozen=True)
class Problem:
    """One thing a run needs that is missing or wrong: what, how to fix it, and where the guide says more."""

    what: str
    remedy: str
    section: Section  # given by its anchor or as the member; ValueError for any other

    def __post_init__(self) -> None:
        object.__setattr__(self, "section", Section(self.section))

    def __str__(self) -> str:
        return f"{self.what}; {self.remedy} ({GUIDE}#{self.section})"


class PreflightError(ConfigError):
    """Every problem preflight found: one line each."""

    def __init__(self, found: list[Problem]) -> None:
        super().__init__("\n".join(str(problem) for problem in found))
        self.problems = found


def _build_source(source: dict[str, Any]) -> Any:
    """The dataset source the config describes (its ``_target_`` called with the other keys)."""
    module, _, name = source["_target_"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**{k: v for k, v in source.items() if k != "_target_"})


def _split_problems(source: Any, split: str) -> Iterator[Problem]:
    """The split's records can be read, some of its images are there and one of a sample of them decodes."""
    from captioner.data.images import images_present, load_rgb, none_found

    try:
        records = source.records(split)
    except DataProblems as exc:  # every problem of a captions file, each on its line, as many as its message lists
        shown = exc.problems[: DataProblems.MAX_LISTED]
        yield from (Problem(line, exc.remedy, Section.own_images) for line in shown)
        if len(exc.problems) > len(shown):
            more = f"... and {len(exc.problems) - len(shown):,} more problems of the same file, not listed"
            yield Problem(more, exc.remedy, Section.own_images)
        return
    except CaptionerError as exc:  # the file's own problem, which each split read from it meets: no split named
        remedy = "give the dataset's own annotation files, or write yours in their format"
        yield Problem(first_line(exc), remedy, "split-files")
        return
    if not records:
        yield Problem(f"{split}: the dataset lists no image of this split", EMPTY_SPLIT[split], "split-files")
        return
    paths = [record.image_path for record in records]
    found = images_present(paths)
    if not found:
        remedy = "unzip the dataset's images there, or point data.source at the folder that holds them"
        yield Problem(none_found(split, paths), remedy, "images")
        return
    failures = []
    for index in sorted({0, len(found) // 2, len(found) - 1})[:SAMPLES]:
        try:
            load_rgb(found[index])
            return  # one decodes: a few unreadable images are skipped, counted and reported by the datasets
        except CaptionerError as exc:
            failures.append(exc)
    noun = "the sample image" if len(failures) == 1 else f"none of the {len(failures)} sample images"
    yield Problem(f"{split}: {noun} decodes: {failures[0]}", "download it again", "images")


def _data_problems(cfg: dict[str, Any]) -> list[Problem]:
    """The dataset's files and folders (the source's own ``paths``); when they are all there, each split the run
    reads."""
    try:
        built = _build_source(cfg["data"]["source"])
    except (CaptionerError, TypeError) as exc:
        return [Problem(first_line(exc), "see the dataset's config in conf/data", Section.split_files)]
    from captioner.data.sources import Holds, ShapesSource  # imported with the source, not before a config error

    sections = {  # COCO's annotation files come with its images: the guide's section on images says where from
        Holds.annotations: Section.images,
        Holds.split_file: Section.split_files,
        Holds.images: Section.images,
        Holds.captions: Section.own_images,
    }
    found = [
        Problem(problem, path.fix(), sections[path.holds]) for path in built.paths() if (problem := path.problem())
    ]
    if found:
        return found
    streams = getattr(built, "streams", False)  # data=webdataset: the shards stream, val and test come from held_out
    if streams and (few := _readers_problem(cfg, built.train)) is not None:
        return [few]
    built = built.held_out if streams else built
    if isinstance(built, ShapesSource):
        return []  # generated on first use
    needed = [
        split for split in SPLITS if split == "val" or (cfg.get(split, True) and not (streams and split == "train"))
    ]
    # a file's own problems come with every split read from it: listed once
    return list(dict.fromkeys(problem for split in needed for problem in _split_problems(built, split)))


def _readers_problem(cfg: dict[str, Any], patterns: str) -> Problem | None:
    """data=webdataset: fewer shards than readers, the trainer's ranks (its devices, when a count or a list, x its
    nodes; else at least 1) x the loader workers; the run checks it again with Lightning's world size."""
    from captioner.data.shards import READERS_REMEDY, expand, too_few_shards
    from captioner.training.datamodule import loader_workers

    devices = cfg["trainer"].get("devices")
    count = len(devices) if isinstance(devices, (list, tuple)) else devices if isinstance(devices, int) else 1
    nodes = cfg["trainer"].get("num_nodes")
    ranks = max(1, count) * (nodes if isinstance(nodes, int) and nodes > 0 else 1)
    workers = max(1, loader_workers(cfg["data"].get("num_workers")))
    problem = too_few_shards(len(expand(patterns)), ranks, workers)
    return None if problem is None else Problem(problem, READERS_REMEDY, Section.shards)


def _file_problems(cfg: dict[str, Any]) -> list[Problem]:
    """The vocabulary, checkpoint and run the config names, and the loggers' packages."""
    found = []
    vocab_file = cfg["data"].get("vocab_file")
    if vocab_file and not Path(vocab_file).is_file():
        found.append(
            Problem(
                f"data.vocab_file={vocab_file!r}: file not found",
                "give a vocabulary JSON file written by Vocabulary.save, or null to build one from the captions",
                "train",
            )
        )
    from captioner.training.start import TAKES

    missing = [key for key in TAKES if cfg.get(key) is not None and not Path(cfg[key]).exists()]
    found += [Problem(f"{key}={cfg[key]!r} does not exist", f"give {TAKES[key]}", "train") for key in missing]
    if not missing:
        found += _start_problems(cfg)
    for name, node in (cfg.get("logger") or {}).items():
        package = LOGGER_PACKAGES.get(node["_target_"].rsplit(".", 1)[-1]) if node else None
        if package and importlib.util.find_spec(package) is None:
            found.append(
                Problem(
                    f"logger.{name} needs the {package} package, which is not installed",
                    f'pip install -e ".[{package}]"',
                    "train",
                )
            )
    return found


def _start_problems(cfg: dict[str, Any]) -> list[Problem]:
    """The run can start from the files ``ckpt_path`` and ``init_from`` name, as its objective needs
    (``start.plan_start``: each file's top level read, never its weights)."""
    from captioner.training.start import StartError, plan_start

    model = cfg["model"]
    try:
        plan_start(cfg.get("ckpt_path"), cfg.get("init_from"), model["objective"], model["scst"]["after_epochs"])
    except StartError as exc:
        return [Problem(exc.what, exc.remedy, Section.train)]
    return []


def _weights_problem(cfg: dict[str, Any], why: str) -> Problem:
    """The encoder's weights file is not on disk, ``why`` in words: the problem, with where the file goes."""
    from captioner.model.pretrained import not_on_disk, resolve_weights

    encoder = cfg["model"]["encoder"]
    weights = resolve_weights(encoder["name"], encoder["weights"])
    what, remedy = not_on_disk(encoder["name"], encoder["weights"], weights, why)
    return Problem(f"model.{what}", remedy, "encoder-weights")


def _from_checkpoint(cfg: dict[str, Any]) -> bool:
    """Whether the run starts from a checkpoint or bundle (``ckpt_path``, ``init_from``): its model is the
    checkpoint's, whose weights replace all of the encoder's ImageNet weights (their file is neither read nor
    downloaded)."""
    return cfg.get("ckpt_path") is not None or cfg.get("init_from") is not None


def _encoder_problems(cfg: dict[str, Any]) -> list[Problem]:
    """The encoder's weights name, and its file where it is not downloaded (``model.encoder.download=false``) and
    the run does not start from a checkpoint's weights."""
    from captioner.model.pretrained import resolve_weights, weight_file

    encoder = cfg["model"]["encoder"]
    try:
        weights = resolve_weights(encoder["name"], encoder["weights"])
    except (CaptionerError, ValueError) as exc:
        return [Problem(f"model.{first_line(exc)}", "see torchvision's list of weights", "encoder-weights")]
    if weights is None or encoder["download"] or _from_checkpoint(cfg) or os.path.isfile(weight_file(weights)):
        return []
    return [_weights_problem(cfg, " (model.encoder.download=false)")]


def _download_weights(cfg: dict[str, Any]) -> list[Problem]:
    """Download the encoder's weights file where ``model.encoder.download`` is on, it is missing and the run does
    not start from a checkpoint (``pretrained.download``, its progress on stdout); the problem when the download
    fails."""
    from captioner.model.pretrained import download, resolve_weights

    encoder = cfg["model"]["encoder"]
    weights = resolve_weights(encoder["name"], encoder["weights"])
    if weights is None or not encoder["download"] or _from_checkpoint(cfg):
        return []
    try:
        download(weights)
    except CaptionerError as exc:
        return [_weights_problem(cfg, f" and the download failed: {exc}")]
    return []


def _grid_problems(cfg: dict[str, Any]) -> list[Problem]:
    """``model.encoder.grid`` against the feature map the encoder makes of ``data.image_size`` images (the model of
    a checkpoint, which ``ckpt_path`` and ``init_from`` run, is the checkpoint's)."""
    encoder, size = cfg["model"]["encoder"], cfg["data"]["image_size"]
    if encoder.get("grid") is None or _from_checkpoint(cfg):
        return []
    try:
        height, width = _feature_map(encoder["name"], encoder.get("stage"), size)
    except CaptionerError as exc:
        return [Problem(f"data.{first_line(exc)}", "read larger images", "train")]
    grid = encoder["grid"]
    if grid <= min(height, width):
        return []
    return [
        Problem(
            f"model.encoder.grid={grid} is larger than the {height}x{width} feature map of {encoder['name']} "
            f"({encoder.get('stage') or 'the last stage'} of data.image_size={size} px images)",
            f"the grid only shrinks: set model.encoder.grid to at most {min(height, width)}, or read larger images",
            "train",
        )
    ]


@functools.cache
def _feature_map(name: str, stage: str | None, image_size: int) -> tuple[int, int]:
    """The (H, W) feature map of encoder ``name`` cut at ``stage`` for ``image_size`` images: built on the meta
    device, no weights allocated or read."""
    import torch

    from captioner.config import EncoderConfig
    from captioner.model.encoder import Encoder

    with torch.device("meta"):
        return Encoder(EncoderConfig(name=name, stage=stage)).grid_size(image_size)


def _accelerator_problems(trainer: dict[str, Any]) -> list[Problem]:
    """The GPUs the trainer asks for, and bf16 precision, which needs an Ampere or newer GPU."""
    accelerator = trainer.get("accelerator", "auto")
    if accelerator not in ("gpu", "cuda"):
        return []
    import torch

    if not torch.cuda.is_available():
        return [
            Problem(
                f"trainer.accelerator={accelerator!r} but this machine has no usable CUDA GPU",
                "use trainer=cpu (slow for these recipes) or a machine with a GPU",
                "gpu",
            )
        ]
    devices = trainer.get("devices")
    if isinstance(devices, int) and devices > torch.cuda.device_count():
        return [
            Problem(
                f"trainer.devices={devices} but this machine has {torch.cuda.device_count()} GPU(s)",
                f"use trainer.devices={torch.cuda.device_count()}",
                "gpu",
            )
        ]
    if "bf16" in str(trainer.get("precision", "")) and not torch.cuda.is_bf16_supported():
        return [
            Problem(
                f"trainer.precision={trainer['precision']!r} needs an Ampere or newer GPU",
                "use trainer.precision=16-mixed",
                "gpu",
            )
        ]
    return []


# The checks ``problems`` runs, in order: what each checks, and what to look at when it fails unexpectedly.
CHECKS: tuple[tuple[str, Callable[[dict[str, Any]], list[Problem]], str, str], ...] = (
    ("the dataset", _data_problems, "see the dataset's config in conf/data", "split-files"),
    ("the files the config names", _file_problems, "see the run's keys in conf/config.yaml", "train"),
    ("the encoder's weights", _encoder_problems, "see the encoder's config in conf/model", "encoder-weights"),
    ("the attention grid", _grid_problems, "see the encoder's config in conf/model", "train"),
    ("the accelerator", lambda cfg: _accelerator_problems(cfg["trainer"]), "see the trainer's config in conf/trainer",
     "gpu"),
)  # fmt: skip


def problems(cfg: dict[str, Any]) -> list[Problem]:
    """Every problem with the files and devices the resolved training config ``cfg`` needs, in the order data,
    files, encoder weights, attention grid, accelerator; empty when the run can start.

    A check that fails in a way it does not expect (a folder this user cannot list, a value of the wrong
    kind) is one problem naming the error, and the other checks still run."""
    found = []
    for what, find, remedy, section in CHECKS:
        try:
            found += find(cfg)
        except Exception as exc:  # noqa: BLE001 - any failure of a check is reported, never a traceback
            hint = "check that this user can read it" if isinstance(exc, OSError) else remedy
            found.append(
                Problem(f"{what} could not be checked: {type(exc).__name__}: {first_line(exc)}", hint, section)
            )
    return found


def check(cfg: dict[str, Any]) -> None:
    """Raise PreflightError listing every problem ``problems`` finds; when there is none, download the encoder's
    weights (``_download_weights``: a run that cannot start downloads nothing) and raise it if that fails."""
    found = problems(cfg) or _download_weights(cfg)
    if found:
        raise PreflightError(found)
