"""Attention scorers over the L annotation vectors a_i of an image (Xu et al. 2015, section 3.1.2).

Every scorer splits its work in two: ``keys`` projects the features once per image (the ``W_a a_i``
term does not depend on the step t), and ``forward`` scores those keys against the LSTM state
h_{t-1} at each step, giving alpha_t = softmax_i(e_ti) (eq. 4-5) and the expected context
sum_i alpha_ti a_i (section 4.2). The state may hold K queries per image (B, K, H), e.g. the K beams
of a beam search: they are scored against the image's one copy of keys and features.

The additive scorer may run its whole read (eq. 4, 5 and the context) as one function compiled by inductor
(``fused``): its tanh energies over (B, K, L, A), the largest tensor of a decoder step, are then computed inside
fused kernels rather than written out and read back, forward and backward. The eager code below is that
function's source; a compiled call holds no host sync, so it runs inside a captured CUDA graph once warmed up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captioner.config import Scorer
from captioner.errors import ConfigError, check_choice, check_range


class Attention(nn.Module):
    """Base of all scorers: ``key`` projects the features once, ``score`` compares them with h."""

    def __init__(self, key: nn.Module) -> None:
        super().__init__()
        self.key = key

    def keys(self, features: Tensor) -> Tensor:
        """Project the features (B, L, D) once per image into keys (B, L, A)."""
        return self.key(features)

    def score(self, keys: Tensor, h: Tensor) -> Tensor:
        """Unnormalised scores e_ti (B, K, L) of the keys (B, L, A) against K states h_{t-1} (B, K, H) (eq. 4)."""
        raise NotImplementedError

    def forward(self, keys: Tensor, features: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """Return the context sum_i alpha_i a_i and the weights alpha, which sum to 1 over the L locations.

        ``h`` (B, H) gives (B, D) and (B, L); ``h`` (B, K, H), K queries per image against its keys
        (B, L, A) and features (B, L, D), gives (B, K, D) and (B, K, L).
        """
        if h.dim() == 3:
            return self.attend(keys, features, h)
        context, alpha = self.attend(keys, features, h.unsqueeze(1))
        return context.squeeze(1), alpha.squeeze(1)

    def attend(self, keys: Tensor, features: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """The context (B, K, D) and alpha (B, K, L) of K queries h (B, K, H) per image."""
        alpha = self.score(keys, h).softmax(dim=-1)  # (B, K, L), eq. 5
        return torch.bmm(alpha, features), alpha  # (B, K, D): one read of the features for all K


class AdditiveAttention(Attention):
    """The paper's MLP scorer: e_ti = w^T tanh(W_a a_i + W_h h_{t-1} + b).

    ``fused`` (off until set: ``ShowAttendTellDecoder.fuse_attention``): ``attend`` (scores, softmax and context)
    runs as one inductor-compiled function, the same values.
    """

    def __init__(self, feature_dim: int, hidden_dim: int, attention_dim: int) -> None:
        super().__init__(nn.Linear(feature_dim, attention_dim))  # W_a and b
        self.query = nn.Linear(hidden_dim, attention_dim, bias=False)  # W_h
        self.energy = nn.Linear(attention_dim, 1, bias=False)  # w
        self.fused = False

    def score(self, keys: Tensor, h: Tensor) -> Tensor:
        hidden = (keys.unsqueeze(1) + self.query(h).unsqueeze(2)).tanh_()  # (B, K, L, A); in place: one allocation
        return self.energy(hidden).squeeze(-1)  # (B, K, L)

    def attend(self, keys: Tensor, features: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        # inside a step that dynamo compiles whole (model.compile), that step's graph takes the read in
        if self.fused and not torch.compiler.is_compiling():
            return _fused_attend()(self, keys, features, h)
        return super().attend(keys, features, h)


@functools.cache
def _fused_attend() -> Callable[..., tuple[Tensor, Tensor]]:
    """``Attention.attend`` compiled whole, made on the first fused call (importing dynamo takes ~1.5 s). The scorer
    is an argument, not bound, so that every scorer (a deepcopy's, an ensemble member's) shares one compilation per
    grad mode, dtype and shape kind (the batch and K dimensions turn dynamic at the first other size)."""
    return torch.compile(Attention.attend, fullgraph=True)


class DotAttention(Attention):
    """Dot product of the projected features and the projected state: e_ti = (W_q h)^T (W_k a_i) * s.

    The two projections make the dimensions match; ``scaled`` sets s = 1 / sqrt(A), else s = 1.
    """

    def __init__(self, feature_dim: int, hidden_dim: int, attention_dim: int, scaled: bool = False) -> None:
        super().__init__(nn.Linear(feature_dim, attention_dim, bias=False))  # W_k
        self.query = nn.Linear(hidden_dim, attention_dim, bias=False)  # W_q
        self.scale = attention_dim**-0.5 if scaled else 1.0

    def score(self, keys: Tensor, h: Tensor) -> Tensor:
        query = self.query(h).transpose(1, 2)  # (B, A, K)
        return torch.bmm(keys, query).transpose(1, 2) * self.scale  # (B, K, L)


class BilinearAttention(Attention):
    """Luong's "general" scorer e_ti = h^T W a_i with a full-rank W; its keys W a_i are (B, L, H)."""

    def __init__(self, feature_dim: int, hidden_dim: int) -> None:
        super().__init__(nn.Linear(feature_dim, hidden_dim, bias=False))  # W

    def score(self, keys: Tensor, h: Tensor) -> Tensor:
        return torch.bmm(keys, h.transpose(1, 2)).transpose(1, 2)  # (B, K, L)


class MultiHeadAttention(Attention):
    """Several scaled dot-product heads over projected keys and values, one query per image.

    ``keys`` returns keys and values side by side (B, L, 2A), projected once per image. The context
    is the heads' concatenated output mapped back to D; alpha is the heads' average weights (what an
    attention overlay shows and what hard attention samples from).
    """

    def __init__(self, feature_dim: int, hidden_dim: int, attention_dim: int, heads: int) -> None:
        if attention_dim % heads:
            raise ConfigError(f"attention_dim={attention_dim} must be divisible by attention_heads={heads}")
        super().__init__(nn.Linear(feature_dim, 2 * attention_dim))  # W_k and W_v in one matmul
        self.query = nn.Linear(hidden_dim, attention_dim)
        self.out = nn.Linear(attention_dim, feature_dim)
        self.heads = heads

    def attend(self, keys: Tensor, features: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        batch, locations, _ = keys.shape
        queries = h.size(1)  # K
        key, value = keys.view(batch, locations, 2, self.heads, -1).permute(2, 0, 3, 1, 4)  # (B, heads, L, d)
        query = self.query(h).view(batch, queries, self.heads, -1).transpose(1, 2)  # (B, heads, K, d)
        context = F.scaled_dot_product_attention(query, key, value)  # (B, heads, K, d)
        # SDPA does not return its weights: recompute them for alpha (K queries per head, cheap).
        weights = (query @ key.transpose(-1, -2) * key.size(-1) ** -0.5).softmax(dim=-1)  # (B, heads, K, L)
        context = context.transpose(1, 2).reshape(batch, queries, -1)  # (B, K, heads * d)
        return self.out(context), weights.mean(dim=1)  # (B, K, D), (B, K, L)


class MeanAttention(Attention):
    """No attention, the ablation: alpha_ti = 1 / L at every step, so each word reads the mean feature.

    What a model that only sees the mean feature can say, compared with the same model attending,
    measures how much a dataset needs attention.
    """

    def __init__(self) -> None:
        super().__init__(nn.Identity())  # no parameters: the keys are the features themselves

    def score(self, keys: Tensor, h: Tensor) -> Tensor:
        return keys.new_zeros(keys.size(0), h.size(1), keys.size(1))  # (B, K, L): equal scores, uniform weights


def build_attention(kind: Scorer | str, feature_dim: int, hidden_dim: int, attention_dim: int, heads: int) -> Attention:
    """Build the scorer ``kind`` (a ``Scorer`` or its name); only ``Scorer.multihead`` takes ``heads`` > 1.

    ConfigError names the settings as a config sets them (``scorer``, ``decoder.attention_heads``).
    """
    check_choice("scorer", kind, list(Scorer))
    kind = Scorer(kind)
    check_range("decoder.attention_heads", heads, 1, kind=int)
    if kind == Scorer.multihead:
        return MultiHeadAttention(feature_dim, hidden_dim, attention_dim, heads)
    if heads != 1:
        raise ConfigError(f"decoder.attention_heads={heads} needs scorer=multihead (got scorer={kind})")
    if kind == Scorer.additive:
        return AdditiveAttention(feature_dim, hidden_dim, attention_dim)
    if kind == Scorer.bilinear:
        return BilinearAttention(feature_dim, hidden_dim)
    if kind == Scorer.mean:
        return MeanAttention()
    return DotAttention(feature_dim, hidden_dim, attention_dim, scaled=kind == Scorer.scaled_dot)
