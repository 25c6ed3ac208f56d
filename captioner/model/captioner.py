"""The whole captioner: encoder, optional self-attention over its grid, Show, Attend and Tell decoder.

``build_captioner`` builds one from a ``NetConfig``; ``captioner.bundle`` saves and loads it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from captioner.config import DecodingConfig, ModelConfig, NetConfig
from captioner.model.decoder import DecoderOutput, ShowAttendTellDecoder
from captioner.model.decoding import Generation, decode
from captioner.model.encoder import Encoder
from captioner.model.self_attention import SelfAttentionStack

Grid = tuple[int, int]


def _square_grid(locations: int) -> Grid:
    side = math.isqrt(locations)
    if side * side != locations:
        raise ValueError(f"{locations} locations are not a square grid: pass grid=(H, W)")
    return side, side


class Captioner(nn.Module):
    """Encoder -> optional self-attention over the grid -> Show, Attend and Tell decoder.

    ``encode`` gives the output of the encoder's frozen part, the part worth caching (all of a frozen
    encoder: its grid features); ``forward_features`` and ``generate_from_features`` take it from there
    (the encoder's trained stages, then self-attention), so
    ``forward(images, ...) == forward_features(*encode(images) ...)``.
    """

    def __init__(
        self,
        encoder: Encoder,
        decoder: ShowAttendTellDecoder,
        self_attention: SelfAttentionStack | None,
        feature_norm: bool,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        # Standardises each feature channel with statistics learned in training: a frozen CNN's
        # features (above all an untrained one's) can sit far from the scale the decoder's tanh expects.
        # No affine: every reader of the grid starts with a linear map that absorbs a per-channel scale
        # and shift, and a learnable one would make each step backpropagate through the whole grid.
        self.feature_norm = nn.BatchNorm1d(encoder.out_channels, affine=False) if feature_norm else None
        self.self_attention = self_attention
        self.decoder = decoder

    def encode(self, images: Tensor) -> tuple[Tensor, Grid]:
        """Images (B, 3, H_img, W_img) -> the encoder's frozen part's output (B, L', C') and its grid
        (H', W'), L' = H' * W': the grid features (B, L, C) themselves when the whole encoder is frozen."""
        feature_map = self.encoder.frozen_map(images)  # (B, C', H', W')
        grid = (feature_map.shape[2], feature_map.shape[3])
        return feature_map.flatten(2).transpose(1, 2), grid  # (B, L', C')

    def finish_encoding(self, features: Tensor, grid: Grid | None = None) -> tuple[Tensor, Grid]:
        """The encoder's trained stages on ``encode``'s output: (B, L', C') -> grid features (B, L, C) and
        their grid (H, W); nothing to do for a frozen encoder. ``grid`` defaults to the square one."""
        grid = grid or _square_grid(features.size(1))
        if self.encoder.frozen:
            return features, grid
        frozen = features.transpose(1, 2).unflatten(2, grid)  # (B, C', H', W')
        feature_map = self.encoder.trained_map(frozen)  # (B, C, H, W)
        return feature_map.flatten(2).transpose(1, 2), (feature_map.shape[2], feature_map.shape[3])

    def attend_grid(self, features: Tensor, grid: Grid | None = None) -> Tensor:
        """Feature normalisation and self-attention blocks (each if configured): (B, L, C) -> (B, L, C).

        ``grid`` defaults to the square grid of L locations.
        """
        if self.feature_norm is not None:
            features = self.feature_norm(features.transpose(1, 2)).transpose(1, 2)  # per channel over B*L
        if self.self_attention is None:
            return features
        return self.self_attention(features, grid or _square_grid(features.size(1)))

    def forward(self, images: Tensor, captions: Tensor, image_index: Tensor | int | None = None) -> DecoderOutput:
        """Teacher-forced outputs for captions (N, T+1) of images (B, ...); the encoder runs once per image.

        ``image_index`` gives each caption's image as ``ShowAttendTellDecoder.forward`` reads it: (N,), or K
        captions per image in order, or None (caption n belongs to image n).
        """
        features, grid = self.encode(images)  # (B, L', C')
        return self.forward_features(features, captions, image_index, grid)

    def forward_features(
        self, features: Tensor, captions: Tensor, image_index: Tensor | int | None = None, grid: Grid | None = None
    ) -> DecoderOutput:
        """Like ``forward`` from (cached) ``encode`` output (B, L', C') on its grid (default square)."""
        features, grid = self.finish_encoding(features, grid)  # (B, L, C)
        return self.decoder(self.attend_grid(features, grid), captions, image_index)

    def grid_features(self, features: Tensor, grid: Grid | None = None) -> tuple[Tensor, Grid]:
        """What the decoder reads at inference of ``encode``'s output (B, L', C') on its grid (default square): the
        encoder's trained stages, feature normalisation and self-attention; grid features (B, L, C), contiguous
        (one layout for every caller: an ensemble's members read theirs so, and a matrix product's rounding
        depends on it), and their grid."""
        features, grid = self.finish_encoding(features, grid)  # (B, L, C)
        return self.attend_grid(features, grid).contiguous(), grid

    @torch.no_grad()
    def generate(
        self,
        images: Tensor,
        decoding: DecodingConfig | None = None,
        generator: torch.Generator | None = None,
        unk_id: int | None = None,
        static_shapes: bool | None = ModelConfig.static_shapes,
    ) -> tuple[Generation, Grid]:
        """Caption images (B, 3, H_img, W_img) without gradients; call ``.eval()`` first.

        The options are ``generate_from_features``'. Returns the Generation (tokens, scores, per-word alphas
        (B, T, L), lengths) and the (H, W) grid that the L attention weights of each word lie on.
        """
        features, grid = self.encode(images)  # (B, L', C')
        return self.generate_from_features(features, grid, decoding, generator, unk_id, static_shapes)

    @torch.no_grad()
    def generate_from_features(
        self,
        features: Tensor,
        grid: Grid | None = None,
        decoding: DecodingConfig | None = None,
        generator: torch.Generator | None = None,
        unk_id: int | None = None,
        static_shapes: bool | None = ModelConfig.static_shapes,
    ) -> tuple[Generation, Grid]:
        """Caption (cached) ``encode`` output (B, L', C') on its grid (default square) without gradients.

        ``decoding``: the method and its options (None: captioning's, ``DecodingConfig.captioning()``);
        ``generator`` serves sampling; ``unk_id`` (the vocabulary's <unk>) is never generated when given;
        ``static_shapes``: see ``ModelConfig.static_shapes``. Returns the Generation and the grid the
        attention weights lie on.
        """
        features, grid = self.grid_features(features, grid)  # (B, L, C)
        settings = DecodingConfig.captioning() if decoding is None else decoding
        return decode(self.decoder, features, settings, generator, unk_id, static_shapes), grid


def build_captioner(net: NetConfig, vocab_size: int) -> Captioner:
    """Build the Captioner of ``net`` for ``vocab_size`` words (``captioner.bundle.read_net``
    reads the ``NetConfig`` of a bundle's config)."""
    encoder = Encoder(net.encoder)
    self_attention = None
    if net.self_attention.blocks > 0:
        self_attention = SelfAttentionStack(encoder.out_channels, net.self_attention)
    decoder = ShowAttendTellDecoder(vocab_size, encoder.out_channels, net)
    return Captioner(encoder, decoder, self_attention, feature_norm=net.feature_norm)
