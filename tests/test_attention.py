"""Attention scorers: values of each formula, alpha a distribution, gradients, configuration errors."""

import pytest
import torch
from torch.testing import assert_close

from captioner.config import Scorer
from captioner.errors import ConfigError
from captioner.model.attention import build_attention

ATTENTION_TYPES = [kind.value for kind in Scorer]

B, L, D, H, A = 3, 5, 6, 7, 8
SCORERS = [kind for kind in ATTENTION_TYPES if kind != "mean"]  # those that look at h


def make(kind: str, heads: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    return build_attention(kind, D, H, A, heads)


@pytest.fixture
def inputs():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(B, L, D, generator=generator), torch.randn(B, H, generator=generator)


@pytest.mark.parametrize("kind", SCORERS)
def test_every_scorer_runs_forward_and_backward(kind, inputs):
    features, h = (x.clone().requires_grad_() for x in inputs)
    attention = make(kind, heads=2 if kind == "multihead" else 1)
    context, alpha = attention(attention.keys(features), features, h)
    assert context.shape == (B, D) and alpha.shape == (B, L)
    assert_close(alpha.sum(dim=-1), torch.ones(B))
    assert (alpha > 0).all()
    (context.square().sum() + (alpha * torch.arange(L)).sum()).backward()
    for name, parameter in attention.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name
    for tensor in (features, h):
        assert torch.isfinite(tensor.grad).all() and tensor.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["additive", "dot", "scaled_dot", "bilinear", "mean"])
def test_context_is_the_alpha_weighted_sum_of_features(kind, inputs):
    features, h = inputs
    attention = make(kind)
    context, alpha = attention(attention.keys(features), features, h)
    expected = torch.stack([sum(alpha[b, i] * features[b, i] for i in range(L)) for b in range(B)])
    assert_close(context, expected)


def test_mean_attention_reads_the_mean_feature_whatever_the_state(inputs):
    features, h = inputs
    attention = make("mean")
    assert not list(attention.parameters())
    for state in (h, -3 * h):
        context, alpha = attention(attention.keys(features), features, state)
        assert_close(alpha, torch.full((B, L), 1 / L))
        assert_close(context, features.mean(dim=1))


def test_additive_is_the_papers_mlp(inputs):
    features, h = inputs
    attention = make("additive")
    w_a, b = attention.key.weight, attention.key.bias  # (A, D), (A,)
    w_h, w = attention.query.weight, attention.energy.weight  # (A, H), (1, A)
    scores = torch.einsum("ka,bla->blk", w, torch.tanh(features @ w_a.T + b + (h @ w_h.T)[:, None])).squeeze(-1)
    _, alpha = attention(attention.keys(features), features, h)
    assert_close(alpha, scores.softmax(dim=-1))


def test_dot_scaled_dot_and_bilinear_scores(inputs):
    features, h = inputs
    dot, scaled, bilinear = make("dot"), make("scaled_dot", seed=1), make("bilinear")
    scaled.load_state_dict(dot.state_dict())
    scores = torch.einsum("bha,bla->bl", (h @ dot.query.weight.T)[:, None], features @ dot.key.weight.T)
    assert_close(dot(dot.keys(features), features, h)[1], scores.softmax(-1))
    assert_close(scaled(scaled.keys(features), features, h)[1], (scores / A**0.5).softmax(-1))
    general = torch.einsum("bh,hd,bld->bl", h, bilinear.key.weight, features)  # h^T W a_i
    assert_close(bilinear(bilinear.keys(features), features, h)[1], general.softmax(-1))
    assert bilinear.keys(features).shape == (B, L, H)


def test_multihead_matches_a_per_head_reference(inputs):
    features, h = inputs
    heads, size = 2, A // 2
    attention = make("multihead", heads=heads)
    keys = attention.keys(features)
    assert keys.shape == (B, L, 2 * A)
    context, alpha = attention(keys, features, h)
    k, v = (features @ attention.key.weight.T + attention.key.bias).split(A, dim=-1)  # (B, L, A) each
    q = attention.query(h)  # (B, A)
    outputs, weights = [], []
    for head in range(heads):
        part = slice(head * size, (head + 1) * size)
        weight = (torch.einsum("bd,bld->bl", q[:, part], k[..., part]) / size**0.5).softmax(-1)  # (B, L)
        weights.append(weight)
        outputs.append(torch.einsum("bl,bld->bd", weight, v[..., part]))
    assert_close(context, attention.out(torch.cat(outputs, dim=-1)))
    assert_close(alpha, torch.stack(weights).mean(dim=0))
    assert_close(alpha.sum(-1), torch.ones(B))


@pytest.mark.parametrize("kind", ATTENTION_TYPES)
def test_keys_depend_on_features_only_and_forward_does_not_recompute_them(kind, inputs):
    features, h = inputs
    attention = make(kind, heads=2 if kind == "multihead" else 1)
    calls = []
    attention.key.register_forward_hook(lambda *args: calls.append(1))
    keys = attention.keys(features)
    for step in range(4):
        attention(keys, features, h + step)
    assert len(calls) == 1


def test_unknown_kind_lists_the_choices():
    with pytest.raises(ConfigError) as error:
        build_attention("luong", D, H, A, 1)
    assert all(kind in str(error.value) for kind in ATTENTION_TYPES)


@pytest.mark.parametrize("kind, heads", [("multihead", 3), ("additive", 2), ("multihead", 0)])
def test_bad_heads_raise_config_error(kind, heads):
    with pytest.raises(ConfigError, match="attention"):
        build_attention(kind, D, H, A, heads)


def test_saturated_scores_stay_finite(inputs):
    features, h = inputs
    attention = make("dot")
    context, alpha = attention(attention.keys(features * 1e4), features * 1e4, h * 1e4)
    assert torch.isfinite(alpha).all() and torch.isfinite(context).all()
    assert_close(alpha.sum(-1), torch.ones(B))


@pytest.mark.parametrize("kind", ATTENTION_TYPES)
def test_k_queries_per_image_equal_one_query_at_a_time(kind, inputs):
    """States (B, K, H), e.g. K beams, scored against one copy of each image's keys and features give
    what each query gets alone: context (B, K, D) and alpha (B, K, L)."""
    features, _ = inputs
    queries = torch.randn(B, 4, H, generator=torch.Generator().manual_seed(2))  # K = 4
    attention = make(kind, heads=2 if kind == "multihead" else 1)
    keys = attention.keys(features)
    context, alpha = attention(keys, features, queries)
    assert context.shape == (B, 4, D) and alpha.shape == (B, 4, L)
    for k in range(4):
        alone = attention(keys, features, queries[:, k])
        assert_close(context[:, k], alone[0])
        assert_close(alpha[:, k], alone[1])
