"""What only a CUDA device can check (skipped elsewhere; ``python benchmarks/gpu_check.py`` runs it on a lent
GPU): the step compiled with CUDA graphs (``model.compile=reduce-overhead``) trains and decodes as eager does,
and 16-mixed and bf16-mixed training steps survive gradient clipping and an empty batch. Without one, the
check command says so in one line."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from captioner.config import Compile, DecodingConfig
from captioner.data.vocab import Vocabulary
from captioner.model.decoding import beam_search, greedy
from captioner.training.module import CaptionerModule
from conftest import ROOT, V, features_for, make_decoder, subprocess_env

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
WORDS = [f"w{i}" for i in range(12)]


@pytest.fixture(scope="module")
def graphed_pair():
    """A soft decoder on the GPU whose step runs as CUDA graphs (reduce-overhead), and its eager twin."""
    eager = make_decoder().train().to(CUDA)
    graphed = copy.deepcopy(eager)
    graphed.compile_step(Compile.reduce_overhead)
    return graphed, eager


@needs_cuda
def test_reduce_overhead_training_step_equals_eager(graphed_pair):
    graphed, eager = graphed_pair
    for length in (18, 18, 18):  # captions padded to one width, as training pads them with compile on
        tokens = torch.randint(4, V, (10, length), device=CUDA)
        features, index = features_for(5).to(CUDA), torch.arange(10, device=CUDA) // 2
        losses = []
        for decoder in (graphed, eager):
            decoder.zero_grad()
            output = decoder(features, tokens, index)
            loss = torch.nn.functional.cross_entropy(output.logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
        for mine, theirs in zip(graphed.parameters(), eager.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)


@needs_cuda
def test_cuda_graph_decoding_equals_eager(graphed_pair):
    graphed, eager = graphed_pair
    graphed.eval(), eager.eval()
    try:
        for batch in (4, 3):
            features = features_for(batch, seed=batch).to(CUDA)
            for run, settings in ((greedy, DecodingConfig(max_len=8)), (beam_search, DecodingConfig(max_len=8))):
                mine, theirs = run(graphed, features, settings), run(eager, features, settings)  # static on CUDA
                assert torch.equal(mine.tokens, theirs.tokens)
                torch.testing.assert_close(mine.scores, theirs.scores, rtol=1e-4, atol=1e-4)
    finally:
        graphed.train(), eager.train()


def _batch(channels: int, empty: bool = False) -> dict:
    """Four images' cached features (4, 4, C), two captions each; ``empty``: every image unreadable."""
    generator = torch.Generator().manual_seed(0)
    images = 0 if empty else 4
    words = torch.randint(4, 4 + len(WORDS), (2 * images, 5), generator=generator)
    captions = torch.cat([torch.ones(2 * images, 1, dtype=torch.long), words, torch.full((2 * images, 1), 2)], 1)
    return {
        "features": torch.randn(images, 4, channels, generator=generator),
        "captions": captions,  # (8, 7), or (0, 7)
        "image_index": torch.arange(images).repeat_interleave(2),
        "skipped": ["unreadable.jpg"] * (4 - images),
    }


@needs_cuda
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_steps_clip_and_survive_an_empty_batch(precision):
    torch.manual_seed(0)
    module = CaptionerModule(
        Vocabulary(WORDS),
        encoder={"name": "resnet18", "weights": None, "stage": "layer1", "grid": 2},
        decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16, "dropout": 0.0},
        optimizer={"lr": 0.01},
        scheduler={"name": "none"},
        compile="off",
    )
    channels = module.model.encoder.out_channels
    batches = [_batch(channels, empty=step in (0, 2)) for step in range(6)]
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        precision=precision,
        max_steps=len(batches),
        gradient_clip_val=1e-3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch))
    assert all(math.isfinite(float(p.detach().float().sum())) for p in module.parameters())
    steps = {float(state["step"]) for state in trainer.optimizers[0].state.values()}
    assert steps == {4.0}  # the two empty batches stepped nothing, the four others did


def test_gpu_check_without_cuda_says_so_in_one_line():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        cwd=ROOT,
        env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""},  # no device, even on a GPU machine
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: gpu_check needs a CUDA device and torch sees none on this machine"]
