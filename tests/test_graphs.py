"""``model.graphs`` on the CPU: what a capture does besides capturing (``CapturedCall(capture=False)`` runs the
same warm-up, restore and static inputs, the call itself eager). tests/test_gpu_graphs.py captures on a GPU."""

from __future__ import annotations

import copy

import torch
from torch import nn

from captioner.model.graphs import WARMUP_CALLS, CapturedCall


def buffers(module: nn.Module) -> list[torch.Tensor]:
    return [buffer.clone() for buffer in module.buffers()]


def test_a_captured_call_s_warm_up_leaves_buffers_and_random_state_as_they_were() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5)).train()  # buffers and draws
    eager, inputs = copy.deepcopy(module), torch.randn(8, 4)
    before, state = buffers(module), torch.get_rng_state()
    calls = []

    def function(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return module(x)

    call = CapturedCall(function, [inputs], keep=module, capture=False)
    assert len(calls) == WARMUP_CALLS  # the warm-up ran: moved the running statistics, drew dropout masks
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(buffers(module), before))
    assert torch.equal(torch.get_rng_state(), state)
    replayed = call(inputs)
    torch.set_rng_state(state)
    assert torch.equal(replayed, eager(inputs))  # as one eager call from the same state
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(buffers(module), buffers(eager)))
    assert module[1].num_batches_tracked.item() == 1
    other, state = torch.randn(8, 4), torch.get_rng_state()
    replayed = call(other)
    torch.set_rng_state(state)
    assert torch.equal(replayed, eager(other))  # new inputs copied into the static ones
    assert calls[-1] is call.inputs[0] and torch.equal(call.inputs[0], other)
