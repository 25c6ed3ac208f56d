"""captioner: Show, Attend and Tell image captioning.

The Python API, for notebooks::

    from captioner import load_model, show_attention

    model = load_model("outputs/train/runs/<run>")  # a run folder, its bundle.pt or a training checkpoint
    model                                           # backbone, grid, attention, vocabulary, file
    result = model.caption("photo.jpg")             # also a PIL image, a tensor (3, H, W), a numpy (H, W, 3)
    result.caption, result.score, result.alphas     # the words, their score, one attention map per word
    show_attention(result)                          # a matplotlib figure: one panel per word
    results = model.caption(["a.jpg", "b.jpg"])     # one result per input; a broken one: .error, .caption None

The names are imported on first use, so ``import captioner`` stays cheap (no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_model": "captioner.inference",
    "LoadedModel": "captioner.inference",
    "Captioned": "captioner.inference",
    "Hypothesis": "captioner.inference",
    "show_attention": "captioner.viz.notebook",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import the public names of the API on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'captioner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
