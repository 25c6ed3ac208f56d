"""docs/datasets.md works as written: a tiny tree in its exact COCO layout goes through its exact commands."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.data.shapes import shapes_records
from captioner.data.vocab import tokenize
from captioner.model.pretrained import weight_file
from conftest import ROOT, compose_plain, subprocess_env

GUIDE = ROOT / "docs" / "datasets.md"
# Only what makes the run tiny: a small random-weights encoder and decoder, 64 px, one epoch, on the CPU.
TINY_RUN = [
    "trainer=cpu",
    "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false",
    "model.encoder.name=resnet18",
    "model.encoder.weights=null",
    "model.encoder.grid=2",
    "model.decoder.embed_dim=16",
    "model.decoder.hidden_dim=16",
    "model.decoder.attention_dim=16",
    "model.decoding.beam_size=1",
    "data.image_size=64",
    "data.batch_size=16",
    "data.eval_batch_size=16",
    "data.num_workers=0",
    "data.min_word_count=1",
]
# The coco-caption suite (METEOR's java start is most of an evaluation this small) is test_cli_evaluate's to run.
TINY_EVALUATE = ["--max-len", "4", "--workers", "0", "--method", "greedy", "--no-coco"]
SPLIT_SIZES = {"train": 40, "restval": 8, "val": 8, "test": 8}


def guide_commands(start: str) -> list[str]:
    """The lines of the guide's command blocks that start with ``start``, their comments cut off."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(start)]


def write_coco_tree(tiny_shapes: Path, data: Path) -> int:
    """The guide's layout under ``data``: data/karpathy/dataset_coco.json and JPEGs in data/coco/train2014 and
    val2014 named as COCO names them, from the tiny shapes dataset. Returns the number of training images."""
    records = shapes_records(tiny_shapes, "train")
    entries, start = [], 0
    for split, count in SPLIT_SIZES.items():
        folder = "train2014" if split == "train" else "val2014"  # Karpathy's val, test and restval are val2014's
        for record in records[start : start + count]:
            name = f"COCO_{folder}_{record.image_id:012d}.jpg"
            (data / "coco" / folder).mkdir(parents=True, exist_ok=True)
            Image.open(record.image_path).convert("RGB").save(data / "coco" / folder / name)
            sentences = [{"tokens": tokenize(c), "raw": c} for c in record.captions]
            entry = {"filepath": folder, "filename": name, "cocoid": record.image_id, "imgid": len(entries)}
            entries.append({**entry, "split": split, "sentences": sentences})
        start += count
    (data / "karpathy").mkdir(parents=True)
    (data / "karpathy" / "dataset_coco.json").write_text(json.dumps({"dataset": "coco", "images": entries}))
    return SPLIT_SIZES["train"] + SPLIT_SIZES["restval"]


def test_the_guide_names_the_files_the_coco_recipe_reads(tmp_path: Path) -> None:
    from torchvision.models import get_model_weights

    plain = compose_plain(["experiment=coco_soft"], tmp_path)
    encoder = plain["model"]["encoder"]
    weights = get_model_weights(encoder["name"])[encoder["weights"]]
    text = GUIDE.read_text()
    assert f"`model.encoder.weights: {encoder['weights']}` (with `model.encoder.name: {encoder['name']}`)" in text
    assert weights.url in text and f"$TORCH_HOME/hub/checkpoints/{Path(weight_file(weights)).name}" in text
    source = plain["data"]["source"]
    assert (
        source["split_file"] == f"{ROOT}/data/karpathy/dataset_coco.json"
        and source["image_root"] == f"{ROOT}/data/coco"
    )
    assert "`data/karpathy/dataset_coco.json`" in text and "data/coco/train2014/COCO_train2014_*.jpg" in text


@pytest.mark.slow
def test_a_tiny_coco_tree_goes_through_the_guide(tiny_shapes: Path, tmp_path: Path) -> None:
    n_train = write_coco_tree(tiny_shapes, tmp_path / "data")
    (train,) = [c for c in guide_commands("python train.py experiment=coco_soft") if "feature_cache" in c]
    command = [sys.executable, str(ROOT / "train.py"), *shlex.split(train)[2:], *TINY_RUN]
    env = subprocess_env()
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = (tmp_path / "outputs" / "coco_soft" / "runs").iterdir()  # where the guide says
    assert (run / "bundle.pt").is_file()
    (cache,) = (tmp_path / "data" / "cache" / "coco").glob("train-*")
    features = np.load(cache / "features.npy", mmap_mode="r")  # images x grid cells x channels, float16
    assert features.shape == (n_train, 2 * 2, 512) and features.dtype == np.float16

    (evaluate,) = guide_commands("captioner evaluate --model outputs/coco_soft")
    args = shlex.split(evaluate.replace("<run>", run.name))[1:]
    script = "import sys; from captioner.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", script, *args, *TINY_EVALUATE]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "coco_soft" / "metrics.json").read_text())
    assert metrics["images"] == SPLIT_SIZES["test"] and 0.0 <= metrics["bleu"]["bleu4"] <= 1.0


def anchors(markdown: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown`` (outside code blocks): lower case, punctuation
    dropped (backticks, colons, ``=``), spaces as hyphens."""
    found, fenced = set(), False
    for line in markdown.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = re.match(r"#{1,6} (.+)$", line)
        if heading and not fenced:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


def _anchors() -> set[str]:
    """The anchors of the guide's sections."""
    return anchors(GUIDE)


def test_every_section_a_preflight_problem_can_link_to_is_in_the_guide() -> None:
    from captioner.training.preflight import Problem, Section

    assert {section.value for section in Section} <= _anchors()
    assert str(Problem("what", "remedy", "gpu")).endswith("(docs/datasets.md#gpu)")
    with pytest.raises(ValueError, match="'no-such-section' is not a valid Section"):
        Problem("what", "remedy", "no-such-section")


def test_every_link_to_a_section_that_the_program_configs_and_docs_write_has_its_section() -> None:
    """Messages link to sections of the docs (preflight's, a run with no decodable image, a captions file's
    errors), and so do the configs' comments, the README and the docs: each ``FILE.md#anchor`` (``#anchor`` in
    a markdown link: the page itself) is a heading of its file. A file named in a message is relative to the
    checkout, one in a markdown link to the page's folder."""
    texts = [*(ROOT / "captioner").rglob("*.py"), ROOT / "train.py", *(ROOT / "conf").rglob("*.yaml")]
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    links = []
    for path in texts + pages:
        text = path.read_text()
        for target, anchor in re.findall(r"([\w./-]+\.md)#([\w-]+)", text):
            base = path.parent if path in pages else ROOT
            links.append((path, base / target, anchor))
        if path in pages:
            links += [(path, path, anchor) for anchor in re.findall(r"\]\(#([\w-]+)\)", text)]
    assert {(path.name, anchor) for path, _, anchor in links} >= {
        ("module.py", "images"),  # none of these may fall out of the search unseen (preflight's: the test above)
        ("captions_file.py", "your-own-images"),
        ("README.md", "images"),
        ("performance.md", "commands"),
    }
    broken = [
        f"{path.relative_to(ROOT)}: {target.relative_to(ROOT)}#{anchor}"
        for path, target, anchor in links
        if not target.is_file() or anchor not in anchors(target)
    ]
    assert not broken, broken


def test_every_project_file_and_config_the_guide_names_exists() -> None:
    """The guide points at the project's own files and configs only where they are (a renamed script, config
    or module breaks this test, not a reader's copy-paste)."""
    text = GUIDE.read_text()
    named = set(re.findall(r"`((?:captioner|conf|docs|benchmarks|tests)/[^`\s]*)`", text))
    assert {"benchmarks/train_step.py", "conf/data/*.yaml"} <= named
    assert all(any(ROOT.glob(path)) for path in named), [path for path in named if not any(ROOT.glob(path))]
    options = set(re.findall(r"(?<![\w.])(data|experiment|trainer|model|logger)=(\w+)", text))
    assert ("experiment", "coco_soft") in options
    missing = [f"{group}={name}" for group, name in options if not (ROOT / "conf" / group / f"{name}.yaml").is_file()]
    assert missing == []


def test_the_guide_s_split_commands_write_what_the_dataset_configs_read(tmp_path: Path) -> None:
    from captioner import cli
    from captioner.data.split_files import karpathy_coco_ids

    annotations = tmp_path / "data" / "coco" / "annotations"
    annotations.mkdir(parents=True)
    for folder, ids in (("train2014", [1, 2]), ("val2014", [*karpathy_coco_ids("val")[:2], 3])):
        images = [{"id": i, "file_name": f"COCO_{folder}_{i:012d}.jpg"} for i in ids]
        captions = [{"id": i, "image_id": i, "caption": "A dog."} for i in ids]
        (annotations / f"captions_{folder}.json").write_text(json.dumps({"images": images, "annotations": captions}))
    text = tmp_path / "data" / "flickr8k" / "text"
    text.mkdir(parents=True)
    (text / "Flickr8k.token.txt").write_text("".join(f"{n}.jpg#0\tA dog .\n" for n in "abc"))
    for split, name in (("train", "a"), ("dev", "b"), ("test", "c")):
        (text / f"Flickr_8k.{split}Images.txt").write_text(f"{name}.jpg\n")
    (coco,) = guide_commands("captioner splits coco")
    (flickr8k,) = guide_commands("captioner splits flickr8k")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert cli.main([*shlex.split(coco)[1:], "--partial"]) == 0  # a tiny COCO: a few of the listed images
        assert cli.main(shlex.split(flickr8k)[1:]) == 0
    for dataset in ("coco_karpathy", "flickr8k"):
        source = compose_plain([f"data={dataset}", f"paths.data_dir={tmp_path / 'data'}"], tmp_path)["data"]["source"]
        assert Path(source["split_file"]).is_file(), dataset
