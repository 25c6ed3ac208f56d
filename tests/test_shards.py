"""Training streamed from WebDataset tar shards (``data=webdataset``): shard sizes from ``_stats.json`` or counted,
captions from txt or json, each sample read once an epoch over ranks x workers with the same number of batches on
every rank, the epoch's order reproduced on resume, the vocabulary streamed, and a tiny run of ``train.py``.

    python tests/test_shards.py PATTERN OUT_FOLDER   # what the two-process test runs: 2 gloo ranks x 2 workers
"""

from __future__ import annotations

import functools
import io
import json
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader

from captioner.config import DataConfig, ModelConfig, from_dict
from captioner.data.dataset import build_transform, collate
from captioner.data.shapes import shapes_records
from captioner.data.shards import (
    WebDatasetSource,
    count_samples,
    epoch_plan,
    list_shards,
    stats_url,
)
from captioner.data.sources import ShapesSource
from captioner.data.stream import PADDING, ShardStream
from captioner.data.vocab import Vocabulary
from captioner.errors import ConfigError, DataError
from captioner.training.datamodule import CaptionDataModule
from captioner.training.module import CaptionerModule
from captioner.training.preflight import problems
from captioner.training.validate import validate_config
from conftest import ROOT, SMALL_NET, TINY, compose_plain, logged, run_train, subprocess_env, tiny_overrides

SIZES = (17, 9, 14, 5, 15)  # samples per shard: uneven, as img2dataset's are (its failures are left out)
STATED = (0, 1, 2)  # the shards written with a _stats.json; the others are counted from their members
CORRUPT = 7  # the sample whose jpg is truncated
IMAGE_SIZE = 32
BATCH = 4
STEPS = 2  # training steps an epoch in the resume test


def sample_captions(record_captions: tuple[str, ...], position: int) -> list[str]:
    """1 to 7 captions for the image at ``position``: its own five, cycled."""
    return [record_captions[k % len(record_captions)] for k in range(1 + position % 7)]


def jpeg(path: str) -> bytes:
    """The image at ``path`` as JPEG bytes."""
    out = io.BytesIO()
    Image.open(path).convert("RGB").save(out, format="JPEG", quality=95)
    return out.getvalue()


def write_shards(tiny_shapes: Path, folder: Path) -> list[list[str]]:
    """``SIZES`` shards of the tiny set's first training images in img2dataset's layout (``ShardWriter``); returns
    every sample's captions, in order. Even samples carry their captions as a json list, odd ones as txt lines,
    sample 3 as a json ``caption``; sample ``CORRUPT``'s jpg is cut short."""
    folder.mkdir()
    records = shapes_records(tiny_shapes, "train")
    written: list[list[str]] = []
    with wds.ShardWriter(str(folder / "%05d.tar"), maxcount=10**6, verbose=0) as writer:
        for shard, size in enumerate(SIZES):
            if shard:
                writer.next_stream()
            for _ in range(size):
                position = len(written)
                captions = sample_captions(records[position].captions, position)
                sample = {"__key__": f"{position:09d}"}
                image = jpeg(records[position].image_path)
                sample["jpg"] = image[: len(image) // 3] if position == CORRUPT else image  # cut short: corrupt
                if position == 3:
                    captions = captions[:1]
                    sample["json"] = json.dumps({"caption": captions[0], "key": sample["__key__"]}).encode()
                elif position % 2 == 0:
                    sample["json"] = json.dumps({"captions": captions, "key": sample["__key__"]}).encode()
                else:
                    sample["txt"] = "\n".join(captions).encode()
                writer.write(sample)
                written.append(captions)
    for shard in STATED:
        (folder / f"{shard:05d}_stats.json").write_text(json.dumps({"successes": SIZES[shard], "failures": 3}))
    return written


@pytest.fixture(scope="module")
def shards(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[str]]]:
    """The shards' brace pattern and every sample's captions."""
    folder = tmp_path_factory.mktemp("shards") / "set"
    captions = write_shards(tiny_shapes, folder)
    return f"{folder}/{{00000..{len(SIZES) - 1:05d}}}.tar", captions


def source(pattern: str, tiny_shapes: Path, **given: object) -> WebDatasetSource:
    """The shards as a source, with the tiny built-in set's val and test."""
    held_out = {"_target_": f"{ShapesSource.__module__}.ShapesSource", "root": str(tiny_shapes), **asdict(TINY)}
    return WebDatasetSource(train=pattern, eval_source=held_out, **given)


def test_shard_sizes_come_from_stats_or_from_counting_members(shards: tuple[str, list]) -> None:
    pattern, _ = shards
    listed = list_shards(pattern)
    assert [shard.size for shard in listed] == list(SIZES)
    assert [shard.offset for shard in listed] == [0, 17, 26, 40, 45]
    assert count_samples(listed[4].url) == SIZES[4]
    # a stats file that says otherwise is believed: it is what img2dataset wrote, and reading it costs nothing
    stats = Path(stats_url(listed[0].url))
    stats.write_text(json.dumps({"successes": 99}))
    try:
        assert list_shards(pattern)[0].size == 99
    finally:
        stats.write_text(json.dumps({"successes": SIZES[0]}))
    assert stats_url("pipe:aws s3 cp s3://b/cc3m/00012.tar -") == "pipe:aws s3 cp s3://b/cc3m/00012_stats.json -"


def test_a_pipe_command_that_fails_is_named_with_its_exit_status(tmp_path: Path) -> None:
    url = f"pipe:exit 3 {tmp_path}/00000.tar"
    with pytest.raises(DataError) as info:
        count_samples(url)
    assert str(info.value) == f"{url}: cannot read the shard (the command exited with status 3)"


def test_epoch_plan_covers_every_sample_once_in_even_runs_and_changes_by_epoch(shards: tuple[str, list]) -> None:
    listed = list_shards(shards[0])
    total = sum(SIZES)
    orders = []
    for epoch in range(3):
        plan = epoch_plan(listed, epoch, seed=0, readers=4)
        runs = [[piece.shard.offset + piece.skip + i for piece in run for i in range(piece.take)] for run in plan]
        assert sorted(i for run in runs for i in run) == list(range(total))
        assert {len(run) for run in runs} <= {total // 4, total // 4 + 1}
        assert plan == epoch_plan(listed, epoch, seed=0, readers=4)  # the same epoch, the same plan
        orders.append([piece.shard.url for run in plan for piece in run])
    assert len({tuple(order) for order in orders}) > 1


def test_too_few_shards_for_the_readers_is_one_config_error(shards: tuple[str, list], tiny_shapes: Path) -> None:
    built = source(shards[0], tiny_shapes)
    vocab = Vocabulary(["a"])
    with pytest.raises(ConfigError, match=r"has 5 shards for 2 ranks x 3 loader workers = 6 readers; give at least"):
        ShardStream.of(
            built, vocab, build_transform(IMAGE_SIZE, train=True), max_len=8, batch_size=2, rank=0, ranks=2, workers=3
        )


def test_preflight_names_a_missing_shard_and_the_evaluation_source_s_files(
    shards: tuple[str, list], tiny_shapes: Path, tmp_path: Path
) -> None:
    pattern = shards[0].replace("{00000..00004}", "{00000..00005}")  # one shard more than there are
    found = [str(p) for p in problems(compose_plain(["data=webdataset", f"data.source.train='{pattern}'"], tmp_path))]
    missing = pattern.replace("{00000..00005}", "00005")
    assert any(line.startswith(f"data.source.train='{missing}': file not found") for line in found), found
    assert any(line.startswith("data.source.eval_source.split_file=") for line in found), found
    assert not any("00004.tar" in line for line in found)
    with_shapes = [
        "data=webdataset",
        f"data.source.train='{shards[0]}'",
        "~data.source.eval_source",
        f"+data.source.eval_source={{_target_:captioner.data.sources.ShapesSource,root:'{tiny_shapes}'}}",
    ]
    assert not [str(p) for p in problems(compose_plain(with_shapes, tmp_path)) if "data.source" in str(p)]
    # too few shards for the readers: found before the run's folder exists, not by the first epoch's loader
    for readers, given in ((6, ["data.num_workers=6"]), (6, ["trainer=ddp_cpu", "data.num_workers=3"])):
        found = [str(p) for p in problems(compose_plain([*with_shapes, *given], tmp_path))]
        ranks = 2 if "trainer=ddp_cpu" in given else 1
        assert found == [
            f"data.source.train has 5 shards for {ranks} ranks x {readers // ranks} loader workers = {readers} "
            "readers; give at least as many shards as readers (more shards, fewer data.num_workers or fewer devices) "
            "(docs/datasets.md#webdataset-shards-datawebdataset)"
        ], found
    assert not problems(compose_plain([*with_shapes, "trainer=ddp_cpu", "data.num_workers=2"], tmp_path))


@pytest.mark.parametrize(
    ("override", "refused"),
    [
        ("data.per_caption=true", "data=webdataset streams whole images"),
        ("data.feature_cache=/tmp/cache", "data=webdataset streams whole images"),
        ("model.objective=scst", "model.objective=scst needs every training caption as a reference"),
    ],
)
def test_what_a_stream_cannot_do_is_refused_before_the_run(override: str, refused: str, tmp_path: Path) -> None:
    cfg = compose_plain(["experiment=coco_soft", "data=webdataset", override], tmp_path)
    with pytest.raises(ConfigError, match=refused):
        validate_config(cfg)


def test_vocabulary_streams_from_the_shards_captions(shards: tuple[str, list], tiny_shapes: Path) -> None:
    pattern, captions = shards
    built = source(pattern, tiny_shapes)
    assert list(built.captions()) == captions
    # the same through pipe: commands, which webdataset opens
    piped = source(f"pipe:cat {pattern}", tiny_shapes)
    assert [shard.size for shard in piped.shards] == list(SIZES)
    assert list(piped.captions()) == captions
    settings = from_dict(DataConfig, {"image_size": IMAGE_SIZE, "min_word_count": 2, "max_vocab": None})
    datamodule = CaptionDataModule(built, settings)
    datamodule.setup("fit")
    expected = Vocabulary.build((c for sample in captions for c in sample), min_count=2)
    assert datamodule.vocab == expected and len(expected) > 10
    assert datamodule.splits["train"] == [] and len(datamodule.splits["val"]) == 24


def test_captions_that_are_not_text_with_a_word_are_left_out_and_counted(
    tiny_shapes: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A null or a number in the json's list, a txt in Windows-1252, blank and punctuation-only lines: before, they
    # trained as "None", "3", "caf<U+FFFD> au lait" (tokenised "caf", "au", "lait") and <start> <end>.
    samples = [
        {"json": json.dumps({"captions": ["A dog.", None, "...", 3]}).encode()},
        {"txt": "caf\u00e9 au lait\n".encode("cp1252")},
        {"txt": b"a cat\n\n - \n"},
        {"json": json.dumps({"caption": ""}).encode()},
    ]
    with wds.TarWriter(str(tmp_path / "00000.tar")) as writer:
        for key, sample in enumerate(samples):
            writer.write({"__key__": f"{key:09d}", "jpg": b"x", **sample})
    built = source(str(tmp_path / "00000.tar"), tiny_shapes)
    with caplog.at_level("WARNING", logger="captioner.data.shards"):
        assert list(built.captions()) == [["A dog."], [], ["a cat"], []]
    shard = tmp_path / "00000.tar"
    assert caplog.messages == [
        f"6 captions of the shards left out (not text, not UTF-8, empty, or without a word): {shard}#000000000 None; "
        f"{shard}#000000000 '...'; {shard}#000000000 3; {shard}#000000001 b'caf\\xe9 au lait'; {shard}#000000002 ' - ' "
        "and 1 more"
    ]


def test_a_single_process_reads_every_sample_once_with_padding_to_whole_batches(
    shards: tuple[str, list], tiny_shapes: Path
) -> None:
    pattern, captions = shards
    vocab = Vocabulary.build(c for sample in captions for c in sample)
    stream = ShardStream.of(
        source(pattern, tiny_shapes, shuffle_buffer=8),
        vocab,
        build_transform(IMAGE_SIZE, train=True),
        max_len=16,
        batch_size=BATCH,
        rank=0,
        ranks=1,
        workers=0,
    )
    assert len(stream) == 60  # 60 samples: 15 whole batches, no padding
    items = list(stream)
    assert len(items) == 60
    read = [item for item in items if isinstance(item, dict)]
    (skipped,) = [item for item in items if not isinstance(item, dict)]
    assert skipped.path.endswith(f"00000.tar#{CORRUPT:09d}.jpg") and "corrupt" in skipped.reason
    assert sorted(item["index"] for item in read) == [i for i in range(60) if i != CORRUPT]
    for item in read:
        assert item["image"].shape == (3, IMAGE_SIZE, IMAGE_SIZE)
        assert item["image_id"] == item["index"]  # the keys are the positions, as digits
        assert [vocab.decode(c.tolist()) for c in item["captions"]] == [
            vocab.decode(vocab.encode(c, 16)) for c in captions[item["index"]]
        ]
    stream.set_epoch(1)
    again = [item["index"] for item in stream if isinstance(item, dict)]
    assert sorted(again) == sorted(item["index"] for item in read) and again != [item["index"] for item in read]
    # 3 readers: 20 samples each, padded to 5 batches of 4 = 20: no padding; batch 3: 21 items, one padding each
    three = ShardStream.of(
        source(pattern, tiny_shapes),
        vocab,
        build_transform(IMAGE_SIZE, train=True),
        max_len=16,
        batch_size=3,
        rank=0,
        ranks=3,
        workers=0,
    )
    assert len(three) == 21 and list(three)[-1] is PADDING


def test_a_shard_cut_short_is_warned_about_once_and_read_up_to_the_break(
    shards: tuple[str, list], tiny_shapes: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A download cut off: shard 1's tar truncated mid-member; its _stats.json still says 9 samples.
    pattern, captions = shards
    folder = Path(pattern).parent
    for shard in (0, 1):
        data = (folder / f"{shard:05d}.tar").read_bytes()
        (tmp_path / f"{shard:05d}.tar").write_bytes(data if shard == 0 else data[: len(data) // 2 + 100])
        (tmp_path / f"{shard:05d}_stats.json").write_text(json.dumps({"successes": SIZES[shard]}))
    built = source(f"{tmp_path}/{{00000..00001}}.tar", tiny_shapes, shuffle_buffer=1)
    with caplog.at_level("WARNING", logger="captioner.data.shards"):
        read = list(built.captions())  # the vocabulary's pass: a traceback from tarfile before
    kept = len(read) - SIZES[0]
    assert 0 < kept < SIZES[1] and read == captions[: len(read)]
    broken = f"{tmp_path}/00001.tar: the shard breaks off (unexpected end of data): its samples up to there are read"
    assert caplog.messages == [broken]
    caplog.clear()
    vocab = Vocabulary.build(c for sample in read for c in sample)
    stream = ShardStream.of(
        built, vocab, build_transform(IMAGE_SIZE, train=False), max_len=16, batch_size=BATCH, rank=0, ranks=1, workers=0
    )
    with caplog.at_level("WARNING", logger="captioner.data.shards"):
        items = list(stream)
    assert caplog.messages == [broken]
    assert len(items) == len(stream) == 28 and items[-(SIZES[1] - kept) :] == [PADDING] * (SIZES[1] - kept)
    assert sorted(item["index"] for item in items if isinstance(item, dict)) == [
        index for index in range(len(read)) if index != CORRUPT
    ]


def read_ranks(pattern: str, out: Path) -> None:
    """Two gloo ranks, each through a loader of two persistent workers as ``CaptionDataModule._loader`` builds
    it, read two epochs of the shards; every batch all-reduces, so ranks with unequal batch counts would hang.
    Writes ``rank<r>.json``: per epoch the indices and skipped names of each batch, and the loader's length."""
    torch.multiprocessing.start_processes(_rank, args=(pattern, str(out)), nprocs=2, start_method="fork")


def _rank(rank: int, pattern: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    built = WebDatasetSource(train=pattern, eval_source=ShapesSource(out), shuffle_buffer=4)
    vocab = Vocabulary.build(c for sample in built.captions() for c in sample)
    stream = ShardStream.of(
        built,
        vocab,
        build_transform(IMAGE_SIZE, train=True),
        max_len=16,
        batch_size=BATCH,
        rank=rank,
        ranks=2,
        workers=2,
    )
    loader = DataLoader(
        stream,
        batch_size=BATCH,
        collate_fn=functools.partial(collate, pad_to=None),
        num_workers=2,
        persistent_workers=True,
    )
    epochs = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        batches = []
        for batch in loader:
            dist.all_reduce(torch.ones(1))
            batches.append(
                {"indices": batch["indices"].tolist(), "skipped": [(s.path, s.reason) for s in batch["skipped"]]}
            )
        epochs.append({"batches": batches, "length": len(loader)})
    Path(out, f"rank{rank}.json").write_text(json.dumps(epochs))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_of_two_workers_read_every_sample_once_an_epoch_in_equal_batches(
    shards: tuple[str, list], tmp_path: Path
) -> None:
    pattern, _ = shards
    subprocess.run(
        [sys.executable, str(Path(__file__)), pattern, str(tmp_path)],
        cwd=ROOT,
        env=subprocess_env(),
        check=True,
        timeout=180,
        capture_output=True,
    )
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    orders = []
    for epoch in range(2):
        seen = Counter(i for rank in ranks for batch in rank[epoch]["batches"] for i in batch["indices"])
        assert seen == Counter(i for i in range(60) if i != CORRUPT)  # every readable sample exactly once
        skipped = [s for rank in ranks for batch in rank[epoch]["batches"] for s in batch["skipped"]]
        corrupt = [path for path, reason in skipped if reason != PADDING.reason]
        assert len(corrupt) == 1 and corrupt[0].endswith(f"#{CORRUPT:09d}.jpg")
        # 60 samples over 4 readers: 15 each, padded to 4 batches of 4: one padding item per reader
        assert sum(reason == PADDING.reason for _, reason in skipped) == 4
        assert [len(rank[epoch]["batches"]) for rank in ranks] == [8, 8] == [rank[epoch]["length"] for rank in ranks]
        orders.append([i for rank in ranks for batch in rank[epoch]["batches"] for i in batch["indices"]])
    assert orders[0] != orders[1]  # the epoch reached the persistent workers: another order


class Seen(L.Callback):
    """The indices of every training batch, by epoch."""

    def __init__(self) -> None:
        self.epochs: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: dict, index: int) -> None:
        self.epochs.setdefault(trainer.current_epoch, []).extend(batch["indices"].tolist())


def fit(built: WebDatasetSource, root: Path, epochs: int, ckpt_path: str | None = None) -> tuple[Seen, L.Trainer]:
    """A tiny captioner (a frozen CNN) fitted on the shards' first ``STEPS`` batches of each of ``epochs`` epochs
    (from ``ckpt_path`` when given), a checkpoint each epoch under ``root``."""
    settings = {"image_size": IMAGE_SIZE, "batch_size": BATCH, "num_workers": 1, "max_vocab": None, "max_len": 16}
    datamodule = CaptionDataModule(built, from_dict(DataConfig, {**settings, "min_word_count": 1}))
    datamodule.setup("fit")
    torch.manual_seed(0)
    encoder = {"name": "resnet18", "weights": None, "stage": "layer1", "grid": 2, "trainable_stages": 0}
    net = {**SMALL_NET, "encoder": encoder, "feature_norm": False}
    model = from_dict(ModelConfig, {**net, "objective": "cross_entropy", "scheduler": {"name": "none"}})
    seen = Seen()
    trainer = L.Trainer(
        max_epochs=epochs,
        limit_train_batches=STEPS,
        limit_val_batches=0,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[seen, L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)],
    )
    trainer.fit(CaptionerModule(datamodule.vocab, model), datamodule=datamodule, ckpt_path=ckpt_path)
    return seen, trainer


@pytest.mark.slow
def test_a_resumed_run_reads_the_epoch_it_resumes_in_the_same_order(
    shards: tuple[str, list], tiny_shapes: Path, tmp_path: Path
) -> None:
    built = source(shards[0], tiny_shapes, shuffle_buffer=4)
    straight, trainer = fit(built, tmp_path / "straight", epochs=2)
    assert len(trainer.train_dataloader) == 15  # 60 samples, 4 a batch: the epoch's length as Lightning reads it
    assert sorted(straight.epochs[0]) != sorted(straight.epochs[1])  # another shard order: other samples first
    (first,) = (tmp_path / "straight").glob("epoch=0-*.ckpt")
    resumed, trainer = fit(built, tmp_path / "resumed", epochs=2, ckpt_path=str(first))
    assert list(resumed.epochs) == [1] and resumed.epochs[1] == straight.epochs[1]
    assert trainer.global_step == 2 * STEPS


@pytest.mark.slow
def test_train_py_trains_from_shards_with_the_built_in_set_for_validation(
    shards: tuple[str, list], tiny_shapes: Path, tmp_path: Path
) -> None:
    pattern, _ = shards
    base = [o for o in tiny_overrides(tiny_shapes, tmp_path) if not o.startswith("data.source.")]
    run = run_train(
        [
            *base,
            "data=webdataset",
            f"data.source.train='{pattern}'",
            "~data.source.eval_source",
            "+data.source.eval_source={_target_:captioner.data.sources.ShapesSource,"
            + ",".join([f"root:'{tiny_shapes}'", *(f"{k}:{v}" for k, v in asdict(TINY).items())])
            + "}",
            f"data.image_size={IMAGE_SIZE}",
            "data.min_word_count=1",
            "data.max_vocab=null",
            "data.max_len=16",
            "data.num_workers=1",
            "data.recipe=null",  # the demo's small model, on these shards
            "model.encoder.weights=null",
            "model.objective=cross_entropy",
            "trainer.max_epochs=1",
            "trainer.log_every_n_steps=1",
            "test=false",
        ]
    )
    losses = logged(tmp_path / "run", "train/loss")
    assert sorted(losses) == [0, 1, 2, 3] and all(loss > 0 for loss in losses.values())  # 60 samples: 4 batches of 16
    assert "skipped 1 unreadable image: " in run.stdout and f"#{CORRUPT:09d}.jpg" in run.stdout  # not the padding
    assert "final/val/bleu4" in json.loads((tmp_path / "run" / "metrics.json").read_text())


if __name__ == "__main__":
    read_ranks(sys.argv[1], Path(sys.argv[2]))
