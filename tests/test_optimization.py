"""``training.optimization.keep_implementation``: a checkpoint's optimiser state never changes how Adam runs here,
and never hides torch's refusal of a state that does not fit."""

from __future__ import annotations

import pytest
import torch

from captioner.config import OptimizerConfig
from captioner.training.optimization import build_optimizer


def adam(groups: int) -> torch.optim.Adam:
    """The module's Adam over one parameter per group: the decoder's, plus the encoder's when ``groups`` is 2."""
    encoder = [torch.nn.Parameter(torch.ones(2))] if groups == 2 else []
    return build_optimizer([torch.nn.Parameter(torch.ones(3))], encoder, OptimizerConfig())


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
