"""Ensembles of trained captioners decoding together: at every word each member reads the image through its own
encoder, at its own input size, and scores the next word from its own state and attention; the ensemble's word
distribution is by default the normalised mean of the members' log-probabilities, log p(w) = mean_m log p_m(w)
- log Z (a geometric mean: a word any member finds unlikely stays unlikely), or the mean of their probabilities,
log p(w) = log mean_m p_m(w), as ruotianluo's ``AttEnsemble`` and fairseq average (``EnsembleMean``).

``EnsembleDecoder`` presents the one-step interface that ``decoding`` calls on a ``ShowAttendTellDecoder``
(``attention.keys``, ``init_state``, ``step``, its graph cache), so greedy, sampling and beam search decode an
ensemble unchanged, batched and captured as one CUDA graph as a single model is. The members' features, keys and
states travel through them as one tensor each: features (B, F) and keys (B, F') are the members' own
flattened side by side, the state is the members' (h, c) pairs one after another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captioner.config import Compile, DecodingConfig, EnsembleMean, HardInference, ModelConfig
from captioner.model.captioner import Captioner, Grid
from captioner.model.decoder import ShowAttendTellDecoder, StepOutput
from captioner.model.decoding import Generation, decode
from captioner.model.graphs import GraphCache


@dataclass(frozen=True)
class Layout:
    """The shapes one member decodes on: its attention grid, its feature channels and its attention keys."""

    grid: Grid  # (H, W): L = H * W locations
    channels: int  # D
    keys: tuple[int, ...]  # one image's keys, (L, A) for the additive scorer

    @property
    def features(self) -> tuple[int, int]:
        """One image's grid features (L, D)."""
        return self.grid[0] * self.grid[1], self.channels


class EnsembleDecoder(nn.Module):
    """The members' decoders behind one decoder's one-step interface; ``layouts`` are their shapes, in order.

    ``step`` returns as logits (float32), for ``mean`` log, the mean of the members' logits, which differs from the
    mean of their log-softmax by a constant per row: the log-softmax that every decoding method takes of it is
    exactly the normalised mean of the members' log-probabilities; for ``mean`` prob, log mean_m p_m(w), already
    normalised. The attention of a word is the mean of the members' on
    the first member's grid, each map on another grid resampled onto it (bilinear, antialiased) and normalised.
    """

    def __init__(
        self,
        members: Sequence[ShowAttendTellDecoder],
        layouts: Sequence[Layout],
        mean: EnsembleMean = EnsembleMean.log,
    ) -> None:
        super().__init__()
        if not members or len(members) != len(layouts):
            raise ValueError(f"an ensemble needs one layout per member, got {len(members)} and {len(layouts)}")
        self.members = nn.ModuleList(members)
        self.layouts = tuple(layouts)
        self.mean = EnsembleMean(mean)
        # decoding graphs per combination of the members' hard attention reads (each read is captured in a graph)
        self.graph_caches: dict[tuple[HardInference | None, ...], GraphCache] | None = {}

    @property
    def attention(self) -> EnsembleDecoder:
        """What ``decoding`` asks for the keys (``attention.keys``): the ensemble itself."""
        return self

    @property
    def hard_read(self) -> HardInference | None:
        """The members' common read at inference (None: soft attention, or members that read differently)."""
        reads = {member.hard_read for member in self.members}
        return reads.pop() if len(reads) == 1 else None

    @property
    def graphed(self) -> bool:
        """Whether a member replays a CUDA graph per word (``compile_step``): the ensemble's calls run eagerly."""
        return any(member.graphed for member in self.members)

    @property
    def decoding_graphs(self) -> GraphCache | None:
        """The decoding calls captured for the members' present reads (``decoding.decode``); None: eager."""
        if self.graph_caches is None:
            return None
        reads = tuple(member.hard_read for member in self.members)
        return self.graph_caches.get(reads) or self.graph_caches.setdefault(reads, GraphCache())

    def use_decoding_graphs(self, on: bool) -> None:
        """Replay each decoding call on CUDA as one CUDA graph (``on``, the default) or run it eagerly."""
        self.graph_caches = {} if on else None

    def compile_step(self, mode: Compile) -> None:
        """Compile every member's step (``ShowAttendTellDecoder.compile_step``)."""
        for member in self.members:
            member.compile_step(mode)

    def pack(self, features: Sequence[Tensor]) -> Tensor:
        """The members' grid features, each (B, L_m, D_m) as its layout says, side by side: (B, F)."""
        for number, (tensor, layout) in enumerate(zip(features, self.layouts, strict=True)):
            if tuple(tensor.shape[1:]) != layout.features:
                raise ValueError(f"member {number}: features {tuple(tensor.shape)}, expected (B, *{layout.features})")
        return torch.cat([tensor.flatten(1) for tensor in features], dim=1)  # (B, F)

    def keys(self, features: Tensor) -> Tensor:
        """The members' attention keys of the packed features (B, F), packed the same way: (B, F')."""
        parts = _unpacked(features, [layout.features for layout in self.layouts])
        return torch.cat([m.attention.keys(part).flatten(1) for m, part in zip(self.members, parts)], dim=1)

    def init_state(self, features: Tensor) -> tuple[Tensor, ...]:
        """Each member's (h_0, c_0) in turn: 2M tensors (B, H_m)."""
        parts = _unpacked(features, [layout.features for layout in self.layouts])
        return tuple(s for member, part in zip(self.members, parts) for s in member.init_state(part))

    def step(self, tokens: Tensor, state: tuple[Tensor, ...], features: Tensor, keys: Tensor) -> StepOutput:
        """One word of every member from the previous tokens (B,) or (B, K), the members' states and the packed
        features and keys; the outputs of ``ShowAttendTellDecoder.step``, with the mean logits (B, [K,] V) and
        attention (B, [K,] L_0), the members' states in turn, and the sums of their location log-probabilities and
        entropies (hard attention in training mode: the members' locations are one joint choice)."""
        parts = _unpacked(features, [layout.features for layout in self.layouts])
        key_parts = _unpacked(keys, [layout.keys for layout in self.layouts])
        outputs = [
            member.step(tokens, state[2 * m : 2 * m + 2], part, key)
            for m, (member, part, key) in enumerate(zip(self.members, parts, key_parts))
        ]
        logits = torch.stack([out[0].float() for out in outputs])  # (M, B, [K,] V)
        if self.mean == EnsembleMean.log:
            logits = logits.mean(dim=0)  # (B, [K,] V)
        else:
            logits = torch.logsumexp(logits.log_softmax(dim=-1), dim=0) - math.log(len(outputs))  # (B, [K,] V)
        states = tuple(s for out in outputs for s in out[1])
        alpha = torch.stack([self._on_first_grid(out[2], m) for m, out in enumerate(outputs)]).mean(dim=0)
        return logits, states, alpha, _summed([out[3] for out in outputs]), _summed([out[4] for out in outputs])

    def _on_first_grid(self, alpha: Tensor, member: int) -> Tensor:
        """Member ``member``'s attention (..., L_m) on the first member's grid (..., L_0)."""
        source, target = self.layouts[member].grid, self.layouts[0].grid
        if source == target:
            return alpha
        maps = alpha.reshape(-1, 1, *source)  # (N, 1, H_m, W_m)
        resized = F.interpolate(maps, size=target, mode="bilinear", align_corners=False, antialias=True).clamp_min(0)
        resized = resized.flatten(1)  # (N, L_0)
        return (resized / resized.sum(dim=1, keepdim=True).clamp_min(1e-12)).view(*alpha.shape[:-1], -1)


class EnsembleCaptioner(nn.Module):
    """Trained captioners decoding as one (``EnsembleDecoder``), each reading its own images: ``image_sizes``
    are the members' square input sides, in order; ``mean`` how their word distributions are averaged. Build it in
    eval mode; the members are used, not copied."""

    def __init__(
        self, members: Sequence[Captioner], image_sizes: Sequence[int], mean: EnsembleMean = EnsembleMean.log
    ) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.image_sizes = tuple(image_sizes)
        layouts = [_layout(member, size) for member, size in zip(members, image_sizes, strict=True)]
        self.decoder = EnsembleDecoder([member.decoder for member in members], layouts, mean)

    @torch.no_grad()
    def generate(
        self,
        images: Sequence[Tensor],
        decoding: DecodingConfig | None = None,
        generator: torch.Generator | None = None,
        unk_id: int | None = None,
        static_shapes: bool | None = ModelConfig.static_shapes,
    ) -> tuple[Generation, Grid]:
        """Caption a batch given once per member, (B, 3, S_m, S_m) for member m, as ``Captioner.generate`` does;
        the attention weights (B, T, L_0) lie on the first member's grid, which is returned."""
        if len(images) != len(self.members):
            raise ValueError(f"an ensemble of {len(self.members)} models takes {len(self.members)} image batches")
        features = [member.grid_features(*member.encode(pixels))[0] for member, pixels in zip(self.members, images)]
        settings = DecodingConfig.captioning() if decoding is None else decoding
        packed = self.decoder.pack(features)  # (B, F)
        return decode(self.decoder, packed, settings, generator, unk_id, static_shapes), self.decoder.layouts[0].grid


def _layout(member: Captioner, image_size: int) -> Layout:
    """The shapes ``member`` decodes on for square ``image_size`` images."""
    grid = member.encoder.grid_size(image_size)
    channels = member.encoder.out_channels
    weight = next(member.decoder.parameters())
    with torch.no_grad():
        probe = torch.zeros(1, grid[0] * grid[1], channels, device=weight.device, dtype=weight.dtype)
        keys = tuple(member.decoder.attention.keys(probe).shape[1:])
    return Layout(grid, channels, keys)


def _unpacked(packed: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """The members' tensors (B, *shape_m) of a packed (B, sum_m prod(shape_m)), each contiguous: a copy where
    there are several members (a strided view would change a matrix product's rounding, and the ensemble of two
    copies of a model would not score exactly as the model does)."""
    parts = packed.split([math.prod(shape) for shape in shapes], dim=1)
    return [part.unflatten(1, shape).contiguous() for part, shape in zip(parts, shapes)]


def _summed(values: list[Tensor | None]) -> Tensor | None:
    """The sum of the members' values, None unless every member gave one."""
    return None if any(value is None for value in values) else torch.stack(values).sum(dim=0)
