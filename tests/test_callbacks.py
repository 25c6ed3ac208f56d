"""The non-finite guard's report under 16-mixed: the training step's loss, neither scaled by the GradScaler nor
divided by ``accumulate_grad_batches`` as Lightning back-propagates it; over ranks, the step's loss of all."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from captioner.config import NonFinite
from captioner.training.callbacks import NonFiniteLossError, NonFiniteLossGuard

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
