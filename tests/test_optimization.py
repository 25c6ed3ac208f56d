"""The optimiser (``training.optimization``): fused only where a fused step can be skipped on the device
(``found_inf``), and said when it cannot; a checkpoint's optimiser state never changes how Adam runs here, and
never hides torch's refusal of a state that does not fit."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch

from captioner.config import OptimizerConfig
from captioner.training import optimization
from captioner.training.callbacks import skip_flagged_step


@pytest.fixture(autouse=True)
def fresh_trials() -> Iterator[None]:
    """Each test sees the fused kernel it patches, not a trial an earlier one cached."""
    optimization.fused_takes_found_inf.cache_clear()
    yield
    optimization.fused_takes_found_inf.cache_clear()


def _refusing(real: Callable) -> Callable:
    """A fused Adam kernel that refuses ``found_inf``, as Apple's MPS one did on some torch versions."""

    def kernel(*args, **kwargs):
        if kwargs.get("found_inf") is not None:
            raise RuntimeError("grad_scale and found_inf are not supported on this device")
        return real(*args, **kwargs)

    return kernel


def _ignoring(real: Callable) -> Callable:
    """A fused Adam kernel that steps whatever ``found_inf`` says."""
    return lambda *args, **kwargs: real(*args, **{**kwargs, "found_inf": None})


def test_adam_is_fused_where_the_fused_step_takes_found_inf(caplog: pytest.LogCaptureFixture) -> None:
    params = [torch.nn.Parameter(torch.randn(3))]
    with caplog.at_level(logging.WARNING):
        optimizer = optimization.build_optimizer(params, [], OptimizerConfig())
    assert optimization.is_fused(optimizer) and caplog.records == []


@pytest.mark.parametrize("kernel", [_refusing, _ignoring])
def test_adam_is_plain_and_says_so_where_the_fused_step_cannot_take_found_inf(
    kernel: Callable, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch, "_fused_adam_", kernel(torch._fused_adam_))
    params = [torch.nn.Parameter(torch.randn(3))]
    with caplog.at_level(logging.WARNING):
        optimizer = optimization.build_optimizer(params, [], OptimizerConfig())
    assert not optimization.is_fused(optimizer)
    assert [r.getMessage() for r in caplog.records] == [
        f"fused Adam cannot skip a step on cpu (found_inf) with torch {torch.__version__}: plain Adam "
        "instead, which reads each step's non-finite flag on the host"
    ]
    before = params[0].detach().clone()
    params[0].sum().backward()
    skip_flagged_step(optimizer, torch.tensor(True))  # a non-finite loss: the step changes nothing
    optimizer.step()
    assert torch.equal(params[0].detach(), before) and optimizer.state[params[0]] == {}
    params[0].sum().backward()
    skip_flagged_step(optimizer, torch.tensor(False))
    optimizer.step()
    assert not torch.equal(params[0].detach(), before)


def adam(groups: int) -> torch.optim.Adam:
    """The module's Adam over one parameter per group: the decoder's, plus the encoder's when ``groups`` is 2."""
    encoder = [torch.nn.Parameter(torch.ones(2))] if groups == 2 else []
    return optimization.build_optimizer([torch.nn.Parameter(torch.ones(3))], encoder, OptimizerConfig())


@pytest.mark.parametrize("saved,loading", [(2, 1), (1, 2)])
def test_a_state_with_another_number_of_param_groups_is_refused_by_torch(saved: int, loading: int) -> None:
    """A checkpoint of a run that trained the encoder, loaded into one that does not (and the reverse): torch's
    own error, where zipping the groups dropped the checkpoint's extra group and loaded the rest."""
    state = adam(saved).state_dict()
    with pytest.raises(ValueError, match="loaded state dict has a different number of parameter groups"):
        adam(loading).load_state_dict(state)


def test_the_implementation_is_this_optimisers() -> None:
    state = adam(2).state_dict()
    for group in state["param_groups"]:
        group["fused"] = group["foreach"] = None  # as Adam saved it before it was fused
    optimizer = adam(2)
    optimizer.load_state_dict(state)
    assert all(group["fused"] for group in optimizer.param_groups)
    assert all(group["fused"] is None for group in state["param_groups"])  # the caller's dict is not changed
