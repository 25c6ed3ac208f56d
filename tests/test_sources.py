"""Dataset sources: the built-in dataset's spec, COCO's split fallback, and each source's check of its own files."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from hydra.utils import instantiate

from captioner.config import ShapesSpec
from captioner.data.sources import CocoSource, Holds, KarpathySource, ShapesSource, SourcePath, check_paths
from captioner.errors import ConfigError
from captioner.training import preflight
from conftest import compose_plain, copy_dataset

HELP = "(see data/README.md for where dataset files go)"


def test_shapes_source_holds_the_spec_the_config_describes(tmp_path: Path) -> None:
    assert ShapesSource("data/shapes").spec == ShapesSpec()  # the built-in dataset's defaults: ShapesSpec's
    assert ShapesSource("data/shapes").spec == ShapesSpec(n_train=3000, n_val=250, n_test=250, image_size=96, seed=0)
    source = ShapesSource("data/shapes", n_train=5, image_size=48, seed=2)
    assert source.root == "data/shapes" and source.spec == ShapesSpec(n_train=5, image_size=48, seed=2)
    built = instantiate(compose_plain(["data=shapes"], tmp_path)["data"]["source"])  # as train.py builds it
    assert isinstance(built, ShapesSource) and built.spec == ShapesSpec()
    with pytest.raises(ConfigError, match="n_val=0 must be >= 1"):
        ShapesSource("data/shapes", n_val=0)


def test_shapes_source_takes_exactly_the_fields_of_shapes_spec() -> None:
    """ShapesSpec owns the built-in dataset's parameters: the source takes each by name and names the rest."""
    spec = ShapesSpec(n_train=7, n_val=3, n_test=2, image_size=40, seed=4, scenes="cluttered", width=64, height=48)
    given = {item.name: getattr(spec, item.name) for item in fields(ShapesSpec)}
    assert ShapesSource("r", **given).spec == spec
    with pytest.raises(ConfigError) as info:
        ShapesSource("r", n_trian=5)
    valid = ", ".join(item.name for item in fields(ShapesSpec))
    assert str(info.value) == f"data.source.n_trian is not a known key; valid keys: root, {valid}"


def test_shapes_source_generates_on_first_use_and_reads_each_split(tmp_path: Path) -> None:
    source = ShapesSource(str(tmp_path / "shapes"), n_train=4, n_val=2, n_test=3, image_size=32)
    check_paths(source.paths())  # nothing to check: the data is generated on first use
    assert not (tmp_path / "shapes").exists()
    source.prepare()
    assert [len(source.records(split)) for split in ("train", "val", "test")] == [4, 2, 3]
    assert [r.image_id for r in source.records("val")] == [5, 6]  # ids run on across the splits
    assert all(len(r.captions) == 5 and r.boxes and Path(r.image_path).is_file() for r in source.records("test"))
    with pytest.raises(ConfigError, match="split='restval' is not valid"):
        source.records("restval")


def _coco(root: Path, instances: bool = True) -> CocoSource:
    """A CocoSource over the tiny dataset's COCO files: train and val, no test (it falls back to val)."""
    annotations = root / "annotations"
    return CocoSource(
        {
            split: {
                "captions": str(annotations / f"captions_{split}.json"),
                "images": str(root / "images" / split),
                "instances": str(annotations / f"instances_{split}.json") if instances else None,
            }
            for split in ("train", "val")
        }
    )


def test_coco_source_reads_its_splits_and_falls_back_to_val_for_test(tiny_shapes: Path) -> None:
    source = _coco(tiny_shapes)
    check_paths(source.paths())
    source.prepare()
    assert len(source.records("train")) == 240 and all(r.boxes for r in source.records("train"))
    test, val = source.records("test"), source.records("val")
    assert [(r.image_id, r.image_path) for r in test] == [(r.image_id, r.image_path) for r in val]
    assert len(val) == 24 and {r.split for r in test} == {"test"}
    without = _coco(tiny_shapes, instances=False)
    check_paths(without.paths())  # instances: null is not a file to check
    assert not any(r.boxes for r in without.records("val"))
    with pytest.raises(ConfigError, match="data.source.splits has no 'test' entry"):
        CocoSource(source.splits, fallback={}).records("test")


@pytest.mark.parametrize(
    "damage,key,kind",
    [
        ("annotations/captions_val.json", "splits.val.captions", "file"),
        ("images/train", "splits.train.images", "folder"),
        ("annotations/instances_val.json", "splits.val.instances", "file"),
    ],
)
def test_coco_source_names_the_key_of_a_missing_file(
    damage: str, key: str, kind: str, tiny_shapes: Path, tmp_path: Path
) -> None:
    root = copy_dataset(tiny_shapes, tmp_path / "shapes", images=False)
    (root / "images" / "train").mkdir(parents=True)
    (root / "images" / "val").mkdir()
    source = _coco(root)
    check_paths(source.paths())
    target = root / damage
    if target.is_dir():
        target.rmdir()
    else:
        target.unlink()
    with pytest.raises(ConfigError) as info:
        check_paths(source.paths())
    assert str(info.value) == f"data.source.{key}='{target}': {kind} not found {HELP}"


def test_coco_source_refuses_a_file_for_a_folder_and_a_folder_for_a_file(tiny_shapes: Path, tmp_path: Path) -> None:
    root = copy_dataset(tiny_shapes, tmp_path / "shapes", images=False)
    (root / "images" / "val").mkdir(parents=True)
    (root / "images" / "train").write_text("not a folder")
    with pytest.raises(ConfigError) as info:
        check_paths(_coco(root).paths())
    assert str(info.value) == f"data.source.splits.train.images='{root / 'images' / 'train'}' is not a folder"
    source = _coco(root)
    source.splits["train"]["images"] = str(root / "images" / "val")
    source.splits["val"]["captions"] = str(root / "annotations")
    with pytest.raises(ConfigError) as info:
        check_paths(source.paths())
    assert str(info.value) == f"data.source.splits.val.captions='{root / 'annotations'}' is not a file"


def test_karpathy_source_names_the_key_of_a_missing_or_wrong_path(tiny_shapes: Path, tmp_path: Path) -> None:
    split_file, images = tiny_shapes / "dataset_shapes.json", tiny_shapes / "images"
    check_paths(KarpathySource(str(split_file), str(images)).paths())
    cases = [
        (
            KarpathySource(str(tmp_path / "no.json"), str(images)),
            f"data.source.split_file='{tmp_path / 'no.json'}': file not found {HELP}",
        ),
        (KarpathySource(str(images), str(images)), f"data.source.split_file='{images}' is not a file"),
        (
            KarpathySource(str(split_file), str(tmp_path / "none")),
            f"data.source.image_root='{tmp_path / 'none'}': folder not found {HELP}",
        ),
        (KarpathySource(str(split_file), str(split_file)), f"data.source.image_root='{split_file}' is not a folder"),
    ]
    for source, message in cases:
        with pytest.raises(ConfigError) as info:
            check_paths(source.paths())
        assert str(info.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["data=coco"],
        ["data=flickr8k"],
        ["data=coco_karpathy", "data.source.split_file={tmp}"],
        ["data=coco_karpathy", "data.source.split_file={tmp}/file.txt"],
        ["data=flickr30k", "data.source.split_file={tmp}/file.txt", "data.source.image_root={tmp}/file.txt"],
        ["data.source.root={tmp}/file.txt"],
    ],
)
def test_preflight_reports_what_the_source_finds_by_its_key(overrides: list[str], tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("x")
    plain = compose_plain([o.format(tmp=tmp_path) for o in overrides], tmp_path)
    source = instantiate(plain["data"]["source"])
    with pytest.raises(ConfigError) as expected:
        check_paths(source.paths())
    found = [str(problem) for problem in preflight.problems(plain)]
    key = str(expected.value).split("=")[0]  # data.source.<the key the source refuses>
    assert any(line.startswith(key) for line in found), (key, found)
    assert all(line.startswith(("data.source.", "trainer.", "model.")) for line in found)


@dataclass
class PairSource:
    """A source that preflight knows nothing of: its two paths are its own."""

    captions: str
    images: str

    def paths(self) -> list[SourcePath]:
        return [
            SourcePath("captions", self.captions, "file", Holds.annotations),
            SourcePath("images", self.images, "folder", Holds.images),
        ]


def test_preflight_reports_every_missing_path_of_any_source_from_the_source_s_own_list(tmp_path: Path) -> None:
    plain = compose_plain([], tmp_path)
    (tmp_path / "images").write_text("not a folder")
    captions, images = tmp_path / "captions.json", tmp_path / "images"
    plain["data"]["source"] = {"_target_": "test_sources.PairSource", "captions": str(captions), "images": str(images)}
    found = [str(problem) for problem in preflight.problems(plain)]
    assert [line.split(";")[0] for line in found] == [
        f"data.source.captions='{captions}': file not found",
        f"data.source.images='{images}' is not a folder",
    ]
    with pytest.raises(ConfigError) as info:
        check_paths(instantiate(plain["data"]["source"]).paths())
    assert str(info.value) == f"data.source.captions='{captions}': file not found {HELP}"


@pytest.mark.parametrize(
    "overrides,folder",
    [
        ([], "shapes"),  # the demo's set: data/shapes, as ever
        (["data.source.n_train=64", "data.source.n_val=16", "data.source.n_test=16"], "shapes_64_16_16"),
        (["data.source.n_val=16"], "shapes_3000_16_250"),  # every size, given or not: the name says them all
        (["data.source.seed=3", "data.source.image_size=48"], "shapes_3000_250_250_image_size-48_seed-3"),
        (["data=scenes"], "scenes"),
        (["data=scenes", "data.source.n_train=64"], "scenes_64_200_200"),
        (["data.source.n_train=64", "data.source.root={tmp}/mine"], "{tmp}/mine"),  # a root given is the root
    ],
)
def test_a_set_of_other_parameters_goes_to_a_folder_of_its_own(
    overrides: list[str], folder: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    plain = compose_plain([f"paths.data_dir={data}", *(o.format(tmp=tmp_path) for o in overrides)], tmp_path)
    expected = folder.format(tmp=tmp_path) if folder.startswith("{tmp}") else str(data / folder)
    assert plain["data"]["source"]["root"] == expected
    assert instantiate(plain["data"]["source"]).root == expected


def test_a_small_trial_set_leaves_the_demo_s_folder_to_the_demo(tmp_path: Path) -> None:
    data = tmp_path / "data"
    sizes = ["data.source.n_train=4", "data.source.n_val=2", "data.source.n_test=2", "data.source.image_size=32"]
    trial = instantiate(compose_plain([f"paths.data_dir={data}", *sizes], tmp_path)["data"]["source"])
    trial.prepare()
    demo = instantiate(compose_plain([f"paths.data_dir={data}"], tmp_path)["data"]["source"])
    assert not Path(demo.root).exists() and demo.spec == ShapesSpec()  # generated there on first use, untouched
    assert [p.name for p in data.iterdir()] == ["shapes_4_2_2_image_size-32"]
