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
from captioner.model.decoding import beam_search, greedy
from conftest import ROOT, V, features_for, make_decoder, subprocess_env
from test_precision import one_batch, tiny_module

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


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
            tokens = torch.randint(4, V, (batch, 18), device=CUDA)
            with torch.no_grad():  # validation's teacher forcing: every step a new CUDA-graph iteration
                mine, theirs = graphed(features, tokens), eager(features, tokens)
            torch.testing.assert_close(mine.logits, theirs.logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.alphas, theirs.alphas, rtol=1e-4, atol=1e-4)
    finally:
        graphed.train(), eager.train()


@needs_cuda
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_steps_clip_and_survive_an_empty_batch(precision):
    module = tiny_module(compile="off")  # the module tests/test_precision.py trains on the CPU, so it cannot go stale
    channels = module.model.encoder.out_channels
    batches = [one_batch(channels, empty=step in (0, 2)) for step in range(6)]
    trainer = fit_on_gpu(module, batches, precision, clip=1e-3)
    assert all(math.isfinite(float(p.detach().float().sum())) for p in module.parameters())
    steps = {float(state["step"]) for state in trainer.optimizers[0].state.values()}
    assert steps == {4.0}  # the two empty batches stepped nothing, the four others did


def fit_on_gpu(module: L.LightningModule, batches: list[dict], precision: str, clip: float) -> L.Trainer:
    """Train ``module`` on one GPU for one step per batch of ``batches`` (given as they are), clipping gradients at
    ``clip``: no validation, logger, checkpoint, progress bar or summary (tests/test_gpu_graphs.py trains so too)."""
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        precision=precision,
        max_steps=len(batches),
        gradient_clip_val=clip,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch))
    return trainer


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
