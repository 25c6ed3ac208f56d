"""``python train.py`` on a COCO-shaped set: the demo's shapes with 5, 6 or 7 captions per image (COCO has 5 to 7)
and unreadable image files, read as a user's captions file (``data=captions``), so that a step's images hold
different caption counts and the ranks of a DDP run different ones at the same step: the data that hung multi-GPU
training with CUDA graphs before batches took a fixed K captions per image (docs/datasets.md).

    python benchmarks/coco_shaped.py data/coco_shaped trainer=ddp_cpu   # two gloo processes on the CPU
    python benchmarks/coco_shaped.py data/coco_shaped trainer=ddp trainer.devices=1   # gpu_check's part

Writes the set into the folder once (``captions.csv`` beside the shapes generator's images; the sizes are
``--train``, ``--val`` and ``--test``), then runs ``train.py experiment=captions_cpu`` (the demo's model, nothing to
download) on it with the remaining arguments as overrides, for two epochs: cross-entropy, then SCST. Its output is
train.py's, its exit status too.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAPTIONS_FILE = "captions.csv"
EXTRA = ("a picture of {}", "an image of {}")  # the sixth and seventh captions: an image's first ones, reworded
MORE = (0, 0, 1, 0, 2)  # image i has 5 + MORE[i % 5] captions: most 5, as COCO's (K = 5), a fifth 6 and a fifth 7
UNREADABLE = 3  # training images whose file is cut short (corrupt), spread over the split
RECIPE = ["experiment=captions_cpu", "trainer.max_epochs=2", "model.objective=scst", "model.scst.after_epochs=1"]


def write_set(folder: Path, train: int, val: int, test: int) -> Path:
    """The COCO-shaped set in ``folder`` (made once; a folder holding another set is refused by the generator):
    image i has 5 + ``MORE[i % 5]`` captions; ``UNREADABLE`` training images, evenly apart, are cut short
    (corrupt: skipped and counted while training). The captions file's path."""
    from captioner.config import ShapesSpec
    from captioner.data.shapes import generate_shapes
    from captioner.fileio import read_json

    captions = folder / CAPTIONS_FILE
    if captions.is_file():
        return captions
    shapes = generate_shapes(folder / "shapes", ShapesSpec(n_train=train, n_val=val, n_test=test))
    rows = []
    for i, image in enumerate(read_json(shapes / "dataset_shapes.json")["images"]):
        path = Path("shapes") / image["filepath"] / image["filename"]
        said = [sentence["raw"] for sentence in image["sentences"]]
        said += [form.format(said[k]) for k, form in enumerate(EXTRA[: MORE[i % len(MORE)]])]
        rows += [{"image": str(path), "caption": caption, "split": image["split"]} for caption in said]
        if image["split"] == "train" and i % max(1, train // UNREADABLE) == 1:
            file = folder / path
            file.write_bytes(file.read_bytes()[:64])
    partial = captions.with_suffix(".partial")
    with partial.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=["image", "caption", "split"])
        writer.writeheader()
        writer.writerows(rows)
    partial.replace(captions)
    return captions


def main(argv: list[str] | None = None) -> int:
    """Write the set, then run train.py on it; train.py's exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="where the set is written (once)")
    parser.add_argument("--train", type=int, default=600, help="training images (default: 600)")
    parser.add_argument("--val", type=int, default=60, help="validation images (default: 60)")
    parser.add_argument("--test", type=int, default=60, help="test images (default: 60)")
    args, overrides = parser.parse_known_args(argv)
    captions = write_set(args.folder.resolve(), args.train, args.val, args.test)
    command = [sys.executable, str(ROOT / "train.py"), *RECIPE, f"data.source.captions={captions}", *overrides]
    print("$ " + " ".join(command[1:]), flush=True)
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
