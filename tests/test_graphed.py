"""``model.graphs``' training path on the CPU: what a CUDA graph of the step replays, run without capturing it
(``GraphedSteps(capture=False)``), trains as Lightning's eager steps do: the capture's two warm-up steps undone
(the feature norm's statistics, hard attention's baseline and the random state put back: else the weights part
from eager's), the static batch, the backward done inside the step and skipped by the module's hook, the
gradients handed to Lightning's clipping and Adam, a batch of other shapes run eagerly and reported.
tests/test_gpu.py captures the same path on a GPU."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from captioner.config import ModelConfig, from_dict
from captioner.errors import ConfigError
from captioner.training.module import CaptionerModule
from test_precision import one_batch, steps_trainer, tiny_module

HARD = {"attention": "hard", "loss": {"entropy_weight": 0.01}}  # samples a location at every step


class EagerReplays(CaptionerModule):
    """The module with ``model.graphs``' training steps, run without capture (what a CPU can run of them)."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            self.use_training_graphs(capture=False)


def batches(channels: int) -> list[dict]:
    """Five batches of four images, two captions each, the fourth of three images (an epoch's last batch)."""
    out = []
    for step in range(5):
        torch.manual_seed(step)
        batch = one_batch(channels)
        batch["features"] = torch.randn_like(batch["features"])
        if step == 3:
            batch = {**batch, "features": batch["features"][:3], "captions": batch["captions"][:6]}
            batch["image_index"] = batch["image_index"][:6]
        out.append(batch)
    return out


def fit(kind: type[CaptionerModule], **settings) -> CaptionerModule:
    """A tiny captioner of ``kind`` trained on ``batches``, clipping its gradients."""
    module = tiny_module(kind, **settings)
    data = batches(module.model.encoder.out_channels)
    trainer = steps_trainer(len(data), L.Callback(), gradient_clip_val=0.5)
    torch.manual_seed(1)  # dropout and hard attention's samples: the same draws in both runs
    trainer.fit(module, DataLoader(data, batch_size=None, collate_fn=lambda batch: batch))
    return module


@pytest.mark.parametrize("settings", [{}, HARD], ids=["soft", "hard"])
def test_replayed_steps_train_as_eager_steps(settings: dict, caplog: pytest.LogCaptureFixture) -> None:
    start = tiny_module(**settings).state_dict()
    eager = fit(CaptionerModule, **settings)
    with caplog.at_level(logging.INFO, logger="captioner.training.module"):
        replays = fit(EagerReplays, **settings)
    assert replays.graphed_steps is not None
    moved = 0
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(replays.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
        moved += not torch.equal(value, start[name])
    assert moved > 10  # Adam moved the weights: the gradients reached it
    assert "4 of 5 training steps (80%) replayed the CUDA graph; 1 ran eagerly: their batch had other shapes" in (
        caplog.text
    )


def test_graphs_need_a_cuda_device_and_never_nest_with_per_word_graphs() -> None:
    module = tiny_module(graphs=True)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    module.trainer = trainer
    with pytest.raises(ConfigError, match="model.graphs=true: CUDA graphs need a CUDA device"):
        module.setup("validate")
    with pytest.raises(ConfigError, match="^model.graphs=true .* compile=reduce-overhead graphs each word inside them"):
        from_dict(ModelConfig, {"graphs": True, "compile": "reduce-overhead"}, "model")


def test_under_bf16_autocast_the_ranks_agreement_and_the_capture_share_one_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    module = tiny_module(EagerReplays)
    data = [one_batch(module.model.encoder.out_channels) for _ in range(3)]
    trainer = steps_trainer(len(data), L.Callback(), precision="bf16-mixed")
    with caplog.at_level(logging.INFO, logger="captioner.training.module"):
        trainer.fit(module, DataLoader(data, batch_size=None, collate_fn=lambda batch: batch))
    # agreed on in on_train_batch_start, captured in the step: both under the step's autocast
    assert module.graphed_steps.key[-1] == (True, torch.bfloat16, False)
    assert trainer.callback_metrics["train/graph_replays"].item() == 1.0
    assert "3 of 3 training steps (100%) replayed the CUDA graph" in caplog.text
