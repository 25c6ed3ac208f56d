"""The non-finite guard's report under 16-mixed: the training step's loss, neither scaled by the GradScaler nor
divided by ``accumulate_grad_batches`` as Lightning back-propagates it; over ranks, the step's loss of all. And
BestCheckpoint's resume into a new folder, with real Lightning fits: it carries over at most ``save_top_k`` of the
earlier run's best checkpoints."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from captioner.config import NonFinite
from captioner.training.callbacks import BestCheckpoint, NonFiniteLossError, NonFiniteLossGuard

SCALE = 2.0**16  # GradScaler's initial scale


def guarded_step(losses: list[float], other_rank: list[float], action: NonFinite) -> NonFiniteLossGuard:
    """The guard after one optimiser step of the accumulated batches ``losses``, each back-propagated as
    Lightning's 16-mixed plugin does (divided by their count, times the scale), with its flags checked;
    ``other_rank``: a second rank's losses of the same batches (the reduce gives the mean of the two)."""
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([parameter])  # plain: the plugin unscales it before the guard's hook
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)

    def reduce(record: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "mean"
        loss = torch.tensor(other_rank[len(guard.losses)])
        return (record + torch.stack([loss, (~torch.isfinite(loss)).float()])) / 2

    trainer = SimpleNamespace(
        accumulate_grad_batches=len(losses),
        precision_plugin=SimpleNamespace(scaler=scaler),
        strategy=SimpleNamespace(reduce=reduce),
        current_epoch=0,
        global_step=7,
        checkpoint_callbacks=[],
    )
    guard = NonFiniteLossGuard(action, check_interval=1)
    guard.on_train_batch_start(trainer, None, None, 0)
    for value in losses:
        loss = scaler.scale((parameter.sum() * value / 2) / len(losses))  # the training step's loss: ``value``
        guard.on_before_backward(trainer, None, loss)
        loss.backward()
    scaler.unscale_(optimizer)
    guard.on_before_optimizer_step(trainer, None, optimizer)
    guard.check(trainer)
    return guard


@pytest.mark.parametrize("action", list(NonFinite))
def test_a_rank_whose_loss_is_finite_reports_the_steps_loss_not_its_own_scaled_one(
    action: NonFinite, caplog: pytest.LogCaptureFixture
) -> None:
    """Another rank's NaN skips (or stops) every rank's step; this rank's finite losses 2 and 4, back-propagated
    as 2 x 65,536 / 2 and 4 x 65,536 / 2, were reported as 196608.0, a loss no rank had: the step's is NaN."""
    where = "non-finite loss (nan) at epoch 0, step 7"
    if action == NonFinite.stop:
        with pytest.raises(NonFiniteLossError, match=rf"^{re.escape(where)}; training stopped"):
            guarded_step([2.0, 4.0], [float("nan"), 1.0], action)
    else:
        guarded_step([2.0, 4.0], [float("nan"), 1.0], action)
        assert [r.getMessage() for r in caplog.records] == [f"{where}: batch skipped, no parameter update"]


def test_the_loss_kept_of_a_backward_is_the_training_steps() -> None:
    """What the guard keeps of each backward, [loss, non-finite], the loss unscaled and undivided (the
    values a report names)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    trainer = SimpleNamespace(
        accumulate_grad_batches=4,
        precision_plugin=SimpleNamespace(scaler=scaler),
        strategy=SimpleNamespace(reduce=lambda record, reduce_op: record),
    )
    guard = NonFiniteLossGuard()
    for loss in (2.5, float("-inf")):
        guard.on_before_backward(trainer, None, scaler.scale(torch.tensor(loss) / 4))
    assert [record.tolist() for record in guard.losses] == [[2.5, 0.0], [float("-inf"), 1.0]]


class Scored(L.LightningModule):
    """One weight trained on one batch an epoch, whose validation logs ``SCORES[epoch]`` as val/bleu4."""

    SCORES = [0.3, 0.5, 0.4, 0.2, 0.1, 0.45, 0.6, 0.35]

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return (self.weight - batch).pow(2).sum()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/bleu4", self.SCORES[self.current_epoch])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader([torch.ones(1)], batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader([torch.ones(1)], batch_size=None)


class Carried(L.Callback):
    """The checkpoints a run's BestCheckpoint holds as it starts its first epoch, and those in its folder."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not hasattr(self, "files"):
            best = trainer.checkpoint_callback
            self.candidates = sorted(Path(path).name for path in best.best_k_models)
            self.files = sorted(path.name for path in Path(best.dirpath).glob("*.ckpt"))
            self.best = (Path(best.best_model_path).name, best.best_model_score)


def fit_scored(folder: Path, epochs: int, save_top_k: int, ckpt_path: Path | None = None) -> tuple:
    """``Scored`` trained for ``epochs`` epochs (resumed from ``ckpt_path``), its checkpoints in ``folder``: its
    BestCheckpoint, and what it held as the first epoch started (``Carried``)."""
    best = BestCheckpoint(
        dirpath=folder, filename="{epoch}", monitor="val/bleu4", mode="max", save_top_k=save_top_k, save_last=True
    )
    carried = Carried()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        callbacks=[best, carried],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Scored(), ckpt_path=ckpt_path, weights_only=True)
    return best, carried


@pytest.mark.parametrize(
    "earlier_top_k, top_k, carried, kept",
    [
        (-1, 1, ["epoch=1.ckpt"], ["epoch=6.ckpt"]),  # the best of every epoch the earlier run kept
        (3, 1, ["epoch=1.ckpt"], ["epoch=6.ckpt"]),
        (3, 2, ["epoch=1.ckpt", "epoch=2.ckpt"], ["epoch=1.ckpt", "epoch=6.ckpt"]),  # the two best of its three
        (3, 0, [], []),  # this run keeps none
        (1, -1, ["epoch=1.ckpt"], ["epoch=1.ckpt", "epoch=5.ckpt", "epoch=6.ckpt", "epoch=7.ckpt"]),  # the one to beat
    ],
)
def test_a_resume_carries_over_at_most_save_top_k_of_the_earlier_runs_best_checkpoints(
    earlier_top_k: int, top_k: int, carried: list[str], kept: list[str], tmp_path: Path
) -> None:
    """The earlier run's 5 epochs score 0.3, 0.5, 0.4, 0.2, 0.1: its best are epochs 1, 2, 0. Resumed with
    save_top_k=``top_k`` into a new folder for 3 more epochs (0.45, 0.6, 0.35), Lightning's own top-k keeps
    the folder at ``top_k`` checkpoints (and last.ckpt), the best of both runs."""
    fit_scored(tmp_path / "first", 5, earlier_top_k)
    before = sorted(path.name for path in (tmp_path / "first").iterdir())
    best, start = fit_scored(tmp_path / "second", 8, top_k, ckpt_path=tmp_path / "first" / "last.ckpt")
    assert start.candidates == carried and start.files == carried  # linked as it started, no more
    if carried:
        assert start.best[0] == "epoch=1.ckpt" and float(start.best[1]) == 0.5
    else:
        assert start.best == ("", None)  # not the earlier folder's best: none of this run's
    assert sorted(Path(path).name for path in best.best_k_models) == kept
    assert sorted(path.name for path in (tmp_path / "second").iterdir()) == [*kept, "last.ckpt"]
    assert sorted(path.name for path in (tmp_path / "first").iterdir()) == before  # the earlier run untouched
