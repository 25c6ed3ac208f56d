"""Hard attention's expected-context warm-up in real fits: laid over cross-entropy training, carried on by a
resume with a larger trainer.max_epochs, and never the source of the best checkpoint or of an early stop unless
``model.select_in_warmup`` asks (``training.schedule.CrossEntropyPhase``, ``training.callbacks``). The learning
rate's cosine, carried on by such a resume from where it stopped (``training.schedule.LearningRatePlan``)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from captioner.config import ModelConfig, from_dict
from captioner.data.vocab import Vocabulary
from captioner.training.callbacks import BestCheckpoint, WarmupEarlyStopping
from captioner.training.module import CaptionerModule
from test_precision import WORDS, one_batch

BATCHES = 2  # training steps an epoch


def hard_module(kind: type[CaptionerModule] = CaptionerModule, **settings) -> CaptionerModule:
    """test_precision's tiny captioner with hard attention, expected-context share 1 -> 0.5 over half of
    cross-entropy training; ``settings``: other ``model`` settings."""
    torch.manual_seed(0)
    decoder = {"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16, "dropout": 0.0}
    decoder |= {"hard_expectation_warmup": 0.5, "hard_expectation_prob": 0.5}
    model = dict(
        attention="hard",
        encoder={"name": "resnet18", "weights": None, "stage": "layer1", "grid": 2},
        decoder=decoder,
    )
    model |= {"scheduler": {"name": "none"}} | settings
    return kind(Vocabulary(WORDS), from_dict(ModelConfig, model))


class Batches(L.LightningDataModule):
    """``BATCHES`` cached-feature batches to train on, one to validate on, and the image size a checkpoint records."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.settings = SimpleNamespace(image_size=32, pad_to=None)
        self.batches = [one_batch(channels) for _ in range(BATCHES)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, collate_fn=lambda batch: batch)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.batches[:1], batch_size=None, collate_fn=lambda batch: batch)


class Shares(L.Callback):
    """The share of images reading the expected context at each training step, by step."""

    def __init__(self) -> None:
        self.shares: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.shares[trainer.global_step - 1] = pl_module.model.decoder.hard_expectation_prob


def fit(module: CaptionerModule, max_epochs: int, ckpt_path: Path | None = None, callbacks=(), **options) -> L.Trainer:
    """``trainer.fit`` of ``module`` on ``Batches`` for ``max_epochs`` epochs on the CPU."""
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=any(isinstance(c, BestCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )
    trainer.fit(module, datamodule=Batches(module.model.encoder.out_channels), ckpt_path=ckpt_path, weights_only=True)
    return trainer


def test_a_resume_with_more_epochs_carries_on_the_warm_up_it_started(tmp_path: Path) -> None:
    """4 epochs of 2 steps: the share falls from 1 by 1/8 a step to 0.5 at step 4 and stays. Resumed with
    trainer.max_epochs=6, it stays 0.5 (measured on the whole new run, it went back up to 1 - 0.5 * 8 / 6)."""
    first = Shares()
    trainer = fit(hard_module(), max_epochs=4, callbacks=[first], limit_val_batches=0)
    assert first.shares == {0: 1.0, 1: 0.875, 2: 0.75, 3: 0.625, 4: 0.5, 5: 0.5, 6: 0.5, 7: 0.5}
    trainer.save_checkpoint(tmp_path / "four.ckpt", weights_only=False)
    assert torch.load(tmp_path / "four.ckpt", weights_only=True)["cross_entropy_steps"] == 8
    resumed = Shares()
    fit(hard_module(), max_epochs=6, ckpt_path=tmp_path / "four.ckpt", callbacks=[resumed], limit_val_batches=0)
    assert resumed.shares == {8: 0.5, 9: 0.5, 10: 0.5, 11: 0.5}


class Rates(L.Callback):
    """The decoder's learning rate at each training step, by step; ``stop_after``: epochs before the run stops."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.rates: dict[int, float] = {}
        self.stop_after = stop_after

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self.rates[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.should_stop = trainer.current_epoch + 1 == self.stop_after


def test_a_resume_with_more_epochs_carries_on_the_learning_rate_it_stopped_at(tmp_path: Path) -> None:
    """A cosine over 6 epochs of 2 steps, stopped after 2 epochs (step 4: 0.75 of the rate) and resumed with
    trainer.max_epochs=10: the rate goes on from 0.75 and falls along the same cosine, to 0 over the 16 steps
    left (laid over the new 20 steps from the start, it jumped up to 0.905 of the rate)."""
    cosine = {"scheduler": {"name": "cosine", "warmup_steps": 0}, "optimizer": {"lr": 0.01}}

    def rate(progress: float) -> float:
        return 0.01 * 0.5 * (1 + math.cos(math.pi * progress))

    first = Rates(stop_after=2)
    trainer = fit(hard_module(**cosine), max_epochs=6, callbacks=[first], limit_val_batches=0)
    assert first.rates == pytest.approx({step: rate(step / 12) for step in range(4)})
    trainer.save_checkpoint(tmp_path / "stopped.ckpt", weights_only=False)
    resumed = Rates()
    stopped = tmp_path / "stopped.ckpt"
    fit(hard_module(**cosine), max_epochs=10, ckpt_path=stopped, callbacks=[resumed], limit_val_batches=0)
    assert resumed.rates == pytest.approx({step: rate(1 / 3 + 2 / 3 * (step - 4) / 16) for step in range(4, 20)})


class Scored(CaptionerModule):
    """The tiny captioner whose validation logs ``SCORES[epoch]`` as val/bleu4 (no decoding, no references)."""

    SCORES = [0.9, 0.8, 0.7, 0.6, 0.65, 0.62, 0.61, 0.6]  # best in the warm-up (epochs 0-1), then at epoch 2

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        pass

    def on_validation_epoch_start(self) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        self.log("val/bleu4", self.SCORES[self.current_epoch])


@pytest.mark.parametrize("select_in_warmup", [False, True])
def test_no_best_checkpoint_nor_early_stop_inside_the_warm_up_unless_asked(
    select_in_warmup: bool, tmp_path: Path
) -> None:
    """6 epochs of 2 steps, the warm-up over at step 6 (after epoch 2's steps). Patience 2: counted from epoch 0,
    the run stops after epoch 2 with epoch 0's checkpoint, the model that read the expected context most."""
    checkpoint = BestCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="val/bleu4", mode="max", save_last=True)
    stopping = WarmupEarlyStopping(monitor="val/bleu4", mode="max", patience=2)
    module = hard_module(Scored, select_in_warmup=select_in_warmup)
    trainer = fit(module, max_epochs=6, callbacks=[checkpoint, stopping])
    if select_in_warmup:
        assert Path(checkpoint.best_model_path).name == "epoch=0.ckpt" and trainer.current_epoch == 3
    else:
        assert Path(checkpoint.best_model_path).name == "epoch=2.ckpt" and trainer.current_epoch == 5
        assert stopping.best_score == pytest.approx(0.7)
    # last.ckpt: after every validation, not only after a new best one (Lightning's), nor never in the warm-up
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["epoch"] == trainer.current_epoch - 1
