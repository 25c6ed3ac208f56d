"""The whole captioner (encoder, optional grid self-attention, decoder) and its inference bundle.

A bundle is one torch file holding plain data and tensors only: the model config, the vocabulary and
the state dict. It needs neither the training code nor the encoder's pretrained weight file to load,
and it is read with ``weights_only=True``, so it never runs pickled code.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from captioner.data.vocab import Vocabulary
from captioner.errors import BundleError, ConfigError, DataError, check_choice
from captioner.fileio import load_torch, save_torch
from captioner.model.decoder import DecoderOutput, ShowAttendTellDecoder
from captioner.model.decoding import Generation, beam_search, greedy, sample
from captioner.model.encoder import Encoder
from captioner.model.self_attention import SelfAttentionStack

BUNDLE_FORMAT = "captioner-bundle"
BUNDLE_VERSION = 1
METHODS = ("greedy", "sample", "beam")
_SECTIONS = ("encoder", "feature_norm", "self_attention", "decoder")
_SELF_ATTENTION_KEYS = ("blocks", "heads", "positional")
_BUNDLE_KEYS = ("format", "version", "config", "vocab", "vocab_fingerprint", "state_dict")

Grid = tuple[int, int]


def _square_grid(locations: int) -> Grid:
    side = math.isqrt(locations)
    if side * side != locations:
        raise ValueError(f"{locations} locations are not a square grid: pass grid=(H, W)")
    return side, side


class Captioner(nn.Module):
    """Encoder -> optional self-attention over the grid -> Show, Attend and Tell decoder.

    ``encode`` gives the encoder's grid features, the part worth caching for a frozen encoder;
    ``forward_features`` and ``generate_from_features`` take it from there (self-attention included),
    so ``forward(images, ...) == forward_features(*encode(images) ...)``.
    """

    def __init__(self, encoder: Encoder, decoder: ShowAttendTellDecoder,
                 self_attention: SelfAttentionStack | None = None, feature_norm: bool = False) -> None:
        super().__init__()
        self.encoder = encoder
        # Standardises each feature channel with statistics learned in training: a frozen CNN's
        # features (above all an untrained one's) can sit far from the scale the decoder's tanh expects.
        self.feature_norm = nn.BatchNorm1d(encoder.out_channels) if feature_norm else None
        self.self_attention = self_attention
        self.decoder = decoder

    def encode(self, images: Tensor) -> tuple[Tensor, Grid]:
        """Images (B, 3, H_img, W_img) -> encoder features (B, L, C) and their grid (H, W), L = H * W."""
        feature_map = self.encoder.feature_map(images)  # (B, C, H, W)
        grid = (feature_map.shape[2], feature_map.shape[3])
        return feature_map.flatten(2).transpose(1, 2), grid  # (B, L, C)

    def attend_grid(self, features: Tensor, grid: Grid | None = None) -> Tensor:
        """Feature normalisation and self-attention blocks (each if configured): (B, L, C) -> (B, L, C).

        ``grid`` defaults to the square grid of L locations.
        """
        if self.feature_norm is not None:
            features = self.feature_norm(features.transpose(1, 2)).transpose(1, 2)  # per channel over B*L
        if self.self_attention is None:
            return features
        return self.self_attention(features, grid or _square_grid(features.size(1)))

    def forward(self, images: Tensor, captions: Tensor, image_index: Tensor | None = None) -> DecoderOutput:
        """Teacher-forced outputs for captions (N, T+1) of images (B, ...); the encoder runs once per image.

        ``image_index`` (N,) gives each caption's image (None: caption n belongs to image n).
        """
        features, grid = self.encode(images)  # (B, L, C)
        return self.forward_features(features, captions, image_index, grid)

    def forward_features(self, features: Tensor, captions: Tensor, image_index: Tensor | None = None,
                         grid: Grid | None = None) -> DecoderOutput:
        """Like ``forward`` from (cached) encoder features (B, L, C); runs self-attention, not the encoder."""
        return self.decoder(self.attend_grid(features, grid), captions, image_index)

    @torch.no_grad()
    def generate(self, images: Tensor, method: str = "beam", beam_size: int = 3, max_len: int = 20,
                 temperature: float = 1.0, length_penalty: float = 0.0, start_id: int = 1, end_id: int = 2,
                 generator: torch.Generator | None = None) -> tuple[Generation, Grid]:
        """Caption images (B, 3, H_img, W_img) without gradients; call ``.eval()`` first.

        ``method`` is "greedy", "sample" (``temperature``, ``generator``) or "beam" (``beam_size``,
        ``length_penalty``). Returns the Generation (tokens, scores, per-word alphas (B, T, L), lengths)
        and the (H, W) grid that the L attention weights of each word lie on.
        """
        features, grid = self.encode(images)  # (B, L, C)
        return self.generate_from_features(
            features, grid, method=method, beam_size=beam_size, max_len=max_len, temperature=temperature,
            length_penalty=length_penalty, start_id=start_id, end_id=end_id, generator=generator)

    @torch.no_grad()
    def generate_from_features(self, features: Tensor, grid: Grid | None = None, method: str = "beam",
                               beam_size: int = 3, max_len: int = 20, temperature: float = 1.0,
                               length_penalty: float = 0.0, start_id: int = 1, end_id: int = 2,
                               generator: torch.Generator | None = None) -> tuple[Generation, Grid]:
        """Like ``generate`` from (cached) encoder features (B, L, C); ``grid`` defaults to square."""
        check_choice("method", method, METHODS)
        grid = grid or _square_grid(features.size(1))
        features = self.attend_grid(features, grid)  # (B, L, C)
        if method == "greedy":
            generation = greedy(self.decoder, features, max_len, start_id, end_id)
        elif method == "sample":
            generation = sample(self.decoder, features, max_len, start_id, end_id, temperature, generator)
        else:
            generation = beam_search(self.decoder, features, max_len, start_id, end_id, beam_size, length_penalty)
        return generation, grid


def _keyword_names(cls: type, exclude: tuple[str, ...] = ()) -> list[str]:
    return [name for name in inspect.signature(cls).parameters if name not in exclude]


def _section(config: Mapping, name: str, valid: Sequence[str]) -> dict:
    """``config[name]`` as a dict (missing or None -> {}), refusing keys outside ``valid``."""
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"model config {name!r} must be a mapping, got {type(value).__name__}")
    for key in value:
        if key not in valid:
            raise ConfigError(f"unknown model config key {name}.{key}; valid keys: {', '.join(valid)}")
    return dict(value)


def _split_config(config: Mapping) -> tuple[dict, dict, dict]:
    """Check the keys of a model config and return its encoder, self-attention and decoder sections."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"model config must be a mapping, got {type(config).__name__}")
    for key in config:
        if key not in _SECTIONS:
            raise ConfigError(f"unknown model config key {key!r}; valid keys: {', '.join(_SECTIONS)}")
    encoder = _section(config, "encoder", _keyword_names(Encoder))
    self_attention = _section(config, "self_attention", _SELF_ATTENTION_KEYS)
    decoder = _section(config, "decoder", _keyword_names(ShowAttendTellDecoder, ("vocab_size", "feature_dim")))
    return encoder, self_attention, decoder


def build_captioner(config: Mapping, vocab_size: int) -> Captioner:
    """Build a Captioner from ``{"encoder": {...}, "feature_norm": bool, "self_attention": {...} | None,
    "decoder": {...}}``.

    ``encoder`` holds Encoder arguments; ``self_attention`` (None or absent: none) holds ``blocks``
    (default 1; 0: none), ``heads`` and ``positional``; ``decoder`` holds ShowAttendTellDecoder
    arguments other than ``vocab_size`` and ``feature_dim`` (the encoder's channels).
    Unknown keys raise ConfigError.
    """
    encoder_args, attention_args, decoder_args = _split_config(config)
    feature_norm = config.get("feature_norm", False)
    if not isinstance(feature_norm, bool):
        raise ConfigError(f"model config feature_norm={feature_norm!r} must be true or false")
    encoder = Encoder(**encoder_args)
    self_attention = None
    if config.get("self_attention") is not None and attention_args.get("blocks", 1) != 0:
        self_attention = SelfAttentionStack(encoder.out_channels, **attention_args)
    decoder = ShowAttendTellDecoder(vocab_size=vocab_size, feature_dim=encoder.out_channels, **decoder_args)
    return Captioner(encoder, decoder, self_attention, feature_norm=feature_norm)


def _plain(value: object, where: str = "config") -> object:
    """A copy of ``value`` made of dicts, lists, str, int, float, bool and None (OmegaConf containers too)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, Sequence):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ConfigError(f"{where} is a {type(value).__name__}; a bundle config holds plain data only")


def _embedding_mismatch(model: nn.Module, state_dict: Mapping, vocab_size: int) -> str | None:
    """Describe an embedding in ``state_dict`` whose rows differ from ``vocab_size``, if any."""
    for name, module in model.named_modules():
        weight = state_dict.get(f"{name}.weight")
        if isinstance(module, nn.Embedding) and isinstance(weight, Tensor) and weight.size(0) != vocab_size:
            return f"the vocabulary has {vocab_size} words but the {name} weights have {weight.size(0)} rows"
    return None


def save_bundle(path: str | os.PathLike, model: Captioner, vocab: Vocabulary, config: Mapping) -> None:
    """Write an inference bundle (config, vocabulary, weights) atomically; plain data and tensors only."""
    _split_config(config)
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings != len(vocab):
            raise BundleError(f"cannot save bundle {path}: the vocabulary has {len(vocab)} words but the "
                              f"{name} weights have {module.num_embeddings} rows")
    # torch.compile wraps a module as `<name>._orig_mod`: the bundle keeps the plain names
    state_dict = {key.replace("_orig_mod.", ""): value.detach().cpu() for key, value in model.state_dict().items()}
    save_torch({
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "config": _plain(config),
        "vocab": vocab.to_dict(),
        "vocab_fingerprint": vocab.fingerprint(),
        "state_dict": state_dict,
    }, path)


def _state_dict_problem(model: nn.Module, state_dict: Mapping) -> str | None:
    """Describe the missing, unexpected and reshaped keys of ``state_dict`` for ``model``, if any."""
    expected = model.state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    reshaped = [f"{key} {tuple(state_dict[key].shape)} vs {tuple(value.shape)}" for key, value in expected.items()
                if key in state_dict and state_dict[key].shape != value.shape]
    problems = []
    labelled = (("missing", missing), ("unexpected", unexpected), ("shape mismatch (saved vs model)", reshaped))
    for label, keys in labelled:
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            problems.append(f"{label}: {', '.join(keys[:3])}{more}")
    return "; ".join(problems) or None


def load_bundle(path: str | os.PathLike, map_location: str | torch.device = "cpu"
                ) -> tuple[Captioner, Vocabulary, dict]:
    """Load a bundle written by ``save_bundle``: the model (in eval mode), its vocabulary and config.

    Raises BundleError naming the file when it is not a bundle, is from a newer version, or its
    vocabulary, config or weights do not fit together. The encoder is built without pretrained
    weights (the bundle carries them), so no weight file is needed.
    """
    bundle = load_torch(path, what="bundle", map_location=map_location)

    def refuse(reason: str) -> BundleError:
        return BundleError(f"bundle {path}: {reason}")

    if not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT:
        raise refuse(f"not a captioner bundle (expected \"format\": \"{BUNDLE_FORMAT}\")")
    version = bundle.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise refuse(f"invalid bundle version {version!r}")
    if version > BUNDLE_VERSION:
        raise refuse(f"bundle version {version} is newer than this captioner reads ({BUNDLE_VERSION}); upgrade it")
    missing = [key for key in _BUNDLE_KEYS if key not in bundle]
    if missing:
        raise refuse(f"not a complete bundle (missing {', '.join(missing)})")
    try:
        vocab = Vocabulary.from_dict(bundle["vocab"])
    except DataError as exc:
        raise refuse(f"malformed vocabulary ({exc})") from None
    if vocab.fingerprint() != bundle["vocab_fingerprint"]:
        raise refuse(f"vocabulary fingerprint {bundle['vocab_fingerprint']!r} does not match its words "
                     f"({vocab.fingerprint()!r}): the vocabulary was altered")
    config = bundle["config"]
    state_dict = bundle["state_dict"]
    if not isinstance(state_dict, dict) or not all(isinstance(v, Tensor) for v in state_dict.values()):
        raise refuse("state_dict is not a mapping of names to tensors")
    try:
        encoder_args, _, _ = _split_config(config)
        model = build_captioner({**config, "encoder": {**encoder_args, "weights": None}}, len(vocab))
    except (ConfigError, TypeError, ValueError) as exc:
        raise refuse(f"its config does not build a model ({exc})") from None
    problem = _embedding_mismatch(model, state_dict, len(vocab)) or _state_dict_problem(model, state_dict)
    if problem:
        raise refuse(f"weights do not fit the model: {problem}")
    if isinstance(map_location, (str, torch.device)):
        model.to(map_location)
    model.load_state_dict(state_dict)
    return model.eval(), vocab, config
