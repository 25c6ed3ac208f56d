"""Built-in dataset: coloured shapes on a 3x3 layout, or cluttered scenes, written as COCO and Karpathy files.

Each image holds one to three shapes in distinct cells of a 3x3 grid and five captions that say which
shape is where (``captioner.data.scenes`` makes them), or, with ``ShapesSpec.scenes=cluttered``, two to
four objects of six kinds placed freely among clutter, with captions that count them and relate them
(``captioner.data.cluttered``). Generation is deterministic for a seed
(byte-identical files), every file is written atomically, a finished dataset is never overwritten, and an
interrupted one resumes.

Layout under ``root``::

    images/<split>/<image id>.png            RGB, image_size x image_size (cluttered: width x height)
    annotations/captions_<split>.json        COCO captions format
    annotations/instances_<split>.json       COCO instances format (a bbox per shape, plus its colour)
    dataset_shapes.json                      Karpathy split-file format
    meta.json                                the generator parameters, written last
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from captioner.config import SceneKind, ShapesSpec
from captioner.data.cluttered import KINDS, ClutteredScene, Item, make_cluttered_scene
from captioner.data.cluttered_pixels import render_cluttered
from captioner.data.readers import SPLITS, Record, read_coco
from captioner.data.scenes import SHAPES, Scene, make_scene, render
from captioner.data.vocab import tokenize
from captioner.errors import DataError
from captioner.fileio import atomic_write, read_json, write_json

META, PARTIAL = "meta.json", ".generating.json"
_FORMAT, _VERSION = "captioner-shapes", 1
_WRITERS = 8  # threads writing image files
AnyScene = Scene | ClutteredScene
_INFO = {"description": "captioner built-in shapes dataset", "version": str(_VERSION)}


def generate_shapes(root: str | Path, spec: ShapesSpec = ShapesSpec()) -> Path:
    """Generate the dataset ``spec`` describes under ``root`` (a no-op when it is already there); return ``root``.

    Raises DataError when ``root`` holds a dataset made with other parameters, or other files.
    """
    root = Path(root)
    if (root / META).is_file():
        _check_meta(root / META, _meta(spec), "holds a shapes dataset")
        return root
    _claim(root, _meta(spec))
    karpathy = []
    first_id = 1
    for split in SPLITS:
        make = make_scene if spec.scenes is SceneKind.simple else make_cluttered_scene
        scenes = [make(spec, split, i) for i in range(getattr(spec, f"n_{split}"))]
        ids = range(first_id, first_id + len(scenes))
        first_id += len(scenes)
        _write_images(root / "images" / split, spec, split, ids, scenes)
        _write_compact(root / "annotations" / f"captions_{split}.json", _coco_captions(ids, scenes, spec))
        _write_compact(root / "annotations" / f"instances_{split}.json", _coco_instances(ids, scenes, spec))
        karpathy.extend(_karpathy_entries(split, ids, scenes, len(karpathy)))
    _write_compact(root / "dataset_shapes.json", {"dataset": "shapes", "images": karpathy})
    write_json(root / META, _meta(spec))
    (root / PARTIAL).unlink()
    return root


def shapes_records(root: str | Path, split: str) -> list[Record]:
    """Records of one split of a generated shapes dataset, with the boxes of its shapes."""
    root = Path(root)
    if not (root / META).is_file():
        raise DataError(f"{root} holds no generated shapes dataset ({META} is missing); run generate_shapes")
    annotations = root / "annotations"
    return read_coco(
        annotations / f"captions_{split}.json",
        root / "images" / split,
        split,
        instances_file=annotations / f"instances_{split}.json",
    )


def _meta(spec: ShapesSpec) -> dict:
    """The meta.json content: format, version and the generator parameters."""
    return {"format": _FORMAT, "version": _VERSION, "params": spec.params()}


def _write_images(folder: Path, spec: ShapesSpec, split: str, ids: range, scenes: list[AnyScene]) -> None:
    """Write each image that is not there yet (an interrupted run resumes where it stopped).

    Threads overlap the PNG encoding and the fsync of each atomic write; the files do not depend on
    the order in which they are written.
    """

    def write(index: int) -> None:
        path = folder / _file_name(ids[index])
        if not path.exists():
            with atomic_write(path) as handle:
                draw = render if spec.scenes is SceneKind.simple else render_cluttered
                draw(scenes[index], spec, split, index).save(handle, format="PNG", compress_level=3)

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
    width, height = spec.size
    return [{"id": i, "file_name": _file_name(i), "width": width, "height": height} for i in ids]


def _coco_captions(ids: range, scenes: list[AnyScene], spec: ShapesSpec) -> dict:
    """A COCO captions file (``captions_train2014.json`` layout)."""
    pairs = [(i, caption) for i, scene in zip(ids, scenes) for caption in scene.captions]
    annotations = [{"id": n, "image_id": i, "caption": c} for n, (i, c) in enumerate(pairs, start=1)]
    return {"info": _INFO, "licenses": [], "images": _coco_images(ids, spec), "annotations": annotations}


def _coco_instances(ids: range, scenes: list[AnyScene], spec: ShapesSpec) -> dict:
    """A COCO instances file: one bbox per shape, category = shape, plus a ``colour`` field (and, for
    cluttered scenes, a ``size`` field: "small" or "large")."""
    kinds = SHAPES if spec.scenes is SceneKind.simple else KINDS
    pairs = [(i, shape) for i, scene in zip(ids, scenes) for shape in scene.shapes]
    annotations = [
        {
            "id": n,
            "image_id": i,
            "category_id": kinds.index(shape.shape) + 1,
            "bbox": list(shape.box),
            "area": shape.box[2] * shape.box[3],
            "iscrowd": 0,
            "colour": shape.colour,
            **({"size": shape.size} if isinstance(shape, Item) else {}),
        }
        for n, (i, shape) in enumerate(pairs, start=1)
    ]
    categories = [{"id": k + 1, "name": name, "supercategory": "shape"} for k, name in enumerate(kinds)]
    return {
        "info": _INFO,
        "licenses": [],
        "images": _coco_images(ids, spec),
        "annotations": annotations,
        "categories": categories,
    }


def _karpathy_entries(split: str, ids: range, scenes: list[AnyScene], first_imgid: int) -> list[dict]:
    """``images[]`` entries of a Karpathy split file (COCO flavour: filepath and cocoid)."""
    entries = []
    for k, (image_id, scene) in enumerate(zip(ids, scenes)):
        imgid = first_imgid + k
        sentids = list(range(imgid * 5, imgid * 5 + len(scene.captions)))
        sentences = [
            {"tokens": tokenize(c), "raw": c, "imgid": imgid, "sentid": s} for s, c in zip(sentids, scene.captions)
        ]
        entries.append(
            {
                "filepath": f"images/{split}",
                "filename": _file_name(image_id),
                "imgid": imgid,
                "cocoid": image_id,
                "split": split,
                "sentids": sentids,
                "sentences": sentences,
            }
        )
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
        raise DataError(
            f"{root} is not empty and holds no shapes dataset ({META} is missing); "
            "refusing to write into it: choose an empty or new folder"
        )
    write_json(root / PARTIAL, meta)


def _check_meta(path: Path, meta: dict, what: str) -> None:
    """Raise DataError unless the parameters stored in ``path`` equal ``meta``'s."""
    stored = read_json(path, "shapes dataset meta file")
    if stored == meta:
        return
    params = stored.get("params") if isinstance(stored, dict) else None
    if isinstance(params, dict):
        diff = ", ".join(
            f"{k}={params.get(k)!r} (asked {v!r})" for k, v in meta["params"].items() if params.get(k) != v
        )
    else:
        diff = "unreadable parameters"
    raise DataError(
        f"{path.parent} {what} made with different parameters ({diff or 'another version'}); "
        "it is never overwritten: give another folder (train.py: data.source.root=FOLDER, "
        "captioner shapes --out FOLDER) or delete it"
    )
