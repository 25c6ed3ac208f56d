"""``model.fused_attention`` on the CPU: the additive scorer's read compiled by inductor (C++ kernels here, Triton
on a GPU) equals the eager read in values and in the gradients of the keys, features, queries and every parameter,
for one query per image (B, H) and K (B, K, H); a decoder with it trains and decodes as the eager one does, inside
the whole step compiled by ``model.compile`` as well, and so do ``model.graphs``' training steps run without capture.
tests/test_gpu_graphs.py checks it inside a captured step on a GPU.

One decoder size throughout: each grad mode and shape kind costs a compilation (seconds to ~30 s here)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from captioner.config import Compile, DecodingConfig, ModelConfig, from_dict, to_dict
from captioner.errors import ConfigError
from captioner.model.attention import AdditiveAttention, _fused_attend
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import beam_search, greedy
from captioner.training.module import CaptionerModule
from conftest import V, features_for, make_decoder, make_loss
from test_graphed import EagerReplays, fit

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # float32: the fused kernels sum the A energies in their own order


@pytest.fixture(scope="module")
def decoders() -> tuple[ShowAttendTellDecoder, ShowAttendTellDecoder]:
    """An eager decoder and its fused twin (the same weights), in training mode."""
    eager = make_decoder().train()
    fused = make_decoder().train()
    fused.fuse_attention(True)
    fused.load_state_dict(eager.state_dict())
    assert isinstance(fused.attention, AdditiveAttention) and fused.attention.fused and not eager.attention.fused
    return eager, fused


def grads(loss: torch.Tensor, inputs: list[torch.Tensor], module: nn.Module) -> list[torch.Tensor]:
    """The gradients of ``loss`` with respect to ``inputs`` and every parameter of ``module`` (unused ones: None)."""
    return list(torch.autograd.grad(loss, [*inputs, *module.parameters()], allow_unused=True))


def assert_all_close(left: list[torch.Tensor | None], right: list[torch.Tensor | None]) -> None:
    """Equal within ``TOLERANCE`` pairwise, None where the other is None."""
    assert len(left) == len(right)
    for index, (a, b) in enumerate(zip(left, right)):
        assert (a is None) == (b is None), index
        if a is not None:
            torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, index=index: f"tensor {index}: {m}")


@pytest.mark.parametrize("queries", [None, 3], ids=["(B, H)", "(B, K, H)"])
def test_the_fused_read_equals_the_eager_read_in_values_and_gradients(decoders, queries: int | None) -> None:
    torch.manual_seed(2)
    features = features_for(4).requires_grad_()  # (B, L, D)
    h = torch.randn(4, *([queries] if queries else []), decoders[0].lstm.hidden_size, requires_grad=True)
    outputs, gradients = [], []
    calls = _fused_attend.cache_info()
    for decoder in decoders:
        scorer = decoder.attention
        context, alpha = scorer(scorer.keys(features), features, h)  # (B, [K,] D), (B, [K,] L)
        # weigh every output element differently, so that a wrong gradient of any one shows
        loss = (context * torch.linspace(-1, 2, context.numel()).view_as(context)).sum() + alpha.square().sum()
        outputs.append([context, alpha])
        gradients.append(grads(loss, [features, h], scorer))
    assert _fused_attend.cache_info().hits + _fused_attend.cache_info().misses == calls.hits + calls.misses + 1
    assert outputs[0][1].shape == (4, *([queries] if queries else []), features.size(1))
    torch.testing.assert_close(outputs[1][1].sum(-1), torch.ones(outputs[1][1].shape[:-1]))
    assert_all_close(outputs[0], outputs[1])
    assert_all_close(gradients[0], gradients[1])
    assert all(g is not None and g.abs().sum() > 0 for g in gradients[1])  # keys' W_a and b, W_h, w, features, h


def test_a_fused_decoder_trains_as_the_eager_one(decoders) -> None:
    """Teacher forcing, one caption per image and two per image (the (B, K, H) read): loss and every gradient."""
    torch.manual_seed(3)
    features = features_for(3)
    captions = torch.randint(4, V, (6, 5))
    criterion = make_loss()
    for index in (None, 2):
        losses, gradients = [], []
        for decoder in decoders:
            inputs = features if index else features.repeat_interleave(2, dim=0)
            loss = criterion(decoder(inputs, captions, index), captions)["loss"]
            losses.append(loss)
            gradients.append(grads(loss, [], decoder))
        torch.testing.assert_close(losses[0], losses[1], **TOLERANCE)
        assert_all_close(gradients[0], gradients[1])


def test_a_fused_decoder_decodes_the_same_captions(decoders) -> None:
    features = features_for(5)
    eager, fused = (copy.deepcopy(decoder).eval() for decoder in decoders)  # a deepcopy shares the compilation
    with torch.no_grad():
        for run, settings in (
            (greedy, DecodingConfig(method="greedy", max_len=6)),
            (beam_search, DecodingConfig(method="beam", beam_size=3, max_len=6)),
        ):
            for static in (False, True):
                outputs = [run(decoder, features, settings, static_shapes=static) for decoder in (eager, fused)]
                assert torch.equal(outputs[0].tokens, outputs[1].tokens)
                torch.testing.assert_close(outputs[0].scores, outputs[1].scores, **TOLERANCE)


@pytest.mark.slow
def test_the_whole_compiled_step_inlines_the_fused_read(decoders) -> None:
    """``model.compile`` with ``fused_attention``: the step's one graph takes the read in (no nested compilation,
    no break) and trains as eager does."""
    eager, fused = decoders
    compiled = copy.deepcopy(fused)
    compiled.compile_step(Compile.default)
    features, captions = features_for(3), torch.randint(4, V, (3, 5))
    criterion = make_loss()
    losses = [criterion(decoder(features, captions), captions)["loss"] for decoder in (eager, compiled)]
    torch.testing.assert_close(losses[0], losses[1], **TOLERANCE)
    assert_all_close(grads(losses[0], [], eager), grads(losses[1], [], compiled))


def test_only_the_additive_scorer_fuses_and_a_bundle_does_not_keep_it() -> None:
    with pytest.raises(ConfigError, match=r"^model.fused_attention=true needs scorer=additive \(got scorer=dot\)$"):
        from_dict(ModelConfig, {"scorer": "dot", "fused_attention": True}, "model")
    with pytest.raises(ConfigError, match="^model.fused_attention=true needs scorer=additive, not BilinearAttention$"):
        make_decoder(scorer="bilinear").fuse_attention(True)
    make_decoder(scorer="bilinear").fuse_attention(False)  # nothing to turn off
    settings = from_dict(ModelConfig, {"fused_attention": True})
    assert "fused_attention" not in to_dict(settings.net())  # how a run computes, not what its network is
    assert from_dict(ModelConfig, {}).fused_attention is False  # eager unless asked


@pytest.mark.slow
def test_graphed_training_steps_run_the_fused_read_as_eager_steps_train() -> None:
    """``model.graphs``' training steps, run without capture (what a CPU runs of them), with the fused read: the
    warm-up compiles it before the step that a GPU would capture, and the weights end as eager steps with the fused
    read leave them. (Against the eager read Adam would magnify the read's last-bit differences, wherever a gradient
    is near 0, beyond any useful tolerance: the read's own equality is the tests' above.)"""
    decoder = {"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16, "dropout": 0.0}
    eager = fit(CaptionerModule, decoder=decoder, fused_attention=True)
    replays = fit(EagerReplays, decoder=decoder, fused_attention=True)
    assert replays.graphed_steps is not None and replays.model.decoder.attention.fused
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(replays.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
