"""Built-in dataset: coloured shapes on a 3x3 layout, written as COCO and Karpathy files.

Each image holds one to three shapes (circle, square, triangle in red, green, blue, yellow or purple)
in distinct cells of a 3x3 grid, and five varied captions that say which shape is where ("a red
circle in the top left corner", "a blue square to the left of a green triangle"), so a captioner has
to attend to the right place. Generation is deterministic for a seed (byte-identical files), every
file is written atomically, a finished dataset is never overwritten, and an interrupted one resumes.

Layout under ``root``::

    images/<split>/<image id>.png            image_size x image_size RGB
    annotations/captions_<split>.json        COCO captions format
    annotations/instances_<split>.json       COCO instances format (a bbox per shape, plus its colour)
    dataset_shapes.json                      Karpathy split-file format
    meta.json                                the generator parameters, written last
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

from captioner.data.readers import SPLITS, Record, read_coco
from captioner.data.vocab import tokenize
from captioner.errors import DataError, check_range
from captioner.fileio import atomic_write, read_json, write_json

COLOURS = {"red": (215, 48, 39), "green": (40, 160, 70), "blue": (40, 90, 215),
           "yellow": (240, 200, 20), "purple": (135, 60, 175)}
SHAPES = ("circle", "square", "triangle")
CELLS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
META, PARTIAL = "meta.json", ".generating.json"
_FORMAT, _VERSION = "captioner-shapes", 1
_OBJECT_COUNTS, _OBJECT_COUNT_P = (1, 2, 3), (0.2, 0.4, 0.4)
_NOISE = 6  # pixel noise amplitude, in grey levels
_WRITERS = 8  # threads writing image files
_INFO = {"description": "captioner built-in shapes dataset", "version": str(_VERSION)}

# Position phrases per cell: (long forms, short forms used where two positions share a caption).
_CORNER = (("in the {} corner", "at the {}", "in the {}"), ("in the {}", "at the {}"))
_EDGE_V = (("at the {}", "near the {}", "at the {} of the image"), ("at the {}",))
_EDGE_H = (("on the {}", "on the {} side", "on the {} of the image"), ("on the {}",))
_MIDDLE = (("in the center", "in the middle", "in the center of the image"),
           ("in the center", "in the middle"))
_PHRASES = (_CORNER, _EDGE_V, _CORNER, _EDGE_H, _MIDDLE, _EDGE_H, _CORNER, _EDGE_V, _CORNER)

_SINGLE = ("a {a} {p}", "there is a {a} {p}", "{p} there is a {a}", "a {a} can be seen {p}",
           "the image shows a {a} {p}", "a picture of a {a} {p}")
_ALONE = ("a single {a} on a plain background", "one {a} on a light background", "a picture of one {a}")
_PAIR = ("a {a} {pa} and a {b} {pb}", "{pa} a {a} and {pb} a {b}")
_RELATION = ("a {a} {r} a {b}", "there is a {a} {r} a {b}", "the {a} is {r} the {b}", "a {a} sits {r} a {b}")
_LIST2 = ("a {a} and a {b}", "two shapes, a {a} and a {b}", "a {a} and a {b} on a plain background")
_LIST3 = ("a {a}, a {b} and a {c}", "three shapes: a {a}, a {b} and a {c}",
          "a {a}, a {b} and a {c} on a plain background")


@dataclass(frozen=True)
class ShapesSpec:
    """The generator parameters (stored in meta.json); the defaults are the built-in dataset's."""

    n_train: int = 3000
    n_val: int = 250
    n_test: int = 250
    image_size: int = 96
    seed: int = 0

    def __post_init__(self) -> None:
        for split in SPLITS:
            check_range(f"n_{split}", getattr(self, f"n_{split}"), 1, kind=int)
        check_range("image_size", self.image_size, 24, kind=int)
        check_range("seed", self.seed, 0, kind=int)

    def meta(self) -> dict:
        """The meta.json content: format, version and parameters."""
        return {"format": _FORMAT, "version": _VERSION, "params": asdict(self)}


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


def generate_shapes(root: str | Path, spec: ShapesSpec = ShapesSpec()) -> Path:
    """Generate the dataset ``spec`` describes under ``root`` (a no-op when it is already there); return ``root``.

    Raises DataError when ``root`` holds a dataset made with other parameters, or other files.
    """
    root = Path(root)
    if (root / META).is_file():
        _check_meta(root / META, spec.meta(), "holds a shapes dataset")
        return root
    _claim(root, spec.meta())
    karpathy = []
    first_id = 1
    for split in SPLITS:
        scenes = [make_scene(spec, split, i) for i in range(getattr(spec, f"n_{split}"))]
        ids = range(first_id, first_id + len(scenes))
        first_id += len(scenes)
        _write_images(root / "images" / split, spec, split, ids, scenes)
        _write_compact(root / "annotations" / f"captions_{split}.json", _coco_captions(ids, scenes, spec))
        _write_compact(root / "annotations" / f"instances_{split}.json", _coco_instances(ids, scenes, spec))
        karpathy.extend(_karpathy_entries(split, ids, scenes, len(karpathy)))
    _write_compact(root / "dataset_shapes.json", {"dataset": "shapes", "images": karpathy})
    write_json(root / META, spec.meta())
    (root / PARTIAL).unlink()
    return root


def shapes_records(root: str | Path, split: str) -> list[Record]:
    """Records of one split of a generated shapes dataset, with the boxes of its shapes."""
    root = Path(root)
    if not (root / META).is_file():
        raise DataError(f"{root} holds no generated shapes dataset ({META} is missing); run generate_shapes")
    annotations = root / "annotations"
    return read_coco(annotations / f"captions_{split}.json", root / "images" / split, split,
                     instances_file=annotations / f"instances_{split}.json")


def make_scene(spec: ShapesSpec, split: str, index: int) -> Scene:
    """The scene of image ``index`` of ``split``: a function of (seed, split, index) only."""
    rng = _rng(spec, split, index)
    count = int(rng.choice(_OBJECT_COUNTS, p=_OBJECT_COUNT_P))
    cells = rng.choice(9, size=count, replace=False)
    kinds = rng.choice(len(COLOURS) * len(SHAPES), size=count, replace=False)  # distinct colour+shape
    colours = list(COLOURS)
    shapes = tuple(Shape(colours[k // len(SHAPES)], SHAPES[k % len(SHAPES)], int(c),
                         _place(rng, int(c), spec.image_size)) for c, k in zip(cells, kinds))
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
        captions = [_relation(rng, a, b), _pair(rng, a, b), _single(rng, a), _single(rng, b),
                    _pick(rng, _LIST2).format(a=a.name, b=b.name)]
    else:
        a, b, c = shapes
        captions = [_pick(rng, _LIST3).format(a=a.name, b=b.name, c=c.name), _relation(rng, a, b),
                    _relation(rng, c, a), _single(rng, b), _pair(rng, c, b)]
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


def _write_images(folder: Path, spec: ShapesSpec, split: str, ids: range, scenes: list[Scene]) -> None:
    """Write each image that is not there yet (an interrupted run resumes where it stopped).

    Threads overlap the PNG encoding and the fsync of each atomic write; the files do not depend on
    the order in which they are written.
    """
    def write(index: int) -> None:
        path = folder / _file_name(ids[index])
        if not path.exists():
            with atomic_write(path) as handle:
                render(scenes[index], spec, split, index).save(handle, format="PNG", compress_level=3)

    with ThreadPoolExecutor(max_workers=_WRITERS) as pool:
        list(pool.map(write, range(len(scenes))))


def _write_compact(path: Path, obj: dict) -> None:
    """Write ``obj`` as compact JSON, atomically (``json.dumps`` runs the fast C encoder)."""
    with atomic_write(path, "w") as handle:
        handle.write(json.dumps(obj, separators=(",", ":")))


def _file_name(image_id: int) -> str:
    return f"{image_id:06d}.png"


def _coco_images(ids: range, spec: ShapesSpec) -> list[dict]:
    """The COCO ``images`` list."""
    size = spec.image_size
    return [{"id": i, "file_name": _file_name(i), "width": size, "height": size} for i in ids]


def _coco_captions(ids: range, scenes: list[Scene], spec: ShapesSpec) -> dict:
    """A COCO captions file (``captions_train2014.json`` layout)."""
    pairs = [(i, caption) for i, scene in zip(ids, scenes) for caption in scene.captions]
    annotations = [{"id": n, "image_id": i, "caption": c} for n, (i, c) in enumerate(pairs, start=1)]
    return {"info": _INFO, "licenses": [], "images": _coco_images(ids, spec), "annotations": annotations}


def _coco_instances(ids: range, scenes: list[Scene], spec: ShapesSpec) -> dict:
    """A COCO instances file: one bbox per shape, category = shape, plus a ``colour`` field."""
    pairs = [(i, shape) for i, scene in zip(ids, scenes) for shape in scene.shapes]
    annotations = [{"id": n, "image_id": i, "category_id": SHAPES.index(shape.shape) + 1,
                    "bbox": list(shape.box), "area": shape.box[2] * shape.box[3], "iscrowd": 0,
                    "colour": shape.colour} for n, (i, shape) in enumerate(pairs, start=1)]
    categories = [{"id": k + 1, "name": name, "supercategory": "shape"} for k, name in enumerate(SHAPES)]
    return {"info": _INFO, "licenses": [], "images": _coco_images(ids, spec), "annotations": annotations,
            "categories": categories}


def _karpathy_entries(split: str, ids: range, scenes: list[Scene], first_imgid: int) -> list[dict]:
    """``images[]`` entries of a Karpathy split file (COCO flavour: filepath and cocoid)."""
    entries = []
    for k, (image_id, scene) in enumerate(zip(ids, scenes)):
        imgid = first_imgid + k
        sentids = list(range(imgid * 5, imgid * 5 + len(scene.captions)))
        sentences = [{"tokens": tokenize(c), "raw": c, "imgid": imgid, "sentid": s}
                     for s, c in zip(sentids, scene.captions)]
        entries.append({"filepath": f"images/{split}", "filename": _file_name(image_id), "imgid": imgid,
                        "cocoid": image_id, "split": split, "sentids": sentids, "sentences": sentences})
    return entries


def _claim(root: Path, meta: dict) -> None:
    """Make ``root`` ours: empty (or absent), or a run with the same parameters that was interrupted."""
    if root.exists() and not root.is_dir():
        raise DataError(f"{root} is not a folder; cannot generate the shapes dataset there")
    if (root / PARTIAL).is_file():
        _check_meta(root / PARTIAL, meta, "holds an unfinished shapes dataset")
        for leftover in root.rglob(".*.tmp"):  # temporary files of interrupted atomic writes
            leftover.unlink()
        return
    if root.exists() and any(root.iterdir()):
        raise DataError(f"{root} is not empty and holds no shapes dataset ({META} is missing); "
                        "refusing to write into it: choose an empty or new folder")
    write_json(root / PARTIAL, meta)


def _check_meta(path: Path, meta: dict, what: str) -> None:
    """Raise DataError unless the parameters stored in ``path`` equal ``meta``'s."""
    stored = read_json(path, "shapes dataset meta file")
    if stored == meta:
        return
    params = stored.get("params") if isinstance(stored, dict) else None
    if isinstance(params, dict):
        diff = ", ".join(f"{k}={params.get(k)!r} (asked {v!r})" for k, v in meta["params"].items()
                         if params.get(k) != v)
    else:
        diff = "unreadable parameters"
    raise DataError(f"{path.parent} {what} made with different parameters ({diff or 'another version'}); "
                    "it is never overwritten: give another folder (train.py: data.source.root=FOLDER, "
                    "captioner shapes --out FOLDER) or delete it")
