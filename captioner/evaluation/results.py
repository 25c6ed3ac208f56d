"""Result files: generated captions in the COCO evaluation-server format, and metric summaries.

Metrics are stored on the 0-1 scale that the scorers return; the file says so in its ``"scale"`` key
(papers, including Show, Attend and Tell's Table 1, print them multiplied by 100).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Mapping

from captioner.fileio import write_json

SCALE = "0-1 (multiply by 100 for the paper's tables)"


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
