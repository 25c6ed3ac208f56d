"""Grid self-attention: identity at init, the softmax-over-positions maths, heads, positions."""

from __future__ import annotations

import math

import pytest
import torch

from captioner.config import SelfAttentionConfig
from captioner.errors import ConfigError
from captioner.model.self_attention import GridSelfAttention, SelfAttentionStack, sinusoidal_grid_encoding

GRID = (2, 3)  # H, W -> L = 6


def _features(dim: int = 8, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, GRID[0] * GRID[1], dim, generator=torch.Generator().manual_seed(seed))  # (B, L, C)


def _reference(block: GridSelfAttention, x: torch.Tensor, qk_input: torch.Tensor) -> torch.Tensor:
    """The block written out: per head softmax_j(q_i . k_j / sqrt(d)) over positions j."""
    batch, length, dim = x.shape
    d = dim // block.heads
    q, k, v = block.query(qk_input), block.key(qk_input), block.value(x)  # (B, L, C)
    heads = []
    for h in range(block.heads):
        part = slice(h * d, (h + 1) * d)
        weights = torch.softmax(q[..., part] @ k[..., part].transpose(1, 2) / math.sqrt(d), dim=-1)  # (B, L, L)
        assert torch.allclose(weights.sum(-1), torch.ones(batch, length))
        heads.append(weights @ v[..., part])  # (B, L, d)
    return x + block.gamma * block.out(torch.cat(heads, dim=-1))


def test_fresh_block_is_the_identity():
    torch.manual_seed(0)
    x = _features()
    for block in (GridSelfAttention(8, heads=2, positional=True), SelfAttentionStack(8, SelfAttentionConfig(blocks=3))):
        assert torch.equal(block(x, GRID), x)


@pytest.mark.parametrize("heads", [1, 4])
def test_output_matches_hand_computed_attention(heads):
    torch.manual_seed(0)
    block = GridSelfAttention(8, heads=heads, positional=False)
    with torch.no_grad():
        block.gamma.fill_(0.7)
    x = _features()
    out = block(x, GRID)
    assert not torch.allclose(out, x)
    torch.testing.assert_close(out, _reference(block, x, x))


def test_one_position_attends_to_itself_only():
    torch.manual_seed(0)
    block = GridSelfAttention(4, heads=1, positional=False)
    with torch.no_grad():
        block.gamma.fill_(1.0)
    x = torch.randn(1, 1, 4)  # a 1x1 grid: softmax over one position is 1
    torch.testing.assert_close(block(x, (1, 1)), x + block.out(block.value(x)))


def test_multi_head_backward_reaches_the_gate_first():
    torch.manual_seed(0)
    block = GridSelfAttention(8, heads=2, positional=False)
    x = _features().requires_grad_()
    block(x, GRID).pow(2).sum().backward()
    assert block.gamma.grad.abs() > 0  # the gate opens first ...
    assert torch.count_nonzero(block.query.weight.grad) == 0  # ... the projections follow once it is open
    with torch.no_grad():
        block.gamma.fill_(0.5)
    block.zero_grad()
    block(x, GRID).pow(2).sum().backward()
    for name, parameter in block.named_parameters():
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().sum() > 0, name


def test_positional_encoding_values():
    encoding = sinusoidal_grid_encoding(8, GRID)  # (L, 8): [sin r, cos r] x 2 freqs, then [sin c, cos c]
    assert encoding.shape == (6, 8)
    freqs = torch.tensor([1.0, 0.01])  # 10000 ** (-i / 2)
    for row in range(GRID[0]):
        for col in range(GRID[1]):
            expected = torch.cat(
                [torch.sin(row * freqs), torch.cos(row * freqs), torch.sin(col * freqs), torch.cos(col * freqs)]
            )
            torch.testing.assert_close(encoding[row * GRID[1] + col], expected)


def test_positional_encoding_changes_queries_and_keys_deterministically():
    torch.manual_seed(0)
    plain = GridSelfAttention(8, heads=2, positional=False)
    positional = GridSelfAttention(8, heads=2, positional=True)
    positional.load_state_dict(plain.state_dict())  # no extra parameters: the encoding is fixed
    with torch.no_grad():
        plain.gamma.fill_(0.5)
        positional.gamma.fill_(0.5)
    x = _features()
    out = positional(x, GRID)
    assert not torch.allclose(out, plain(x, GRID))
    assert torch.equal(out, positional(x, GRID))
    qk_input = x + sinusoidal_grid_encoding(8, GRID)
    torch.testing.assert_close(out, _reference(positional, x, qk_input))  # values see no positions
    assert not torch.allclose(positional(x, (3, 2)), out)  # the grid shape matters


def test_stack_applies_blocks_in_turn():
    torch.manual_seed(0)
    stack = SelfAttentionStack(8, SelfAttentionConfig(blocks=2, heads=2, positional=True))
    with torch.no_grad():
        for i, block in enumerate(stack.blocks):
            block.gamma.fill_(0.3 + i)
    x = _features()
    expected = stack.blocks[1](stack.blocks[0](x, GRID), GRID)
    torch.testing.assert_close(stack(x, GRID), expected)


def test_invalid_settings_refused():
    with pytest.raises(ConfigError, match="heads=3 must divide the feature dim 8"):
        GridSelfAttention(8, heads=3, positional=False)
    with pytest.raises(ConfigError, match="divisible by 4"):
        GridSelfAttention(6, heads=1, positional=True)
    with pytest.raises(ConfigError, match="blocks"):
        SelfAttentionStack(8, SelfAttentionConfig(blocks=0))
    with pytest.raises(ValueError, match="6 locations do not form a 2x2 grid"):
        GridSelfAttention(8, heads=1, positional=False)(_features(), (2, 2))
