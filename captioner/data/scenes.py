"""The scenes of the built-in dataset: which shapes are where in an image, its five captions, its pixels.

Each image holds one to three shapes (circle, square, triangle in red, green, blue, yellow or purple)
in distinct cells of a 3x3 grid, and five varied captions that say which shape is where ("a red
circle in the top left corner", "a blue square to the left of a green triangle"), so a captioner has
to attend to the right place. A scene depends only on the generator parameters (``ShapesSpec``), its
split and its index. ``captioner.data.shapes`` writes them as a dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from captioner.config import ShapesSpec
from captioner.data.splits import SPLITS

COLOURS = {
    "red": (215, 48, 39),
    "green": (40, 160, 70),
    "blue": (40, 90, 215),
    "yellow": (240, 200, 20),
    "purple": (135, 60, 175),
}
SHAPES = ("circle", "square", "triangle")
CELLS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
_OBJECT_COUNTS, _OBJECT_COUNT_P = (1, 2, 3), (0.2, 0.4, 0.4)
_NOISE = 6  # pixel noise amplitude, in grey levels

# Position phrases per cell: (long forms, short forms used where two positions share a caption).
_CORNER = (("in the {} corner", "at the {}", "in the {}"), ("in the {}", "at the {}"))
_EDGE_V = (("at the {}", "near the {}", "at the {} of the image"), ("at the {}",))
_EDGE_H = (("on the {}", "on the {} side", "on the {} of the image"), ("on the {}",))
_MIDDLE = (("in the center", "in the middle", "in the center of the image"), ("in the center", "in the middle"))
_PHRASES = (_CORNER, _EDGE_V, _CORNER, _EDGE_H, _MIDDLE, _EDGE_H, _CORNER, _EDGE_V, _CORNER)

_SINGLE = (
    "a {a} {p}",
    "there is a {a} {p}",
    "{p} there is a {a}",
    "a {a} can be seen {p}",
    "the image shows a {a} {p}",
    "a picture of a {a} {p}",
)
_ALONE = ("a single {a} on a plain background", "one {a} on a light background", "a picture of one {a}")
_PAIR = ("a {a} {pa} and a {b} {pb}", "{pa} a {a} and {pb} a {b}")
_RELATION = ("a {a} {r} a {b}", "there is a {a} {r} a {b}", "the {a} is {r} the {b}", "a {a} sits {r} a {b}")
_LIST2 = ("a {a} and a {b}", "two shapes, a {a} and a {b}", "a {a} and a {b} on a plain background")
_LIST3 = (
    "a {a}, a {b} and a {c}",
    "three shapes: a {a}, a {b} and a {c}",
    "a {a}, a {b} and a {c} on a plain background",
)


@dataclass(frozen=True)
class Shape:
    """One drawn object: colour and shape names, grid cell (0..8, row-major) and pixel box."""

    colour: str
    shape: str
    cell: int
    box: tuple[int, int, int, int]  # x0, y0 (inclusive), width, height in pixels

    @property
    def name(self) -> str:
        """``"<colour> <shape>"``, as the captions say it."""
        return f"{self.colour} {self.shape}"


@dataclass(frozen=True)
class Scene:
    """An image's content: background colour, shapes and five reference captions."""

    background: tuple[int, int, int]
    shapes: tuple[Shape, ...]
    captions: tuple[str, ...]


def make_scene(spec: ShapesSpec, split: str, index: int) -> Scene:
    """The scene of image ``index`` of ``split``: a function of (seed, split, index) only."""
    rng = _rng(spec, split, index)
    count = int(rng.choice(_OBJECT_COUNTS, p=_OBJECT_COUNT_P))
    cells = rng.choice(9, size=count, replace=False)
    kinds = rng.choice(len(COLOURS) * len(SHAPES), size=count, replace=False)  # distinct colour+shape
    colours = list(COLOURS)
    shapes = tuple(
        Shape(colours[k // len(SHAPES)], SHAPES[k % len(SHAPES)], int(c), _place(rng, int(c), spec.image_size))
        for c, k in zip(cells, kinds)
    )
    background = tuple(int(v) for v in rng.integers(226, 240) + rng.integers(-6, 7, size=3))
    return Scene(background, shapes, describe(shapes, rng))


def render(scene: Scene, spec: ShapesSpec, split: str, index: int) -> Image.Image:
    """Draw ``scene`` (the image ``index`` of ``split``) with mild pixel noise."""
    size = spec.image_size
    image = Image.new("RGB", (size, size), scene.background)
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        _draw(draw, shape)
    noise_rng = _rng(spec, split, index, stream=1)
    noise = noise_rng.integers(-_NOISE, _NOISE + 1, size=(size, size, 1))  # same noise in R, G and B
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype(np.uint8))


def describe(shapes: Sequence[Shape], rng: np.random.Generator) -> tuple[str, ...]:
    """Five distinct captions naming every shape, most of them saying where it is."""
    shapes = [shapes[i] for i in rng.permutation(len(shapes))]
    if len(shapes) == 1:
        only = shapes[0]
        options = [(t, p) for t in _SINGLE for p in _PHRASES[only.cell][0]]
        chosen = [options[i] for i in rng.choice(len(options), size=4, replace=False)]
        captions = [t.format(a=only.name, p=p.format(CELLS[only.cell])) for t, p in chosen]
        captions.append(_pick(rng, _ALONE).format(a=only.name))
    elif len(shapes) == 2:
        a, b = shapes
        captions = [
            _relation(rng, a, b),
            _pair(rng, a, b),
            _single(rng, a),
            _single(rng, b),
            _pick(rng, _LIST2).format(a=a.name, b=b.name),
        ]
    else:
        a, b, c = shapes
        captions = [
            _pick(rng, _LIST3).format(a=a.name, b=b.name, c=c.name),
            _relation(rng, a, b),
            _relation(rng, c, a),
            _single(rng, b),
            _pair(rng, c, b),
        ]
    return tuple(captions[i] for i in rng.permutation(len(captions)))


def _single(rng: np.random.Generator, a: Shape) -> str:
    """One shape and its position."""
    return _pick(rng, _SINGLE).format(a=a.name, p=_position(rng, a, short=False))


def _pair(rng: np.random.Generator, a: Shape, b: Shape) -> str:
    """Two shapes, each with its position."""
    where_a, where_b = _position(rng, a, short=True), _position(rng, b, short=True)
    return _pick(rng, _PAIR).format(a=a.name, b=b.name, pa=where_a, pb=where_b)


def _relation(rng: np.random.Generator, a: Shape, b: Shape) -> str:
    """Where ``a`` is relative to ``b``: left/right when their columns differ, above/below for rows."""
    (row_a, col_a), (row_b, col_b) = divmod(a.cell, 3), divmod(b.cell, 3)
    options = []
    if col_a != col_b:
        options.append("to the left of" if col_a < col_b else "to the right of")
    if row_a != row_b:
        options.append("above" if row_a < row_b else "below")
    return _pick(rng, _RELATION).format(a=a.name, b=b.name, r=_pick(rng, options))


def position_phrase(cell: int) -> str:
    """The first long phrase the captions use for grid cell ``cell`` (0..8): "in the top left corner", ..."""
    return _PHRASES[cell][0][0].format(CELLS[cell])


def _position(rng: np.random.Generator, shape: Shape, short: bool) -> str:
    """A phrase naming the shape's cell ("in the top left corner", "on the right", ...)."""
    return _pick(rng, _PHRASES[shape.cell][short]).format(CELLS[shape.cell])


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    """One of ``options``, uniformly."""
    return options[int(rng.integers(len(options)))]


def _place(rng: np.random.Generator, cell: int, image_size: int) -> tuple[int, int, int, int]:
    """A square box of 55-80 % of the cell's side, jittered but fully inside the cell."""
    row, col = divmod(cell, 3)
    side = image_size / 3
    size = max(1, round(rng.uniform(0.55, 0.8) * side))
    x0, y0 = (_offset(rng, int(np.ceil(k * side)), int(np.floor((k + 1) * side)), size) for k in (col, row))
    return x0, y0, size, size


def _offset(rng: np.random.Generator, low: int, high: int, size: int) -> int:
    """Start of a ``size``-pixel span inside [low, high), near the middle (25-75 % of the slack)."""
    return low + round(rng.uniform(0.25, 0.75) * (high - low - size))


def _draw(draw: ImageDraw.ImageDraw, shape: Shape) -> None:
    """Draw one shape filling its box."""
    x0, y0, w, h = shape.box
    x1, y1 = x0 + w - 1, y0 + h - 1
    fill = COLOURS[shape.colour]
    if shape.shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape.shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([(x0 + (w - 1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _rng(spec: ShapesSpec, split: str, index: int, stream: int = 0) -> np.random.Generator:
    """The random generator of one image (independent of every other image and of the split sizes)."""
    return np.random.default_rng([spec.seed, SPLITS.index(split), index, stream])
