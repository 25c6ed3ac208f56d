"""Grid self-attention: identity at init, the softmax-over-positions maths, heads, absolute and relative positions."""

from __future__ import annotations

import math

import pytest
import torch

from captioner.config import NetConfig, SelfAttentionConfig, from_dict
from captioner.errors import ConfigError
from captioner.model.self_attention import (
    GridSelfAttention,
    SelfAttentionStack,
    clipped_offset_index,
    sinusoidal_grid_encoding,
)
from captioner.training.command_line import error_line
from conftest import compose_cfg, net_v1

GRID = (2, 3)  # H, W -> L = 6


def _block(dim: int = 8, heads: int = 1, positional: str = "none", max_distance: int = 2) -> GridSelfAttention:
    return GridSelfAttention(dim, SelfAttentionConfig(heads=heads, positional=positional, max_distance=max_distance))


def _open(block: GridSelfAttention, gate: float = 1.0) -> GridSelfAttention:
    with torch.no_grad():
        block.gamma.fill_(gate)
    return block


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


@pytest.mark.parametrize("positional", ["none", "absolute", "relative"])
def test_fresh_block_is_the_identity(positional):
    torch.manual_seed(0)
    x = _features()
    stack = SelfAttentionStack(8, SelfAttentionConfig(blocks=3, heads=2, positional=positional, max_distance=1))
    for block in (_block(8, heads=2, positional=positional), stack):
        assert torch.equal(block(x, GRID), x)


@pytest.mark.parametrize("heads", [1, 4])
def test_output_matches_hand_computed_attention(heads):
    torch.manual_seed(0)
    block = _block(8, heads=heads)
    with torch.no_grad():
        block.gamma.fill_(0.7)
    x = _features()
    out = block(x, GRID)
    assert not torch.allclose(out, x)
    torch.testing.assert_close(out, _reference(block, x, x))


def test_one_position_attends_to_itself_only():
    torch.manual_seed(0)
    block = _block(4)
    with torch.no_grad():
        block.gamma.fill_(1.0)
    x = torch.randn(1, 1, 4)  # a 1x1 grid: softmax over one position is 1
    torch.testing.assert_close(block(x, (1, 1)), x + block.out(block.value(x)))


def test_multi_head_backward_reaches_the_gate_first():
    torch.manual_seed(0)
    block = _block(8, heads=2)
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
    plain = _block(8, heads=2)
    positional = _block(8, heads=2, positional="absolute")
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
    stack = SelfAttentionStack(8, SelfAttentionConfig(blocks=2, heads=2, positional="absolute"))
    with torch.no_grad():
        for i, block in enumerate(stack.blocks):
            block.gamma.fill_(0.3 + i)
    x = _features()
    expected = stack.blocks[1](stack.blocks[0](x, GRID), GRID)
    torch.testing.assert_close(stack(x, GRID), expected)


def test_invalid_settings_refused():
    with pytest.raises(ConfigError, match="heads=3 must divide the feature dim 8"):
        _block(8, heads=3)
    with pytest.raises(ConfigError, match="blocks"):
        SelfAttentionStack(8, SelfAttentionConfig(blocks=0))
    with pytest.raises(ValueError, match="6 locations do not form a 2x2 grid"):
        _block(8)(_features(), (2, 2))


# ------------------------------------------------------------------------------ relative positions
def _relative_reference(block: GridSelfAttention, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Shaw et al. written out head by head, the (L, L, d) tensors a^K, a^V built cell by cell:
    e_ij = q_i . (k_j + a^K_ij) / sqrt(d), z_i = sum_j softmax_j(e_ij) (v_j + a^V_ij)."""
    height, width = grid
    length, d, k = height * width, block.dim // block.heads, block.relative.max_distance
    tables = block.relative
    q, key, v = block.query(x), block.key(x), block.value(x)  # (B, L, C)

    def clip(offset: int) -> int:
        return max(-k, min(k, offset)) + k

    heads = []
    for h in range(block.heads):
        a_k, a_v = torch.zeros(length, length, d), torch.zeros(length, length, d)
        for i in range(length):
            for j in range(length):
                row, col = clip(j // width - i // width), clip(j % width - i % width)
                a_k[i, j] = tables.key_rows[h, row] + tables.key_cols[h, col]
                a_v[i, j] = tables.value_rows[h, row] + tables.value_cols[h, col]
        part = slice(h * d, (h + 1) * d)
        scores = q[..., part] @ key[..., part].transpose(1, 2) + torch.einsum("bid,ijd->bij", q[..., part], a_k)
        weights = torch.softmax(scores / math.sqrt(d), dim=-1)  # (B, L, L)
        heads.append(weights @ v[..., part] + torch.einsum("bij,ijd->bid", weights, a_v))  # (B, L, d)
    return x + block.gamma * block.out(torch.cat(heads, dim=-1))


def _grid_features(grid: tuple[int, int], dim: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, grid[0] * grid[1], dim, generator=torch.Generator().manual_seed(seed))  # (B, L, C)


def test_clipped_offset_index():
    index = clipped_offset_index(6, 2)  # [i, j]: clip(j - i, -2, 2) + 2
    assert index.shape == (6, 6)
    assert index[0].tolist() == [2, 3, 4, 4, 4, 4]  # offsets 2..5 share the last entry
    assert index[5].tolist() == [0, 0, 0, 0, 1, 2]
    assert index[3].tolist() == [0, 0, 1, 2, 3, 4]
    assert torch.equal(index.diagonal(), torch.full((6,), 2))
    assert torch.equal(clipped_offset_index(4, 9), torch.arange(4)[None, :] - torch.arange(4)[:, None] + 9)


@pytest.mark.parametrize(("heads", "max_distance", "grid"), [(1, 1, (3, 4)), (2, 2, (3, 4)), (4, 1, (4, 2))])
def test_relative_attention_matches_a_per_head_reference(heads, max_distance, grid):
    torch.manual_seed(0)
    block = _open(_block(8, heads=heads, positional="relative", max_distance=max_distance), 0.7)
    x = _grid_features(grid)
    out = block(x, grid)
    torch.testing.assert_close(out, _relative_reference(block, x, grid))
    plain = _open(_block(8, heads=heads), 0.7)
    plain.load_state_dict(block.state_dict(), strict=False)  # the same projections, no offsets
    assert (out - plain(x, grid)).abs().max() > 1e-3  # the offsets change the output


def test_every_relative_parameter_learns_once_the_gate_is_open():
    torch.manual_seed(0)
    block = _open(_block(8, heads=2, positional="relative"), 0.5)
    block(_grid_features((3, 4)), (3, 4)).pow(2).sum().backward()
    for name, parameter in block.named_parameters():
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().sum() > 0, name


def test_offsets_beyond_max_distance_share_one_vector():
    """A block with k=2 equals a k=5 block whose tables repeat the k=2 ends beyond offset 2, on a 3x8 grid."""
    torch.manual_seed(0)
    grid = (3, 8)
    near = _open(_block(8, heads=2, positional="relative", max_distance=2))
    far = _open(_block(8, heads=2, positional="relative", max_distance=5))
    far.load_state_dict({k: v for k, v in near.state_dict().items() if not k.startswith("relative.")}, strict=False)
    spread = clipped_offset_index(11, 5)[5] - 5  # offsets -5..5 ...
    spread = spread.clamp(-2, 2) + 2  # ... as rows of the k=2 tables
    with torch.no_grad():
        for name in ("key_rows", "key_cols", "value_rows", "value_cols"):
            getattr(far.relative, name).copy_(getattr(near.relative, name)[:, spread])
    x = _grid_features(grid)
    torch.testing.assert_close(far(x, grid), near(x, grid))
    with torch.no_grad():
        far.relative.value_cols[:, 5 + 3] += 1.0  # column offset +3: its own vector in the k=5 block
    assert (far(x, grid) - near(x, grid)).abs().max() > 1e-3


def _shifted(x: torch.Tensor, grid: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """(B, L, C) content moved ``rows`` down and ``cols`` right on the grid (what leaves the grid comes in
    at the other side: the callers' content never reaches a border)."""
    return x.unflatten(1, grid).roll((rows, cols), dims=(1, 2)).flatten(1, 2)


@pytest.mark.parametrize(("positional", "equivariant"), [("relative", True), ("absolute", False)])
def test_relative_positions_shift_with_the_content(positional, equivariant):
    """Content far from the borders on an empty background: with relative positions (and no absolute
    encoding) moving the content by whole cells moves the block's output on it alike.

    The background (zero features, zero query and key biases) scores far below the content (queries and
    keys are 2 x, content pairs score ~ 4 |x|^2 / sqrt(d), offsets a few units), so the border cells, whose
    offsets to the content differ after the move, take no attention.
    """
    torch.manual_seed(0)
    grid = (12, 12)
    block = _open(_block(8, heads=2, positional=positional, max_distance=2))
    with torch.no_grad():
        block.query.weight.copy_(2 * torch.eye(8))
        block.key.weight.copy_(2 * torch.eye(8))
        block.query.bias.zero_()
        block.key.bias.zero_()
        if block.relative is not None:
            for table in block.relative.parameters():
                table.normal_(std=0.3)
    generator = torch.Generator().manual_seed(1)
    content = torch.zeros(1, 12, 12, 8)
    content[0, 3:6, 2:6] = 4 * torch.randn(8, generator=generator) + 0.1 * torch.randn(3, 4, 8, generator=generator)
    x = content.flatten(1, 2)  # (1, L, C)
    inside = content.abs().sum(-1).flatten() > 0  # the content's cells (L,)
    moved = _shifted(x, grid, 4, 3)
    out, out_moved = block(x, grid), block(moved, grid)
    difference = (_shifted(out, grid, 4, 3) - out_moved)[0, _shifted(inside[None, :, None], grid, 4, 3)[0, :, 0]]
    assert (out - x)[0, inside].abs().max() > 0.1  # the block changes the content's features ...
    plain = _open(_block(8, heads=2))
    plain.load_state_dict(block.state_dict(), strict=False)
    assert (out - plain(x, grid))[0, inside].abs().max() > 1e-2  # ... and where the content's cells lie matters
    if equivariant:
        assert difference.abs().max() < 1e-4
    else:
        assert difference.abs().max() > 1e-2  # the sinusoidal encoding sees where the content is


def test_a_relative_block_runs_on_grid_sizes_it_was_not_trained_on():
    torch.manual_seed(0)
    block = _block(8, heads=2, positional="relative", max_distance=4)
    optimizer = torch.optim.Adam(block.parameters(), lr=0.05)
    for _ in range(3):  # trained at 12x12
        optimizer.zero_grad()
        block(_grid_features((12, 12)), (12, 12)).pow(2).mean().backward()
        optimizer.step()
    assert block.gamma.abs() > 0
    for grid in ((8, 8), (16, 16), (5, 9)):
        x = _grid_features(grid, seed=2)
        out = block(x, grid)
        assert out.shape == x.shape and torch.isfinite(out).all()
        torch.testing.assert_close(out, _relative_reference(block, x, grid))


def test_positional_settings():
    with pytest.raises(ConfigError, match=r"^self_attention.positional=True is not valid; choose one of: none, "):
        from_dict(NetConfig, {"self_attention": {"positional": True}})
    with pytest.raises(ConfigError, match=r"^max_distance=0 must be in \[1, 256\]"):
        SelfAttentionConfig(positional="relative", max_distance=0)
    with pytest.raises(ConfigError, match="positional=absolute needs a feature dim divisible by 4"):
        _block(6, positional="absolute")
    assert _block(6, heads=2, positional="relative").relative.key_rows.shape == (2, 5, 3)  # 2k + 1 offsets, k=2


def test_bundles_written_with_positional_true_or_false_still_load():
    for old, new in ((True, "absolute"), (False, "none")):
        assert net_v1({"self_attention": {"blocks": 1, "positional": old}}).self_attention.positional == new
    assert net_v1({"self_attention": {"positional": "relative"}}).self_attention.max_distance == 4


def test_a_config_with_positional_true_is_refused_in_one_line_naming_the_choices(tmp_path):
    with pytest.raises(Exception) as raised:
        compose_cfg(["model.self_attention.positional=true"], tmp_path)
    assert error_line(raised.value) == (
        "model.self_attention.positional=True is not valid; choose one of: none, absolute, relative"
    )
