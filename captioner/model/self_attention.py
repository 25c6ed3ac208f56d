"""Optional self-attention over the encoder grid (SAGAN-style non-local blocks) before the decoder attends.

Each block lets every location see every other: query/key/value 1x1 projections, softmax over the L
positions, an output projection, and a gated residual ``x + gamma * out`` whose gate starts at 0, so a
freshly added block is exactly the identity and pretrained grid features pass through unchanged.

Where the locations are (``SelfAttentionConfig.positional``): nowhere (``none``: attention over a set), a
fixed 2-D sinusoidal encoding added to the queries' and keys' input (``absolute``), or relation-aware
self-attention with clipped relative position representations (``relative``, Shaw et al. 2018), which sees
the row and column offset between two locations rather than their places, so it runs unchanged on a grid
size it was not trained on. docs/self_attention.md writes out the equations.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captioner.config import Positional, SelfAttentionConfig
from captioner.errors import ConfigError, check_range


def sinusoidal_grid_encoding(
    dim: int, grid: tuple[int, int], device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Fixed 2-D sinusoidal position encoding of an (H, W) grid -> (H * W, dim), row-major.

    The first half of the channels encodes the row, the second half the column; each half is
    ``[sin(p * w_0), ..., sin(p * w_{k-1}), cos(p * w_0), ..., cos(p * w_{k-1})]`` with
    ``w_i = 10000 ** (-i / k)`` and ``k = dim / 4``.
    """
    if dim % 4:
        raise ConfigError(f"self_attention positional encoding needs a feature dim divisible by 4, got {dim}")
    height, width = grid
    quarter = dim // 4
    freqs = torch.exp(torch.arange(quarter, device=device, dtype=torch.float32) * (-math.log(10000.0) / quarter))
    rows = torch.arange(height, device=device, dtype=torch.float32)[:, None] * freqs  # (H, dim/4)
    cols = torch.arange(width, device=device, dtype=torch.float32)[:, None] * freqs  # (W, dim/4)
    rows = torch.cat([rows.sin(), rows.cos()], dim=1)[:, None, :].expand(height, width, dim // 2)
    cols = torch.cat([cols.sin(), cols.cos()], dim=1)[None, :, :].expand(height, width, dim // 2)
    return torch.cat([rows, cols], dim=2).reshape(height * width, dim).to(dtype)  # (L, dim)


def clipped_offset_index(size: int, max_distance: int, device: torch.device | None = None) -> Tensor:
    """(size, size): entry [i, j] is the table row of the offset j - i along one axis,
    ``clip(j - i, -k, k) + k`` in [0, 2k] with k = ``max_distance`` (Shaw et al. eq. 5)."""
    positions = torch.arange(size, device=device)
    return (positions[None, :] - positions[:, None]).clamp(-max_distance, max_distance) + max_distance


class RelativePositions(nn.Module):
    """Clipped relative position representations over a 2-D grid, per head (Shaw et al. 2018).

    The vector of the offset from location i to location j is the sum of a row-offset and a column-offset
    vector, ``a_ij = w_rows[clip(row_j - row_i)] + w_cols[clip(col_j - col_i)]``, one pair of tables for
    the keys (a^K) and one for the values (a^V). No (L, L, d) tensor is formed: a query meets each table's
    2k + 1 vectors once, ``q @ w^T``, and a one-hot map P (L, H or W, 2k + 1) from each location's offsets to
    the table rows spreads those scores over the keys' rows and columns; the values' side sums each
    location's attention weights per offset with the same map and multiplies by the table.
    """

    def __init__(self, heads: int, head_dim: int, max_distance: int) -> None:
        super().__init__()
        self.max_distance = max_distance
        shape = (heads, 2 * max_distance + 1, head_dim)
        self.key_rows, self.key_cols, self.value_rows, self.value_cols = (
            nn.Parameter(nn.init.trunc_normal_(torch.empty(shape), std=0.02)) for _ in range(4)
        )

    def offset_maps(self, grid: tuple[int, int], device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """One-hot offset maps of an (H, W) grid: rows (L, H, 2k+1) and columns (L, W, 2k+1); entry [i, r, m]
        is 1 where row (column) r lies at the clipped offset m - k from location i's row (column)."""
        height, width = grid
        location = torch.arange(height * width, device=device)
        rows = clipped_offset_index(height, self.max_distance, device)[location // width]  # (L, H)
        cols = clipped_offset_index(width, self.max_distance, device)[location % width]  # (L, W)
        offsets = 2 * self.max_distance + 1
        return F.one_hot(rows, offsets).to(dtype), F.one_hot(cols, offsets).to(dtype)

    def key_scores(self, q: Tensor, maps: tuple[Tensor, Tensor]) -> Tensor:
        """q (B, heads, L, d) -> q_i . a^K_ij (B, heads, L, L), j row-major over the grid."""
        rows, cols = maps
        by_row = torch.einsum("bhld,hmd->bhlm", q, self.key_rows)  # (B, heads, L, 2k+1)
        by_col = torch.einsum("bhld,hmd->bhlm", q, self.key_cols)
        by_row = torch.einsum("bhlm,lrm->bhlr", by_row, rows)  # (B, heads, L, H): per key row
        by_col = torch.einsum("bhlm,lcm->bhlc", by_col, cols)  # (B, heads, L, W): per key column
        return (by_row[..., :, None] + by_col[..., None, :]).flatten(-2)  # (B, heads, L, H * W)

    def value_context(self, weights: Tensor, maps: tuple[Tensor, Tensor]) -> Tensor:
        """Attention weights (B, heads, L, L) -> sum_j alpha_ij a^V_ij (B, heads, L, d)."""
        rows, cols = maps
        grid_weights = weights.unflatten(-1, (rows.size(1), cols.size(1)))  # (B, heads, L, H, W)
        by_row = torch.einsum("bhlr,lrm->bhlm", grid_weights.sum(-1), rows)  # (B, heads, L, 2k+1): per offset
        by_col = torch.einsum("bhlc,lcm->bhlm", grid_weights.sum(-2), cols)
        return torch.einsum("bhlm,hmd->bhld", by_row, self.value_rows) + torch.einsum(
            "bhlm,hmd->bhld", by_col, self.value_cols
        )

    def extra_repr(self) -> str:
        return f"max_distance={self.max_distance}"


class GridSelfAttention(nn.Module):
    """One gated multi-head self-attention block over (B, L, C) grid features.

    ``Linear`` over C on (B, L, C) is the 1x1 convolution of the non-local block. ``config.positional``:
    ``absolute`` adds a fixed 2-D sinusoidal encoding of the grid to the input of the query and key
    projections (not to the values); ``relative`` adds learned offset vectors inside the attention,
    ``e_ij = q_i . (k_j + a^K_ij) / sqrt(d)`` and ``z_i = sum_j alpha_ij (v_j + a^V_ij)``.
    """

    def __init__(self, dim: int, config: SelfAttentionConfig) -> None:
        super().__init__()
        heads, positional = config.heads, config.positional
        if dim % heads:
            raise ConfigError(f"self_attention.heads={heads} must divide the feature dim {dim}")
        if positional == Positional.absolute and dim % 4:
            raise ConfigError(f"self_attention.positional=absolute needs a feature dim divisible by 4, got {dim}")
        self.dim = dim
        self.heads = heads
        self.positional = positional
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.relative = None
        if positional == Positional.relative:
            self.relative = RelativePositions(heads, dim // heads, config.max_distance)
        self.gamma = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """x (B, L, C) with L = H * W of ``grid`` (H, W) -> (B, L, C)."""
        batch, length, dim = x.shape
        if length != grid[0] * grid[1]:
            raise ValueError(f"{length} locations do not form a {grid[0]}x{grid[1]} grid")
        qk_input = x
        if self.positional == Positional.absolute:
            qk_input = x + sinusoidal_grid_encoding(dim, grid, x.device, x.dtype)  # (B, L, C)

        def split(t: Tensor) -> Tensor:  # (B, L, C) -> (B, heads, L, C / heads)
            return t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)

        q, k, v = split(self.query(qk_input)), split(self.key(qk_input)), split(self.value(x))
        if self.relative is None:
            out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, L, C / heads), softmax over positions
        else:
            out = self._relative_attention(q, k, v, grid)
        out = self.out(out.transpose(1, 2).reshape(batch, length, dim))  # (B, L, C)
        return x + self.gamma * out

    def _relative_attention(self, q: Tensor, k: Tensor, v: Tensor, grid: tuple[int, int]) -> Tensor:
        """Relation-aware attention (Shaw et al. eqs. 3-4) of q, k, v (B, heads, L, d) -> (B, heads, L, d)."""
        maps = self.relative.offset_maps(grid, q.device, q.dtype)
        scores = (q @ k.transpose(-1, -2) + self.relative.key_scores(q, maps)) / math.sqrt(q.size(-1))  # e_ij
        weights = scores.softmax(dim=-1)  # alpha_ij (B, heads, L, L)
        return weights @ v + self.relative.value_context(weights, maps)  # z_i

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, positional={self.positional}"


class SelfAttentionStack(nn.Module):
    """``config.blocks`` (at least one) GridSelfAttention blocks over ``dim`` channels, applied in turn."""

    def __init__(self, dim: int, config: SelfAttentionConfig) -> None:
        super().__init__()
        check_range("self_attention.blocks", config.blocks, low=1, kind=int)
        self.blocks = nn.ModuleList(GridSelfAttention(dim, config) for _ in range(config.blocks))

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """x (B, L, C), grid (H, W) -> (B, L, C)."""
        for block in self.blocks:
            x = block(x, grid)
        return x
