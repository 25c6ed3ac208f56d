"""Result files: generated captions in the COCO evaluation-server format, and metric summaries.

Metrics are stored on the 0-1 scale that the scorers return; the file says so in its ``"scale"`` key
(papers, including Show, Attend and Tell's Table 1, print them multiplied by 100).
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from captioner.errors import ConfigError
from captioner.fileio import write_json

SCALE = "0-1 (multiply by 100 for the paper's tables)"
_COCO_FILE = re.compile(r"(?:image_info|captions)_(?P<split>[A-Za-z0-9-]+)\.json")
_ALGORITHM = re.compile(r"[A-Za-z0-9-]+")


def server_results_name(image_list: str | os.PathLike, name: str) -> str:
    """``captions_<split>_<name>_results.json``, the file name the COCO evaluation server asks for.

    The split (``test2014``, ``val2014``, ...) comes from the name of the COCO file listing the images
    (``image_info_test2014.json``, ``captions_val2014.json``). Raises ConfigError for another file name, or a
    ``name`` that is not letters, digits and hyphens (the server splits the file name at underscores).
    """
    match = _COCO_FILE.fullmatch(Path(image_list).name)
    if match is None:
        raise ConfigError(
            f"{image_list}: cannot tell the COCO split from this file name; keep the name COCO "
            "gives it (image_info_test2014.json, captions_val2014.json, ...)"
        )
    if not _ALGORITHM.fullmatch(name):
        raise ConfigError(
            f"--name {name!r}: use letters, digits and hyphens only (the evaluation server reads "
            "the results file name as captions_<split>_<name>_results.json)"
        )
    return f"captions_{match['split']}_{name}_results.json"


def write_results(path: str | os.PathLike, captions: dict[int, str]) -> None:
    """Write ``[{"image_id": int, "caption": str}, ...]`` sorted by image id, atomically.

    This is the format of the COCO caption evaluation server and of ``COCO.loadRes``.
    Raises TypeError for an image id that is not an integer or a caption that is not a string.
    """
    rows = []
    for image_id, caption in captions.items():
        if isinstance(image_id, bool) or not isinstance(image_id, numbers.Integral):
            raise TypeError(f"image id {image_id!r} is not an integer")
        if not isinstance(caption, str):
            raise TypeError(f"caption of image {image_id} is not a string: {caption!r}")
        rows.append({"image_id": int(image_id), "caption": caption})
    rows.sort(key=lambda row: row["image_id"])
    write_json(path, rows)


def _plain(value: Any, key: str) -> Any:
    """``value`` as plain JSON data: numpy/torch scalars to int/float, NaN and infinities to None."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "item"):  # 0-d numpy arrays and tensors
        return _plain(value.item(), key)
    raise TypeError(f"metric {key!r} has a value of type {type(value).__name__} that JSON cannot hold")


def write_metrics(path: str | os.PathLike, metrics: Mapping[str, Any]) -> None:
    """Write ``metrics`` as JSON atomically, with ``"scale": SCALE`` first.

    Values stay on the scorers' 0-1 scale (CIDEr may exceed 1); numpy and torch scalars become
    plain numbers and non-finite values (an undefined mean) become null. Nested dicts and lists
    are allowed. Raises ValueError when ``metrics`` has a ``"scale"`` key with another value.
    """
    if metrics.get("scale", SCALE) != SCALE:
        raise ValueError(f'metrics "scale" must be {SCALE!r}, got {metrics["scale"]!r}')
    rest = {str(k): _plain(v, str(k)) for k, v in metrics.items() if k != "scale"}
    write_json(path, {"scale": SCALE, **rest})
