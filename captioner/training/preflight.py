"""Preflight: every file and device a training run needs, checked before its folder is made.

``problems(cfg)`` takes the resolved config (plain data) and returns every problem at once, one line each with
its remedy and the section of ``docs/datasets.md`` that explains it: the dataset's split or caption files and
image folders, how many of each split's images are there (``val: 0 of 5,000 images found under
data/coco/val2014``), whether a sample of each split decodes, the vocabulary, checkpoint and logger packages the
config names, the encoder's weights file and the accelerator the trainer asks for. ``ValidateConfig``
(``training/validate.py``) runs it once the config's values are valid; ``train.py`` prints the lines and exits
with status 2 before any run folder exists.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioner.data.readers import SPLITS
from captioner.errors import CaptionerError, ConfigError, first_line

GUIDE = "docs/datasets.md"
SAMPLES = 3  # images of each split decoded: the first, the middle and the last found
# The optional package each logger needs, and the extra of pyproject.toml that installs it.
LOGGER_PACKAGES: dict[str, str] = {"WandbLogger": "wandb", "MLFlowLogger": "mlflow"}


class Section(enum.StrEnum):
    """The sections of docs/datasets.md that a problem links to, by their anchors."""

    images = "images"
    split_files = "split-files"
    encoder_weights = "encoder-weights"
    gpu = "gpu"
    train = "train"


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
    """The split's records can be read, some of its images are there and a sample of them decodes."""
    from captioner.data.images import images_present, load_rgb, none_found

    try:
        records = source.records(split)
    except CaptionerError as exc:
        yield Problem(f"{split}: {first_line(exc)}", "give the dataset's own annotation files", "split-files")
        return
    if not records:
        yield Problem(f"{split}: the split file lists no image of this split", "check the split file", "split-files")
        return
    paths = [record.image_path for record in records]
    found = images_present(paths)
    if not found:
        remedy = "unzip the dataset's images there, or point data.source at the folder that holds them"
        yield Problem(none_found(split, paths), remedy, "images")
        return
    for index in sorted({0, len(found) // 2, len(found) - 1})[:SAMPLES]:
        try:
            load_rgb(found[index])
        except CaptionerError as exc:
            yield Problem(f"{split}: a sample image does not decode: {exc}", "download it again", "images")


def _data_problems(cfg: dict[str, Any]) -> list[Problem]:
    """The dataset's files and folders (the source's own ``paths``); when they are all there, each split the run
    reads."""
    try:
        built = _build_source(cfg["data"]["source"])
    except (CaptionerError, TypeError) as exc:
        return [Problem(first_line(exc), "see the dataset's config in conf/data", Section.split_files)]
    sections = {"annotations": Section.split_files, "images": Section.images}  # by what a path holds
    found = [
        Problem(problem, path.remedy, sections[path.holds]) for path in built.paths() if (problem := path.problem())
    ]
    if found:
        return found
    from captioner.data.sources import ShapesSource  # imported with the source above, not before a config error

    if isinstance(built, ShapesSource):
        return []  # generated on first use
    needed = [split for split in SPLITS if split == "val" or cfg.get(split, True)]
    return [problem for split in needed for problem in _split_problems(built, split)]


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
    for key in ("ckpt_path", "init_from"):
        if cfg.get(key) is not None and not Path(cfg[key]).exists():
            found.append(
                Problem(f"{key}={cfg[key]!r} does not exist", "give a run folder, a .ckpt or a bundle", "train")
            )
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


def _encoder_problems(cfg: dict[str, Any]) -> list[Problem]:
    """The encoder's ImageNet weights file, which is never downloaded at run time."""
    encoder = cfg["model"]["encoder"]
    if encoder.get("weights") is None:
        return []
    from captioner.model.encoder import resolve_weights, weight_file

    try:
        weights = resolve_weights(encoder["name"], encoder["weights"])
    except (CaptionerError, ValueError) as exc:
        return [Problem(f"model.{first_line(exc)}", "see torchvision's list of weights", "encoder-weights")]
    path = weight_file(weights)
    if os.path.isfile(path):
        return []
    return [
        Problem(
            f"model.encoder.weights={encoder['weights']!r}: the ImageNet weights of {encoder['name']} are not on disk",
            f"download {weights.url} and save it as {path} (TORCH_HOME moves that folder)",
            "encoder-weights",
        )
    ]


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


def problems(cfg: dict[str, Any]) -> list[Problem]:
    """Every problem with the files and devices the resolved training config ``cfg`` needs, in the order data,
    files, encoder weights, accelerator; empty when the run can start."""
    return [*_data_problems(cfg), *_file_problems(cfg), *_encoder_problems(cfg), *_accelerator_problems(cfg["trainer"])]


def check(cfg: dict[str, Any]) -> None:
    """Raise PreflightError listing every problem ``problems`` finds."""
    found = problems(cfg)
    if found:
        raise PreflightError(found)
