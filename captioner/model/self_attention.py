"""Optional self-attention over the encoder grid (SAGAN-style non-local blocks) before the decoder attends.

Each block lets every location see every other: query/key/value 1x1 projections, softmax over the L
positions, an output projection, and a gated residual ``x + gamma * out`` whose gate starts at 0, so a
freshly added block is exactly the identity and pretrained grid features pass through unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captioner.config import SelfAttentionConfig
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


class GridSelfAttention(nn.Module):
    """One gated multi-head self-attention block over (B, L, C) grid features.

    ``Linear`` over C on (B, L, C) is the 1x1 convolution of the non-local block. With ``positional``,
    a fixed 2-D sinusoidal encoding of the grid is added to the input of the query and key projections
    (not to the values), so attention can depend on where locations are.
    """

    def __init__(self, dim: int, heads: int, positional: bool) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"self_attention.heads={heads} must divide the feature dim {dim}")
        if positional and dim % 4:
            raise ConfigError(f"self_attention.positional needs a feature dim divisible by 4, got {dim}")
        self.dim = dim
        self.heads = heads
        self.positional = positional
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.gamma = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """x (B, L, C) with L = H * W of ``grid`` (H, W) -> (B, L, C)."""
        batch, length, dim = x.shape
        if length != grid[0] * grid[1]:
            raise ValueError(f"{length} locations do not form a {grid[0]}x{grid[1]} grid")
        qk_input = x
        if self.positional:
            qk_input = x + sinusoidal_grid_encoding(dim, grid, x.device, x.dtype)  # (B, L, C)

        def split(t: Tensor) -> Tensor:  # (B, L, C) -> (B, heads, L, C / heads)
            return t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)

        q, k, v = split(self.query(qk_input)), split(self.key(qk_input)), split(self.value(x))
        out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, L, C / heads), softmax over positions
        out = self.out(out.transpose(1, 2).reshape(batch, length, dim))  # (B, L, C)
        return x + self.gamma * out

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, positional={self.positional}"


class SelfAttentionStack(nn.Module):
    """``config.blocks`` (at least one) GridSelfAttention blocks over ``dim`` channels, applied in turn."""

    def __init__(self, dim: int, config: SelfAttentionConfig) -> None:
        super().__init__()
        check_range("self_attention.blocks", config.blocks, low=1, kind=int)
        self.blocks = nn.ModuleList(
            GridSelfAttention(dim, config.heads, config.positional) for _ in range(config.blocks)
        )

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """x (B, L, C), grid (H, W) -> (B, L, C)."""
        for block in self.blocks:
            x = block(x, grid)
        return x
