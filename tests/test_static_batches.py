"""Training batches of one shape whatever the data (issue 44): K captions per image (``collate``'s
``captions_per_image``: drawn when an image has more, repeated with weight 0 when it has fewer, untouched when it
has K), masked rows for unreadable images and an epoch's last, smaller batch; the ranks agree on replay versus
eager (``GraphedSteps.agree``); under DDP each step's loss is the global batch's, as one process takes it.

The COCO-shaped set: 16 small images with 5 to 7 captions each, one corrupt file and one missing, trained with
``model.graphs``' steps run uncaptured (``EagerReplays``) by one process and by two (gloo), each run in a
subprocess with its own timeout, so that a hang fails.

    python tests/test_static_batches.py OUT.json --devices 2 --set coco   # what the two-process tests run
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from PIL import Image
from test_ddp import ddp_module
from torch.utils.data import DataLoader, DistributedSampler

from captioner.config import DataConfig, from_dict
from captioner.data.dataset import CaptionDataset, Skipped, build_transform, collate, fixed_captions
from captioner.data.readers import Record
from captioner.data.vocab import PAD_ID, Vocabulary
from captioner.model.losses import SelfCriticalLoss
from captioner.training.datamodule import CaptionDataModule
from conftest import make_loss, run_script
from test_graphed import EagerReplays
from test_precision import WORDS, steps_trainer

MAX_LEN, SIZE = 6, 32  # caption words, image side
CAPTIONS = [5, 6, 5, 7, 5, 5, 6, 5, 7, 5, 5, 6, 5, 5, 7, 5]  # per image of the COCO-shaped set
UNREADABLE = {3: "corrupt", 9: "missing"}  # image -> what is wrong with its file


def coco_shaped(folder: Path) -> list[Record]:
    """The COCO-shaped training set: ``CAPTIONS`` captions of 2 to ``MAX_LEN`` words per image, ``UNREADABLE``; its
    files are written into ``folder`` unless there already."""
    generator = torch.Generator().manual_seed(0)
    records = []
    for i, count in enumerate(CAPTIONS):
        path = folder / f"{i}.png"
        pixels = torch.randint(0, 256, (SIZE, SIZE, 3), generator=generator, dtype=torch.uint8)
        if path.exists() or i in UNREADABLE and UNREADABLE[i] == "missing":
            pass  # written before: the ranks of a run read what the test wrote
        elif UNREADABLE.get(i) == "corrupt":
            path.write_bytes(b"not a png")
        else:
            Image.fromarray(pixels.numpy()).save(path)
        captions = []
        for _ in range(count):
            n = int(torch.randint(2, MAX_LEN + 1, (1,), generator=generator))
            captions.append(" ".join(WORDS[int(w)] for w in torch.randint(0, len(WORDS), (n,), generator=generator)))
        records.append(Record(str(path), 100 + i, tuple(captions), "train"))
    return records


class Replays(EagerReplays):
    """``EagerReplays`` fed by a plain DataLoader: the unreadable images' records stay on the host, as the data
    module keeps them (``CaptionDataModule.transfer_batch_to_device``)."""

    def transfer_batch_to_device(self, batch: dict, device: torch.device, dataloader_idx: int) -> dict:
        tensors = {k: v for k, v in batch.items() if k != "skipped"}
        return {**super().transfer_batch_to_device(tensors, device, dataloader_idx), "skipped": batch["skipped"]}


class Steps(L.Callback):
    """Each step's loss averaged over the ranks, and the caption weights each rank's batch carried."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.weights: list[float] = []
        self.shapes: list[tuple[int, ...]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))
        self.weights.append(float(trainer.strategy.reduce(batch["caption_weights"].sum(), reduce_op="sum")))
        self.shapes.append(tuple(batch["captions"].shape))


def train(devices: int, folder: Path, dataset: str, k: int | None, global_batch: int, static: bool = True) -> dict:
    """One epoch of ``EagerReplays`` on ``dataset`` ("coco": ``coco_shaped``; "issue": the scenario issue 44 found
    hanging), ``devices`` processes sharing each global batch of ``global_batch`` images; ``static``: batches of K
    captions per image padded to one width, else every caption gathered as validation batches are."""
    module = ddp_module(Replays, compile=None)
    data = coco_shaped(folder) if dataset == "coco" else issue_scenario(module.model.encoder.out_channels)
    if dataset == "coco":
        data = CaptionDataset(data, module.vocab, build_transform(SIZE, train=False), max_len=MAX_LEN)
    rows = global_batch // devices
    options = {"pad_to": MAX_LEN + 2, "captions_per_image": k, "rows": rows} if static else {"pad_to": MAX_LEN + 2}
    # one process takes whole the permutation Lightning deals to the ranks, so each step's global batch is the same
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True) if devices == 1 else None
    loader = DataLoader(data, batch_size=rows, sampler=sampler, collate_fn=functools.partial(collate, **options))
    recorder = Steps()
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)) if devices > 1 else "auto"
    trainer = steps_trainer(len(loader), recorder, devices=devices, strategy=strategy, max_epochs=1)
    trainer.fit(module, loader)
    return {
        "losses": recorder.losses,
        "weights": recorder.weights,
        "shapes": recorder.shapes,
        "replays": trainer.callback_metrics["train/graph_replays"].item(),
        "skipped": module.skips.count,
        "parameters": torch.cat([p.detach().flatten() for p in module.model.decoder.parameters()]).tolist(),
        "rank": trainer.global_rank,
    }


def issue_scenario(channels: int) -> list[dict]:
    """Issue 44's hanging scenario: 12 images' cached features, two captions each but image 1's three."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(12, 4, channels, generator=generator)
    items = []
    for i in range(12):
        words = torch.randint(4, 4 + len(WORDS), (3 if i == 1 else 2, 5), generator=generator)
        captions = [torch.tensor([1, *w.tolist(), 2]) for w in words]
        items.append({"features": features[i], "captions": captions, "image_id": i, "index": i})
    return items


def run_ranks(tmp_path: Path, *args: str) -> dict:
    """``main`` in two gloo processes, killed (and the test failed) if they do not finish in 300 s."""
    out = tmp_path / "result.json"
    run_script(__file__, str(out), "--folder", str(tmp_path), *args, timeout=300)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------------- K captions per image
def captions(*lengths: int) -> list[torch.Tensor]:
    """Distinct encoded captions of these token counts."""
    return [torch.arange(10 * i, 10 * i + n) for i, n in enumerate(lengths)]


def test_an_image_with_k_captions_keeps_them_in_order_and_draws_nothing() -> None:
    state = torch.get_rng_state()
    given = captions(3, 4, 5)
    chosen, weights = fixed_captions(given, 3)
    assert [c.tolist() for c in chosen] == [c.tolist() for c in given] and weights.equal(torch.ones(3))
    assert torch.equal(torch.get_rng_state(), state)  # the demo's five of five: its runs train as they did


def test_an_image_with_more_captions_draws_k_afresh_each_time_repeatably_for_a_seed() -> None:
    given = captions(*range(3, 10))  # seven, as a COCO image can have
    torch.manual_seed(5)
    epochs = [[c[0].item() for c in fixed_captions(given, 5)[0]] for _ in range(6)]
    torch.manual_seed(5)
    assert [[c[0].item() for c in fixed_captions(given, 5)[0]] for _ in range(6)] == epochs  # seeded: repeats
    assert all(len(set(drawn)) == 5 and set(drawn) <= set(range(0, 70, 10)) for drawn in epochs)  # no repeat
    assert len({tuple(sorted(drawn)) for drawn in epochs}) > 1  # a fresh draw each epoch
    assert fixed_captions(given, 5)[1].equal(torch.ones(5))


def test_an_image_with_fewer_captions_repeats_them_with_zero_weight() -> None:
    chosen, weights = fixed_captions(captions(3, 4), 5)
    assert [c[0].item() for c in chosen] == [0, 10, 0, 10, 0]
    assert weights.equal(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]))


def test_a_training_batch_keeps_its_shape_with_unreadable_images_and_a_short_last_batch(tmp_path: Path) -> None:
    records = coco_shaped(tmp_path)
    dataset = CaptionDataset(records, Vocabulary(WORDS), build_transform(SIZE, train=False), max_len=MAX_LEN)
    items = [dataset[i] for i in (2, 3, 4, 9)]  # 5 captions, corrupt, 5 captions, missing
    assert [isinstance(item, Skipped) for item in items] == [False, True, False, True]
    batch = collate(items + [dataset[8]], pad_to=MAX_LEN + 2, captions_per_image=6, rows=8)  # 7 captions
    assert batch["images"].shape == (8, 3, SIZE, SIZE) and batch["captions"].shape == (48, MAX_LEN + 2)
    assert batch["captions_per_image"] == 6 and batch["image_index"].equal(torch.arange(8).repeat_interleave(6))
    assert batch["real"].tolist() == [True, False, True, False, True, False, False, False]
    weights = batch["caption_weights"].view(8, 6)
    assert weights.sum(1).tolist() == [5, 0, 5, 0, 6, 0, 0, 0]  # every real caption once, six of image 8's seven
    assert weights[0].tolist() == [1, 1, 1, 1, 1, 0]  # the sixth is the first again, weighted 0
    assert batch["captions"][5].equal(batch["captions"][0])
    masked = ~batch["real"]
    assert not batch["images"][masked].any() and (batch["captions"].view(8, 6, -1)[masked] == PAD_ID).all()
    assert batch["image_ids"].tolist() == [102, -1, 104, -1, 108, -1, -1, -1]
    assert [s.path for s in batch["skipped"]] == [records[3].image_path, records[9].image_path]  # still reported


def test_cached_features_batch_as_images_do() -> None:
    features = [
        {"features": torch.ones(4, 8, dtype=torch.float16), "captions": captions(3, 4), "image_id": 7, "index": 0}
    ]
    batch = collate([*features, Skipped("gone.png", "not in the feature cache")], captions_per_image=3, rows=3)
    assert batch["features"].shape == (3, 4, 8) and batch["features"].dtype == torch.float16
    assert not batch["features"][1:].any() and batch["caption_weights"].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0]


def test_validation_batches_keep_every_caption_and_drop_unreadable_images() -> None:
    items = [{"features": torch.ones(4, 8), "captions": captions(3, 4, 5), "image_id": 7, "index": 0}]
    batch = collate([*items, Skipped("gone.png", "missing")])
    assert batch["features"].shape == (1, 4, 8) and batch["captions"].shape == (3, 5)
    assert batch["caption_weights"].equal(torch.ones(3)) and len(batch["skipped"]) == 1


def test_k_defaults_to_the_most_common_caption_count_of_the_training_split(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = CaptionDataModule(None, from_dict(DataConfig, {}))
    data.splits["train"] = coco_shaped(tmp_path)
    with caplog.at_level(logging.INFO, logger="captioner.training.datamodule"):
        assert data.training_captions_per_image() == 5
    assert "data.captions_per_image=5, the most common caption count of the training images (10 of 16)" in caplog.text
    data.settings.captions_per_image = 7
    assert data.training_captions_per_image() == 7
    data.settings.per_caption = True
    assert data.training_captions_per_image() == 1


def test_a_repeated_caption_weighted_zero_changes_no_loss_term() -> None:
    torch.manual_seed(0)
    loss = make_loss(ds_lambda=1.0)
    logits, alphas = torch.randn(3, 4, 12), torch.softmax(torch.randn(3, 4, 5), dim=-1)  # (N, T, V), (N, T, L)
    tokens = torch.tensor([[1, 4, 5, 6, 2], [1, 7, 2, 0, 0], [1, 4, 5, 6, 2]])  # the third repeats the first
    output = type("Output", (), {"logits": logits, "alphas": alphas, "entropy": None, "location_log_probs": None})
    weighted = loss(output, tokens, torch.tensor([1.0, 1.0, 0.0]))
    output.logits, output.alphas = logits[:2], alphas[:2]
    alone = loss(output, tokens[:2])
    for name in ("ce", "ds", "loss"):
        torch.testing.assert_close(weighted[name], alone[name])


@pytest.mark.parametrize("baseline", ["mean", "greedy"])
def test_scst_counts_no_sample_of_a_masked_row(baseline: str) -> None:
    loss = SelfCriticalLoss(baseline)
    log_probs, lengths = -torch.rand(6, 4), torch.tensor([4, 2, 3, 1, 4, 4])  # 3 images x 2 samples
    rewards, greedy = torch.tensor([[0.5, 0.1], [9.0, 7.0], [0.2, 0.4]]), torch.tensor([0.3, 8.0, 0.1])
    masked = loss(log_probs, lengths, rewards, greedy, real=torch.tensor([True, False, True]))
    kept = torch.tensor([0, 1, 4, 5])
    alone = loss(log_probs[kept], lengths[kept], rewards[[0, 2]], greedy[[0, 2]])
    for name in alone:
        torch.testing.assert_close(masked[name], alone[name])


# ------------------------------------------------------------------------------------ training, 1 and 2 ranks
@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The COCO-shaped set trained by one process, K = 7: no caption drawn, so two ranks see the same captions."""
    return train(1, tmp_path_factory.mktemp("coco"), "coco", k=7, global_batch=4)


def test_one_process_replays_every_step_and_counts_every_readable_caption(one_process: dict) -> None:
    assert len(one_process["losses"]) == 4 and set(one_process["shapes"]) == {(4 * 7, MAX_LEN + 2)}
    assert one_process["replays"] == 1.0 and one_process["skipped"] == 2
    readable = sum(n for i, n in enumerate(CAPTIONS) if i not in UNREADABLE)
    assert sum(one_process["weights"]) == readable


@pytest.mark.slow
def test_two_ranks_whose_batches_differ_train_as_one_process(one_process: dict, tmp_path: Path) -> None:
    coco_shaped(tmp_path)  # written once, before the ranks read it
    result = run_ranks(tmp_path, "--devices", "2", "--set", "coco", "--k", "7", "--batch", "4")
    assert result["replays"] == 1.0 and {tuple(s) for s in result["shapes"]} == {(2 * 7, MAX_LEN + 2)}
    assert result["weights"] == one_process["weights"]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(one_process["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(result["parameters"]), torch.tensor(one_process["parameters"]))


@pytest.mark.slow
@pytest.mark.parametrize("static", [True, False], ids=["k-captions", "gathered"])
def test_the_scenario_that_hung_completes(static: bool, tmp_path: Path) -> None:
    args = ["--devices", "2", "--set", "issue", "--k", "2", "--batch", "4"] + ([] if static else ["--gathered"])
    result = run_ranks(tmp_path, *args)
    assert len(result["losses"]) == 3
    if static:  # image 1 takes two of its three captions: every step replays
        assert result["replays"] == 1.0 and result["weights"] == [8.0, 8.0, 8.0]
    else:  # the rank holding image 1 has 5 captions, the other 4: both ran those steps eagerly, agreed
        assert result["replays"] < 1.0 and sum(result["weights"]) == 25.0


def main() -> None:
    """Train as ``train`` does and write rank 0's result to a JSON file."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--set", choices=["coco", "issue"], default="coco")
    parser.add_argument("--k", type=int, default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--gathered", action="store_true")
    args = parser.parse_args()
    result = train(args.devices, Path(args.folder), args.set, args.k, args.batch, static=not args.gathered)
    if result["rank"] == 0:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
