"""DDP with the decoder's compiled step (``model.compile=default``): one process and two (CPU, gloo) train as one
process without DDP does, step for step: the ranks' mean loss of each step equals the single process's on the
same global batch, the weights end equal, and the step compiles once (one graph, no recompilation); so do two
processes running ``model.graphs``' steps, which all-reduce their gradients beside the graph. And
``python train.py trainer=ddp_cpu`` trains two processes with compile on.

    python tests/test_ddp.py OUT.json --devices 2 --strategy ddp   # what the DDP tests run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, DistributedSampler

from captioner.config import ModelConfig, from_dict
from captioner.data.dataset import collate
from captioner.data.vocab import Vocabulary
from captioner.training.module import CaptionerModule
from conftest import run_script, run_train, tiny_overrides
from test_graphed import EagerReplays
from test_precision import WORDS, steps_trainer

STEPS, BATCH, PER_IMAGE = 3, 8, 2  # the global batch: 8 images, 2 captions each


def items(channels: int) -> list[dict]:
    """``STEPS`` global batches of cached features (2x2 grids) with captions of one length: every rank's half
    of a batch has as many target tokens, so the mean of the ranks' losses is the whole batch's loss."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(STEPS * BATCH, 4, channels, generator=generator)
    words = torch.randint(4, 4 + len(WORDS), (STEPS * BATCH, PER_IMAGE, 6), generator=generator)
    captions = torch.cat([torch.ones_like(words[..., :1]), words, torch.full_like(words[..., :1], 2)], dim=-1)
    return [
        {"features": features[i], "captions": list(captions[i]), "image_id": i, "index": i}
        for i in range(STEPS * BATCH)
    ]


def ddp_module(kind: type[CaptionerModule] = CaptionerModule, compile: str | None = "default") -> CaptionerModule:
    """``test_precision``'s tiny captioner with its step compiled (``compile``), its encoder frozen and no
    feature_norm: a BatchNorm in training mode normalises each rank's images by their own statistics (SyncBatchNorm
    runs on GPUs only)."""
    torch.manual_seed(0)
    settings = dict(
        encoder={"name": "resnet18", "weights": None, "stage": "layer1", "grid": 2, "trainable_stages": 0},
        decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16, "dropout": 0.0},
        feature_norm=False,
        objective="cross_entropy",
        optimizer={"lr": 0.01},
        scheduler={"name": "none"},
        compile=compile,
    )
    return kind(Vocabulary(WORDS), from_dict(ModelConfig, settings))


class StepLosses(L.Callback):
    """Each step's loss averaged over the ranks."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


def train_steps(devices: int, strategy: str, replays: bool = False) -> dict:
    """``STEPS`` steps of the tiny captioner with its decoder step compiled, ``devices`` processes sharing each
    global batch (a distributed sampler deals rank r images r, r + devices, ...); ``replays``: the steps of
    ``model.graphs`` (run uncaptured), whose gradients are all-reduced beside the graph, not by DDP's reducer."""
    torch._dynamo.reset()
    counters.clear()  # the graphs of this run alone, not of the tests before it in this process
    module = ddp_module(EagerReplays if replays else CaptionerModule)
    recorder = StepLosses()
    trainer = steps_trainer(STEPS, recorder, devices=devices, strategy=strategy)
    data = items(module.model.encoder.out_channels)
    # Lightning deals a shuffled permutation to the ranks (seeded: rank r takes its items r, r + devices, ...); one
    # process without DDP takes the same permutation whole, so that each step's global batch is the same images
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True) if strategy == "auto" else None
    loader = DataLoader(data, batch_size=BATCH // devices, sampler=sampler, collate_fn=collate)
    trainer.fit(module, loader)
    return {
        "losses": recorder.losses,
        "weights": torch.cat([p.detach().flatten() for p in module.model.decoder.parameters()]).tolist(),
        "graphs": counters["stats"]["unique_graphs"],
        "rank": trainer.global_rank,
    }


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The run without DDP that the DDP runs must reproduce."""
    return train_steps(1, "auto")


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "replays"), [(1, False), (2, False), (2, True)])
def test_ddp_with_the_compiled_step_trains_as_one_process(
    devices: int, replays: bool, one_process: dict, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    replay = ["--replays"] if replays else []
    run_script(__file__, str(out), "--devices", str(devices), "--strategy", "ddp", *replay)
    result = json.loads(out.read_text())
    assert len(one_process["losses"]) == STEPS and one_process["graphs"] == 1
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(one_process["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(result["weights"]), torch.tensor(one_process["weights"]))
    assert result["graphs"] == 1  # every step ran the one compiled graph


@pytest.mark.slow
def test_train_py_trains_two_ddp_processes_with_the_compiled_step(tiny_shapes: Path, tmp_path: Path) -> None:
    proc = run_train(
        [
            *tiny_overrides(tiny_shapes, tmp_path),
            "trainer=ddp_cpu",
            "trainer.devices=2",
            "model.compile=default",
            "data.image_size=64",
            "data.batch_size=8",
            "trainer.max_epochs=1",
            "model.objective=cross_entropy",
            "+trainer.limit_train_batches=2",
            "+trainer.limit_val_batches=1",
            "test=false",
        ]
    )
    log = proc.stdout + proc.stderr
    assert "model.compile=default: the decoder's step is compiled" in log
    assert "`Trainer.fit` stopped: `max_epochs=1` reached" in log


def main() -> None:
    """Train as ``train_steps`` does and write rank 0's result to a JSON file."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--replays", action="store_true")
    args = parser.parse_args()
    result = train_steps(args.devices, args.strategy, args.replays)
    if result["rank"] == 0:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
