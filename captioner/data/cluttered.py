"""The harder scenes of the built-in dataset (``ShapesSpec.scenes=cluttered``): objects placed freely among clutter.

Each image (``ShapesSpec.width`` x ``height``, 160 x 120 by default) holds two to four objects of six kinds
(circle, square, triangle, star, diamond, cross), small or large, in six colours, anywhere in the image but
never closer than a margin to each other, on a plain, gradient, noisy or striped light background strewn
with a few small grey marks (lines, dots, rings) that no caption mentions and no box holds. Its five
captions count the objects ("two red circles and a green star", "three shapes: ...") and say where they are
relative to each other ("a small red circle to the left of a blue star"): a relation is said only when the
objects' centres are a clear margin apart along its axis. Every object can be named uniquely: two objects
of the same colour and kind always differ in size, and the captions then say which. A scene depends only on
the generator parameters, its split and its index; ``captioner.data.cluttered_pixels`` draws them and
``captioner.data.shapes`` writes them as a dataset.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from captioner.config import ShapesSpec
from captioner.data.scenes import COLOURS as GRID_COLOURS
from captioner.data.scenes import SHAPES, _pick, _rng

COLOURS = {**GRID_COLOURS, "brown": (150, 90, 40)}
KINDS = (*SHAPES, "star", "diamond", "cross")  # the first three are the simple scenes' (same category ids)
PLURALS = {kind: kind + ("es" if kind.endswith("s") else "s") for kind in KINDS}
SIZES = {"small": (0.13, 0.17), "large": (0.24, 0.30)}  # an object's side as a fraction of the shorter side
BACKGROUNDS = ("plain", "gradient", "noisy", "striped")
BACKGROUND_WORDS = {"plain": "plain", "gradient": "shaded", "noisy": "noisy", "striped": "striped"}
NUMBERS = {1: "a", 2: "two", 3: "three", 4: "four"}
RELATIONS = ("to the left of", "to the right of", "above", "below")
_OBJECT_COUNTS, _OBJECT_COUNT_P = (2, 3, 4), (0.3, 0.4, 0.3)
_TWIN_P = 0.3  # chance that a further object repeats an earlier one's colour and kind (in the other size)
_SIZE_WORD_P = 0.3  # chance that a uniquely named object is named with its size too
_GAP = 0.05  # boxes stay this fraction of the shorter side apart (6 px at 120), and as far from the edges
_RELATION_MARGIN = 0.12  # a relation needs the centres this fraction of the width (height) apart
_CLUTTER = (3, 6)  # marks per image, at least and at most

_LIST = (
    "{list}",
    "{n} shapes: {list}",
    "there are {n} objects: {list}",
    "a picture of {list}",
    "{list} on a {bg} background",
    "{n} objects on a {bg} background: {list}",
)
_KINDS_LIST = ("{kinds}", "{n} shapes: {kinds}", "{kinds} on a {bg} background", "an image with {kinds}")
_RELATION = (
    "a {a} {r} a {b}",
    "there is a {a} {r} a {b}",
    "the {a} is {r} the {b}",
    "a {a} sits {r} a {b}",
    "{n} shapes with a {a} {r} a {b}",
)


@dataclass(frozen=True)
class Item:
    """One object: colour, kind and size names, the name the captions use for it, and its pixel box."""

    colour: str
    shape: str  # one of KINDS: the box's category
    size: str  # "small" or "large"
    box: tuple[int, int, int, int]  # x0, y0 (inclusive), width, height in pixels
    ref: str  # how the captions name it: "red circle" or "small red circle" (unique in its scene)

    @property
    def centre(self) -> tuple[float, float]:
        """The box's centre (x, y) in pixels."""
        x0, y0, w, h = self.box
        return x0 + w / 2, y0 + h / 2


@dataclass(frozen=True)
class Mark:
    """A clutter mark: a "line" from (x0, y0) to (x1, y1), or a "dot" or "ring" filling that box (inclusive)."""

    kind: str
    xy: tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels
    grey: int  # its grey level

    @property
    def extent(self) -> tuple[int, int, int, int]:
        """The pixels it may touch: x0, y0, x1, y1, inclusive."""
        x0, y0, x1, y1 = self.xy
        return min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)


@dataclass(frozen=True)
class Background:
    """A light background: ``style`` (one of BACKGROUNDS), two RGB tones and, for gradients and stripes, the
    direction (0 across x, 1 across y, 2 diagonal: stripes only) and the stripes' period in pixels."""

    style: str
    tones: tuple[tuple[int, int, int], tuple[int, int, int]]
    direction: int
    period: int


@dataclass(frozen=True)
class ClutteredScene:
    """An image's content: background, objects, clutter marks and five reference captions."""

    background: Background
    shapes: tuple[Item, ...]
    clutter: tuple[Mark, ...]
    captions: tuple[str, ...]


def make_cluttered_scene(spec: ShapesSpec, split: str, index: int) -> ClutteredScene:
    """The scene of image ``index`` of ``split``: a function of (seed, split, index) only."""
    rng = _rng(spec, split, index)
    width, height = spec.size
    count = int(rng.choice(_OBJECT_COUNTS, p=_OBJECT_COUNT_P))
    looks = _looks(rng, count)
    boxes = _layout(rng, [size for _, _, size in looks], width, height)
    items = _name(rng, looks, boxes)
    background = _background(rng)
    clutter = _clutter(rng, [item.box for item in items], width, height)
    return ClutteredScene(background, items, clutter, describe(items, background, rng, width, height))


def describe(
    items: Sequence[Item], background: Background, rng: np.random.Generator, width: int, height: int
) -> tuple[str, ...]:
    """Five distinct captions: one counting the objects by colour and kind, one counting them by kind, and
    three relations between pairs of objects (other pairs first); counting ones stand in for missing relations."""
    n, bg = NUMBERS[len(items)], BACKGROUND_WORDS[background.style]

    def listing() -> str:
        return _pick(rng, _LIST).format(n=n, bg=bg, list=_list(rng, items))

    def by_kind() -> str:
        return _pick(rng, _KINDS_LIST).format(n=n, bg=bg, kinds=_counted(Counter(item.shape for item in items)))

    captions: list[str] = []
    for make in (listing, by_kind):
        _add(captions, make)
    for a, b, r in _relation_order(rng, items, width, height):
        if len(captions) == 5:
            break
        _add(captions, lambda a=a, b=b, r=r: _pick(rng, _RELATION).format(n=n, a=a.ref, b=b.ref, r=r))
    while len(captions) < 5:
        _add(captions, listing if rng.random() < 0.5 else by_kind)
    return tuple(captions[i] for i in rng.permutation(len(captions)))


def _relation_order(
    rng: np.random.Generator, items: Sequence[Item], width: int, height: int
) -> list[tuple[Item, Item, str]]:
    """Every true (a, b, relation) in random order, one per pair of objects first, then the others."""
    found = [(a, b, r) for a in items for b in items if a is not b for r in relations(a, b, width, height)]
    found = [found[i] for i in rng.permutation(len(found))]
    seen: set[frozenset[str]] = set()
    first, rest = [], []
    for a, b, r in found:
        pair = frozenset((a.ref, b.ref))
        (rest if pair in seen else first).append((a, b, r))
        seen.add(pair)
    return first + rest


def relations(a: Item, b: Item, width: int, height: int) -> list[str]:
    """What ``a`` is relative to ``b`` (some of RELATIONS): each one only when the centres are at least
    ``_RELATION_MARGIN`` of the image's width (for left/right) or height (above/below) apart."""
    (ax, ay), (bx, by) = a.centre, b.centre
    left, right, above, below = RELATIONS
    found = []
    if abs(ax - bx) >= _RELATION_MARGIN * width:
        found.append(left if ax < bx else right)
    if abs(ay - by) >= _RELATION_MARGIN * height:
        found.append(above if ay < by else below)
    return found


def _add(captions: list[str], make: Callable[[], str]) -> None:
    """Append a caption ``make()`` gives that is not there yet (a few tries; none added when all repeat)."""
    for _ in range(8):
        caption = make()
        if caption not in captions:
            captions.append(caption)
            return


def _list(rng: np.random.Generator, items: Sequence[Item]) -> str:
    """Every object: counted by colour and kind ("two red circles and a green star"), or sometimes one by
    one with the names the relations use ("a large red circle, a small red circle and a green star")."""
    if rng.random() < _SIZE_WORD_P:
        return _join([f"a {item.ref}" for item in items])
    return _counted(Counter((item.colour, item.shape) for item in items))


def _counted(counts: Counter) -> str:
    """``{(colour, kind) or kind: count}`` as "two red circles and a green star" (in first-seen order)."""
    parts = []
    for key, count in counts.items():
        colour, kind = key if isinstance(key, tuple) else ("", key)
        noun = kind if count == 1 else PLURALS[kind]
        parts.append(" ".join(w for w in (NUMBERS[count], colour, noun) if w))
    return _join(parts)


def _join(parts: Sequence[str]) -> str:
    """``["a", "b", "c"]`` as "a, b and c"."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _looks(rng: np.random.Generator, count: int) -> list[tuple[str, str, str]]:
    """(colour, kind, size) of ``count`` objects: distinct colour+kind pairs, except that a further object
    may repeat an earlier one's (at most twice), always in the other size so that captions can tell them apart."""
    colours = list(COLOURS)
    looks: list[tuple[str, str, str]] = []
    for _ in range(count):
        names = Counter((c, k) for c, k, _ in looks)
        single = [look for look in looks if names[look[:2]] == 1]
        if single and rng.random() < _TWIN_P:
            colour, kind, size = single[int(rng.integers(len(single)))]
            looks.append((colour, kind, "small" if size == "large" else "large"))
            continue
        while True:
            colour, kind = colours[int(rng.integers(len(colours)))], KINDS[int(rng.integers(len(KINDS)))]
            if (colour, kind) not in names:
                break
        looks.append((colour, kind, _pick(rng, tuple(SIZES))))
    return looks


def _layout(rng: np.random.Generator, sizes: Sequence[str], width: int, height: int) -> list[tuple[int, ...]]:
    """Square boxes (x0, y0, w, h) of the given sizes, anywhere in the image, each at least the gap away
    from the edges and from every other box (larger objects placed first; a crowded layout starts over)."""
    short = min(width, height)
    gap = max(1, round(_GAP * short))
    sides = [max(3, round(rng.uniform(*SIZES[size]) * short)) for size in sizes]
    order = sorted(range(len(sizes)), key=lambda k: -sides[k])
    while True:
        boxes: dict[int, tuple[int, int, int, int]] = {}
        for k in order:
            side = sides[k]
            for _ in range(100):
                x0 = int(rng.integers(gap, width - gap - side + 1))
                y0 = int(rng.integers(gap, height - gap - side + 1))
                box = (x0, y0, side, side)
                if all(_apart(box, other, gap) for other in boxes.values()):
                    boxes[k] = box
                    break
            else:
                break
        if len(boxes) == len(sizes):
            return [boxes[k] for k in range(len(sizes))]


def _apart(a: Sequence[int], b: Sequence[int], gap: int) -> bool:
    """Whether boxes ``a`` and ``b`` (x0, y0, w, h) are at least ``gap`` pixels apart along x or y."""
    beside = a[0] + a[2] + gap <= b[0] or b[0] + b[2] + gap <= a[0]
    return beside or a[1] + a[3] + gap <= b[1] or b[1] + b[3] + gap <= a[1]


def _name(rng: np.random.Generator, looks: Sequence[tuple[str, str, str]], boxes: Sequence) -> tuple[Item, ...]:
    """The objects, each with the name the captions use: "red circle" when it is the only red circle (now
    and then "small red circle"), else with its size."""
    names = Counter((colour, kind) for colour, kind, _ in looks)
    items = []
    for (colour, kind, size), box in zip(looks, boxes):
        with_size = names[colour, kind] > 1 or rng.random() < _SIZE_WORD_P
        ref = f"{size} {colour} {kind}" if with_size else f"{colour} {kind}"
        items.append(Item(colour, kind, size, tuple(box), ref))
    return tuple(items)


def _background(rng: np.random.Generator) -> Background:
    """A light background: its style, two tones 10-30 grey levels apart (lightly tinted), direction, period."""
    style = _pick(rng, BACKGROUNDS)
    light = int(rng.integers(222, 244))
    dark = light - int(rng.integers(10, 31))
    tint = rng.integers(-6, 7, size=3)
    tones = (tuple(int(v) for v in light + tint), tuple(int(v) for v in dark + tint))
    direction = int(rng.integers(3 if style == "striped" else 2))
    return Background(style, tones, direction, int(rng.integers(6, 13)))


def _clutter(rng: np.random.Generator, boxes: Sequence[Sequence[int]], width: int, height: int) -> tuple[Mark, ...]:
    """A few small grey marks (lines, dots, rings), each fully outside every object's box."""
    short = min(width, height)
    marks: list[Mark] = []
    for _ in range(int(rng.integers(_CLUTTER[0], _CLUTTER[1] + 1))):
        for _ in range(50):  # a mark that lands on an object is drawn again elsewhere (or left out)
            kind = _pick(rng, ("line", "dot", "ring"))
            x0, y0 = int(rng.integers(width)), int(rng.integers(height))
            if kind == "line":
                length = rng.uniform(0.05, 0.12) * short
                angle = rng.uniform(0, np.pi)
                xy = (x0, y0, x0 + round(length * np.cos(angle)), y0 + round(length * np.sin(angle)))
            else:
                side = int(rng.integers(2, 4)) if kind == "dot" else int(rng.integers(4, 8))
                xy = (x0, y0, x0 + side, y0 + side)
            mark = Mark(kind, xy, int(rng.integers(70, 150)))
            x_lo, y_lo, x_hi, y_hi = mark.extent
            inside = min(x_lo, y_lo) >= 0 and x_hi < width and y_hi < height
            if inside and all(_apart((x_lo, y_lo, x_hi - x_lo + 1, y_hi - y_lo + 1), box, 1) for box in boxes):
                marks.append(mark)
                break
    return tuple(marks)
