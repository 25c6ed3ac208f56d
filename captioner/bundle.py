"""The inference bundle's file format, and the reading of the training checkpoints that carry the same metadata.

A bundle is one torch file holding plain data and tensors only: the model config (``NetConfig``'s own
serialisation), the vocabulary, the preprocessing settings (the image size the model was trained with), how
its run decoded its final scores (captioning starts from those: ``decoding``, left out by earlier versions)
and the state dict. Its versions, and the reading of the model config of every earlier one, are
``captioner.bundle_versions``'s. It needs neither the training code nor the encoder's pretrained weight file to
load, and it is read with ``weights_only=True``, so it never runs pickled code. Training checkpoints carry the
same metadata under ``checkpoint["captioner"]``, so ``load_trained`` reads either kind of file. Plain torch: neither
Lightning nor Hydra is needed to load a model. This module only reads and writes files: captioning with
what it loads is ``captioner.inference``'s (``load_model``), which builds on this module, never the reverse.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from captioner.bundle_versions import BUNDLE_VERSION, read_net
from captioner.config import (
    MAX_IMAGE_SIZE,
    MAX_MODEL_BYTES,
    MIN_IMAGE_SIZE,
    DecodingConfig,
    NetConfig,
    from_dict,
    to_dict,
)
from captioner.data.vocab import Vocabulary
from captioner.errors import BundleError, ConfigError, DataError, check_range
from captioner.fileio import load_torch, save_torch
from captioner.model.captioner import Captioner, build_captioner
from captioner.run_files import BUNDLE_NAME, CHECKPOINT_DIR, FAILED_FILE, STOPPED_FILE

BUNDLE_FORMAT = "captioner-bundle"
_METADATA_KEYS = ("config", "vocab", "vocab_fingerprint")
_BUNDLE_KEYS = ("format", "version", *_METADATA_KEYS, "state_dict")
PREPROCESS_KEYS = ("image_size",)
CHECKPOINT_KEY = "captioner"  # where a training checkpoint keeps the bundle metadata
# A model file holds at most this many times MAX_MODEL_BYTES: a training checkpoint keeps the weights and Adam's
# two moments of each, a bundle the weights and its vocabulary.
MODEL_FILE_COPIES = 3


def _max_file_bytes() -> int:
    """The most bytes a bundle or a training checkpoint may hold (``load_torch``'s ``max_bytes``)."""
    return MODEL_FILE_COPIES * MAX_MODEL_BYTES


def is_bundle(raw: object) -> bool:
    """Whether ``raw`` (a loaded torch file) is an inference bundle."""
    return isinstance(raw, dict) and raw.get("format") == BUNDLE_FORMAT


def is_lightning_checkpoint(raw: object) -> bool:
    """Whether ``raw`` (a loaded torch file) is a Lightning checkpoint."""
    return isinstance(raw, dict) and "pytorch-lightning_version" in raw and "state_dict" in raw


def _check_preprocess(preprocess: object) -> dict:
    """``preprocess`` as a plain ``{"image_size": int}``; ConfigError naming a wrong or missing key."""
    if not isinstance(preprocess, Mapping):
        raise ConfigError(f"preprocess must be a mapping, got {type(preprocess).__name__}")
    for key in preprocess:
        if key not in PREPROCESS_KEYS:
            raise ConfigError(f"unknown preprocess key {key!r}; valid keys: {', '.join(PREPROCESS_KEYS)}")
    if "image_size" not in preprocess:
        raise ConfigError("preprocess has no image_size")
    check_range("preprocess.image_size", preprocess["image_size"], MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, kind=int)
    return {"image_size": preprocess["image_size"]}


def bundle_metadata(
    net: NetConfig, vocab: Vocabulary, preprocess: Mapping | None = None, decoding: DecodingConfig | None = None
) -> dict:
    """The plain-data part of a bundle: format version, model config, vocabulary, its fingerprint,
    ``preprocess`` and ``decoding``.

    ``preprocess`` is ``{"image_size": N}``, the square input size the model was trained with (left
    out when None). ``decoding``: how the run decoded its final scores (``DecodingConfig.for_captioning`` of
    its ``model.decoding``), where captioning with the model starts (left out when None: captioning's
    defaults). Training checkpoints store this dict under ``checkpoint["captioner"]``.
    Raises ConfigError for an invalid preprocess.
    """
    metadata = {
        "version": BUNDLE_VERSION,
        "config": to_dict(net),
        "vocab": vocab.to_dict(),
        "vocab_fingerprint": vocab.fingerprint(),
    }
    if preprocess is not None:
        metadata["preprocess"] = _check_preprocess(preprocess)
    if decoding is not None:
        metadata["decoding"] = to_dict(decoding)
    return metadata


def _plain_names(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Parameter names without the ``_orig_mod.`` that torch.compile inserts for a wrapped module."""
    return {key.replace("_orig_mod.", ""): value for key, value in state_dict.items()}


def _embedding_mismatch(model: nn.Module, state_dict: Mapping, vocab_size: int) -> str | None:
    """Describe an embedding in ``state_dict`` whose rows differ from ``vocab_size``, if any."""
    for name, module in model.named_modules():
        weight = state_dict.get(f"{name}.weight")
        if isinstance(module, nn.Embedding) and isinstance(weight, Tensor) and weight.size(0) != vocab_size:
            return f"the vocabulary has {vocab_size} words but the {name} weights have {weight.size(0)} rows"
    return None


def save_bundle(
    path: str | os.PathLike,
    model: Captioner,
    vocab: Vocabulary,
    net: NetConfig,
    preprocess: Mapping | None = None,
    decoding: DecodingConfig | None = None,
) -> None:
    """Write an inference bundle (the network's settings ``net``, vocabulary, preprocessing, decoding, weights)
    atomically; plain data only.

    ``preprocess`` is ``{"image_size": N}``; ``load_trained`` (the ``captioner`` command) needs it,
    ``load_bundle`` does not. ``decoding``: where captioning starts (``bundle_metadata``).
    """
    metadata = bundle_metadata(net, vocab, preprocess, decoding)
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings != len(vocab):
            raise BundleError(
                f"cannot save bundle {path}: the vocabulary has {len(vocab)} words but the "
                f"{name} weights have {module.num_embeddings} rows"
            )
    state_dict = {key: value.detach().cpu() for key, value in _plain_names(model.state_dict()).items()}
    save_torch({"format": BUNDLE_FORMAT, **metadata, "state_dict": state_dict}, path)


def _state_dict_problem(model: nn.Module, state_dict: Mapping) -> str | None:
    """Describe the missing, unexpected and reshaped keys of ``state_dict`` for ``model``, if any."""
    expected = model.state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    reshaped = [
        f"{key} {tuple(state_dict[key].shape)} vs {tuple(value.shape)}"
        for key, value in expected.items()
        if key in state_dict and state_dict[key].shape != value.shape
    ]
    problems = []
    labelled = (("missing", missing), ("unexpected", unexpected), ("shape mismatch (saved vs model)", reshaped))
    for label, keys in labelled:
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            problems.append(f"{label}: {', '.join(keys[:3])}{more}")
    return "; ".join(problems) or None


def _check_version(version: object, where: str) -> None:
    """BundleError unless ``version`` is a format version this module reads."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise BundleError(f"{where}: invalid bundle version {version!r}")
    if version > BUNDLE_VERSION:
        raise BundleError(
            f"{where}: bundle version {version} is newer than this captioner reads ({BUNDLE_VERSION}); upgrade it"
        )


def _bundle_parts(raw: object, where: str) -> tuple[dict, object]:
    """Check a loaded bundle's format, version and keys; return its metadata and state dict."""
    if not is_bundle(raw):
        raise BundleError(f'{where}: not a captioner bundle (expected "format": "{BUNDLE_FORMAT}")')
    _check_version(raw.get("version"), where)
    missing = [key for key in _BUNDLE_KEYS if key not in raw]
    if missing:
        raise BundleError(f"{where}: not a complete bundle (missing {', '.join(missing)})")
    return raw, raw["state_dict"]


def _checkpoint_parts(raw: dict, where: str) -> tuple[dict, dict]:
    """The bundle metadata of a Lightning checkpoint and its Captioner weights (``model.`` prefix removed)."""
    metadata = raw.get(CHECKPOINT_KEY)
    if not isinstance(metadata, dict):
        raise BundleError(
            f'{where}: has no "{CHECKPOINT_KEY}" entry (model config, vocabulary, image size); '
            f"only checkpoints written by this version of train.py can be loaded, or use its {BUNDLE_NAME}"
        )
    missing = [key for key in _METADATA_KEYS if key not in metadata]
    if missing:
        raise BundleError(f'{where}: its "{CHECKPOINT_KEY}" entry is incomplete (missing {", ".join(missing)})')
    _check_version(metadata.get("version", 1), where)  # checkpoints of version 1 did not write it
    state_dict = raw["state_dict"]
    if not isinstance(state_dict, dict):
        raise BundleError(f"{where}: state_dict is not a mapping of names to tensors")
    prefix = "model."
    return metadata, _plain_names(
        {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
    )


def _assemble(
    metadata: dict, state_dict: object, where: str, map_location: str | torch.device
) -> tuple[Captioner, Vocabulary, NetConfig]:
    """Build the model of ``metadata`` and load ``state_dict`` into it, once the stored tensors' shapes are
    known to be those of the config's model (built on the meta device: no memory), so that an untrusted file
    never makes this allocate more than its own weights."""
    try:
        vocab = Vocabulary.from_dict(metadata["vocab"])
    except DataError as exc:
        raise BundleError(f"{where}: malformed vocabulary ({exc})") from None
    if vocab.fingerprint() != metadata["vocab_fingerprint"]:
        raise BundleError(
            f"{where}: vocabulary fingerprint {metadata['vocab_fingerprint']!r} does not match "
            f"its words ({vocab.fingerprint()!r}): the vocabulary was altered"
        )
    if not isinstance(state_dict, dict) or not all(isinstance(v, Tensor) for v in state_dict.values()):
        raise BundleError(f"{where}: state_dict is not a mapping of names to tensors")
    try:
        net = read_net(metadata["config"], metadata.get("version", 1))  # every size in range
        without_weights = net.without_pretrained()  # the bundle holds them
        with torch.device("meta"):  # the shapes only: nothing is allocated before the weights are known to fit
            shapes = build_captioner(without_weights, len(vocab))
    except (ConfigError, TypeError, ValueError) as exc:
        raise BundleError(f"{where}: its config does not build a model ({exc})") from None
    held = sum(tensor.numel() * tensor.element_size() for tensor in shapes.state_dict().values())
    if held > MAX_MODEL_BYTES:
        raise BundleError(
            f"{where}: its model would hold {held / 2**30:.1f} GiB of weights, more than any model may "
            f"({MAX_MODEL_BYTES / 2**30:.0f} GiB)"
        )
    problem = _embedding_mismatch(shapes, state_dict, len(vocab)) or _state_dict_problem(shapes, state_dict)
    if problem:
        raise BundleError(f"{where}: weights do not fit the model: {problem}")
    model = build_captioner(without_weights, len(vocab))
    if isinstance(map_location, (str, torch.device)):
        model.to(map_location)
    model.load_state_dict(state_dict)
    return model.eval(), vocab, net


def load_bundle(
    path: str | os.PathLike, map_location: str | torch.device = "cpu"
) -> tuple[Captioner, Vocabulary, NetConfig]:
    """Load a bundle written by ``save_bundle``: the model (in eval mode), its vocabulary and network settings.

    Raises BundleError naming the file when it is not a bundle, is from a newer version, or its
    vocabulary, config or weights do not fit together. The encoder is built without pretrained
    weights (the bundle carries them), so no weight file is needed. ``load_trained`` also reads
    training checkpoints and returns the image size.
    """
    raw = load_torch(path, what="bundle", map_location=map_location, max_bytes=_max_file_bytes())
    where = f"bundle {path}"
    metadata, state_dict = _bundle_parts(raw, where)
    return _assemble(metadata, state_dict, where, map_location)


@dataclass(frozen=True)
class TrainedModel:
    """A trained captioner as a bundle or a training checkpoint holds it, with what is needed to feed it."""

    model: Captioner  # in eval mode
    vocab: Vocabulary
    config: NetConfig  # the network's settings
    image_size: int  # images are resized to image_size x image_size, as in training
    # how captioning decodes unless told otherwise: as the run decoded its final scores (a file written before
    # bundles kept it: captioning's defaults)
    decoding: DecodingConfig = field(default_factory=DecodingConfig.captioning)


def _no_bundle(folder: str | os.PathLike) -> str:
    """Why the run folder ``folder`` has no bundle: a run that failed (its ``FAILED`` line), one that was stopped
    (its ``STOPPED`` line: how to resume it) or one that has not finished; the checkpoints it has, to load
    instead."""
    checkpoints = sorted(glob.glob(os.path.join(folder, CHECKPOINT_DIR, "*.ckpt")))
    instead = f", or one of its checkpoints ({', '.join(checkpoints)})" if checkpoints else ""
    for marker, how in ((FAILED_FILE, "failed"), (STOPPED_FILE, "was stopped")):
        path = os.path.join(folder, marker)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as handle:
                reason = handle.readline().strip() or "no reason written"
            return f"{folder}: this run {how} ({reason}), so it has no {BUNDLE_NAME}; give a run that finished{instead}"
    return (
        f"{folder} is a folder without {BUNDLE_NAME} (a run writes it when training ends); give a run folder "
        f"that finished{instead}"
    )


def _model_parts(raw: object, path: str | os.PathLike) -> tuple[str, dict, object]:
    """What the loaded model file ``raw`` (read from ``path``) is, as messages name it (``bundle <path>``,
    ``checkpoint <path>``), its metadata and its weights; BundleError for a file of neither kind, or without the
    metadata of its kind."""
    if is_bundle(raw):
        where = f"bundle {path}"
        return (where, *_bundle_parts(raw, where))
    if is_lightning_checkpoint(raw):
        where = f"checkpoint {path}"
        return (where, *_checkpoint_parts(raw, where))
    raise BundleError(
        f"{path}: neither a captioner bundle nor a training checkpoint "
        f"(give the {BUNDLE_NAME} or a .ckpt file that train.py wrote)"
    )


def peek_model_file(path: str | os.PathLike, what: str = "model file") -> dict:
    """The top level of the bundle or training checkpoint at ``path`` (a file ``load_trained`` reads), its tensors
    mapped from the file, never read: which kind of file it is and its metadata, at the cost of its zip directory
    and pickled structure whatever its size. BundleError as ``load_trained`` raises it for a file that cannot be
    read (named ``what``), is of neither kind or lacks its kind's metadata."""
    raw = load_torch(path, what=what, max_bytes=_max_file_bytes(), mmap=True)
    _model_parts(raw, path)
    return raw


def load_trained(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> TrainedModel:
    """Load an inference bundle (``save_bundle``), a Lightning checkpoint written by training, or the
    bundle of a training run's folder (``<run>/bundle.pt``); ``captioner.inference.load_model`` captions with it.

    Both are read with ``weights_only=True``. Raises BundleError (one line naming the file) for a
    missing, truncated or foreign file, one carrying pickled code, a vocabulary, config or weights
    that do not fit together, a file without the image size the model was trained with, or a run
    folder without a bundle.
    """
    if os.path.isdir(path):
        folder, path = path, os.path.join(path, BUNDLE_NAME)
        if not os.path.isfile(path):
            raise BundleError(_no_bundle(folder))
    raw = load_torch(path, what="model file", map_location=map_location, max_bytes=_max_file_bytes())
    where, metadata, state_dict = _model_parts(raw, path)
    if "preprocess" not in metadata:
        raise BundleError(
            f"{where}: has no preprocessing settings (the image size the model was trained "
            "with), so it cannot caption correctly; it was written by an older captioner: "
            "export it again with save_bundle(..., preprocess={'image_size': N})"
        )
    try:
        image_size = _check_preprocess(metadata["preprocess"])["image_size"]
    except ConfigError as exc:
        raise BundleError(f"{where}: malformed preprocessing settings ({exc})") from None
    decoding = DecodingConfig.captioning()  # a file of a version that did not keep how its run decoded
    if "decoding" in metadata:
        try:
            decoding = from_dict(DecodingConfig, metadata["decoding"], "decoding")
        except ConfigError as exc:
            raise BundleError(f"{where}: malformed decoding settings ({exc})") from None
    model, vocab, config = _assemble(metadata, state_dict, where, map_location)
    return TrainedModel(model, vocab, config, image_size, decoding)
