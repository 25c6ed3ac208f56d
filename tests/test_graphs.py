"""``model.graphs`` on the CPU: what a capture does besides capturing (``capture=False`` runs the same warm-up,
restore, static inputs and cache, the call itself eager): the warm-up leaves no trace, a decoder's graphs go
when its tensors move, and threads captioning with one model take turns at its graphs' shared inputs and
outputs. tests/test_gpu_graphs.py captures on a GPU."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import captioner
from captioner.config import DecodingConfig
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import decode
from captioner.model.graphs import WARMUP_CALLS, CapturedCall, GraphCache
from conftest import features_for, make_decoder, write_bundle


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


def moved(decoder: ShowAttendTellDecoder) -> None:
    """What ``.cpu().cuda()`` does to a CUDA decoder (``Module._apply`` with a function that gives new tensors)."""
    decoder._apply(torch.clone)


def assigned(decoder: ShowAttendTellDecoder) -> None:
    decoder.load_state_dict(copy.deepcopy(decoder.state_dict()), assign=True)


@pytest.mark.parametrize(
    "change", [moved, lambda decoder: decoder.half().float(), assigned], ids=["moved", "cast", "assigned"]
)
def test_a_decoder_s_graphs_go_when_its_tensors_move(change: Callable[[ShowAttendTellDecoder], None]) -> None:
    decoder, features = make_decoder(), features_for(3)
    settings = DecodingConfig(method="beam", beam_size=2, max_len=6)
    decoder.decoding_graphs = graphs = GraphCache(capture=False)
    decode(decoder, features, settings)
    with torch.no_grad():
        for weight in decoder.parameters():
            weight.mul_(0.5)  # updated in place, as Adam updates it: the graphs read the new values
    decode(decoder, features, settings)
    assert graphs.captures == 1
    change(decoder)  # new tensors: the graphs captured on the old ones would read freed memory
    replayed = decode(decoder, features, settings)
    assert graphs.captures == 2 and len(graphs.calls) == 1  # the old graph is gone, not only passed over
    decoder.decoding_graphs = None
    eager = decode(decoder, features, settings)
    assert torch.equal(replayed.tokens, eager.tokens) and torch.equal(replayed.scores, eager.scores)


def test_threads_captioning_with_one_model_get_what_one_call_after_another_gets(tmp_path: Path) -> None:
    model = captioner.load_model(write_bundle(tmp_path / "bundle.pt", ["a", "red", "blue", "circle", "square"]))
    # replays through the cache on the CPU too: every call of one batch shape shares its static inputs and outputs
    model.model.decoder.decoding_graphs = graphs = GraphCache(capture=False)
    generator = torch.Generator().manual_seed(0)
    batches = [[torch.rand(3, 40, 40, generator=generator) for _ in range(2)] for _ in range(8)]
    options = {"method": "beam", "beam_size": 3, "max_len": 6}
    alone = [model.caption(images, **options) for images in batches]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda images: model.caption(images, **options), batches))
    assert graphs.captures == 1
    for mine, theirs in zip(together, alone):
        for one, other in zip(mine, theirs):
            assert one.words == other.words and one.score == other.score and torch.equal(one.alphas, other.alphas)


def test_a_copy_of_a_decoder_gets_an_empty_cache_and_a_lock_of_its_own() -> None:
    decoder = make_decoder()
    decoder.decoding_graphs = graphs = GraphCache(capture=False)
    decode(decoder, features_for(2), DecodingConfig(method="greedy", max_len=4))
    for copied in (copy.deepcopy(decoder), pickle.loads(pickle.dumps(decoder))):  # AveragedModel's, ddp_spawn's
        assert not copied.decoding_graphs.calls and not copied.decoding_graphs.capture
        assert copied.decoding_graphs.lock is not graphs.lock
    assert len(graphs.calls) == 1
