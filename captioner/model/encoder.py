"""CNN encoder: any torchvision classification model cut before its global pooling, as a (B, L, C) grid.

The annotation vectors a_1..a_L of the paper are the columns of the last spatial feature map of a CNN
(VGG conv5_4 there: 14 x 14 x 512). Here the CNN is any torchvision classifier with a convolutional
trunk (ResNet, VGG, MobileNet, EfficientNet, ConvNeXt, RegNet, DenseNet, Inception, Swin, ...).
An optional adaptive average pooling shrinks the map to ``grid x grid`` locations; it never upsamples,
because a larger grid from a smaller map adds attention slots but no information.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torchvision.models import get_model, list_models

from captioner.config import EncoderConfig
from captioner.data.dataset import IMAGENET_MEAN, IMAGENET_STD
from captioner.errors import ConfigError, first_line
from captioner.model.pretrained import not_on_disk, resolve_weights, weight_file

# Top-level children at which the trunk ends: global pooling, flattening, or the classifier head.
_HEAD_TYPES = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Linear)
_HEAD_NAMES = ("avgpool", "flatten", "fc", "classifier", "head", "heads")
# Torchvision's canonical input size: every classification model accepts it.
_PROBE_SIZE = 224


def _build_classifier(name: str, weights: str | None) -> nn.Module:
    if name not in list_models(module=torchvision.models):
        raise ConfigError(
            f"encoder.name={name!r} is not a torchvision classification model; "
            "see torchvision.models.list_models(module=torchvision.models) for valid names (e.g. resnet101)"
        )
    resolved = resolve_weights(name, weights)
    if resolved is None:
        return get_model(name, weights=None)
    path = weight_file(resolved)
    if not os.path.isfile(path):  # torchvision would download it: that is pretrained.download's
        raise ConfigError("; ".join(not_on_disk(name, weights, resolved)))
    try:
        return get_model(name, weights=resolved)
    except Exception as exc:  # a corrupt, truncated or wrong file fails in many ways
        raise ConfigError(
            f"weight file {path} could not be loaded ({first_line(exc)}); delete it and download {resolved.url} again"
        ) from None


def _trunk(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level children in order up to the first pooling/flatten/classifier, without auxiliary heads."""
    kept: list[tuple[str, nn.Module]] = []
    for child_name, child in model.named_children():
        if child_name.lower().startswith("aux"):  # Inception AuxLogits, GoogLeNet aux1/aux2
            continue
        if child_name in _HEAD_NAMES or isinstance(child, _HEAD_TYPES):
            break
        kept.append((child_name, nn.Sequential(*child) if isinstance(child, nn.ModuleList) else child))
    if len(kept) == 1 and isinstance(kept[0][1], nn.Sequential):  # `features` / `layers`: its blocks are the stages
        kept = list(kept[0][1].named_children())
    return kept


def _cut(stages: list[tuple[str, nn.Module]], name: str, stage: str | None) -> list[tuple[str, nn.Module]]:
    """The stages up to and including ``stage`` (all of them for None); ConfigError naming the valid ones."""
    if stage is None:
        return stages
    names = [stage_name for stage_name, _ in stages]
    if stage not in names:
        raise ConfigError(f"encoder.stage={stage!r} is not a stage of {name}; choose one of: {', '.join(names)}")
    return stages[: names.index(stage) + 1]


class Encoder(nn.Module):
    """A torchvision CNN cut before its global pooling; returns the grid of annotation vectors.

    Inputs are float images (B, 3, H, W) normalised with the ImageNet statistics (``IMAGENET_MEAN``,
    ``IMAGENET_STD``), as the torchvision weights expect.

    ``config`` holds the settings (their defaults and ranges are ``EncoderConfig``'s):
        name: a torchvision classification model (``torchvision.models.list_models``).
        weights: a torchvision weights name ("DEFAULT", "IMAGENET1K_V2", "ResNet101_Weights.IMAGENET1K_V2")
            or None for random initialisation. Its file must be in ``$TORCH_HOME/hub/checkpoints``, where
            torchvision caches it: building an encoder never downloads (``pretrained.download`` does; training
            calls it where ``model.encoder.download`` is on); a missing file is a ConfigError saying where it goes.
        stage: the trunk stage whose output is the grid (a top-level child such as ResNet's "layer3":
            14 x 14 at 224 px instead of layer4's 7 x 7, with smaller receptive fields); None: the last.
        grid: adaptive-average-pool the map to ``grid x grid`` locations (shrinking only); None keeps it.
        trainable_stages: 0 freezes the whole CNN, k > 0 trains its last k stages (top-level children of
            the trunk, or the blocks of its single ``features`` container, counting those with parameters),
            -1 trains all of it. Frozen stages run without autograd and their BatchNorm statistics never
            change, whatever ``train()`` is called with.
        channels_last: run the CNN in channels-last memory format (faster convolutions on recent GPUs).
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        name, stage, trainable_stages = config.name, config.stage, config.trainable_stages
        model = _build_classifier(name, config.weights)
        self.name = name
        self.grid = config.grid
        self.channels_last = config.channels_last
        if hasattr(model, "transform_input"):
            # Inception/GoogLeNet ports re-normalise ImageNet inputs to (x - 0.5) / 0.5 when transform_input
            # is set (pretrained weights). Kept as buffers so a bundle loaded without weights behaves the same.
            mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
            std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
            on = bool(model.transform_input)
            self.register_buffer("input_scale", std / 0.5 if on else torch.ones(1, 3, 1, 1))
            self.register_buffer("input_shift", (mean - 0.5) / 0.5 if on else torch.zeros(1, 3, 1, 1))
        else:
            self.register_buffer("input_scale", None)
            self.register_buffer("input_shift", None)
        self.stages = nn.Sequential(OrderedDict(_cut(_trunk(model), name, stage)))
        self.stage = stage
        del model

        probe = self._probe_shape(_PROBE_SIZE)
        if probe is None or len(probe) != 4:
            raise ConfigError(
                f"encoder.name={name!r} has no spatial convolutional feature grid (its trunk does not map "
                "images to (B, C, H, W), e.g. a vision transformer); choose a CNN such as resnet101"
            )
        self.out_channels: int = probe[1]

        with_params = [i for i, stage in enumerate(self.stages) if next(stage.parameters(), None) is not None]
        if trainable_stages > len(with_params):
            raise ConfigError(
                f"encoder.trainable_stages={trainable_stages} but {name} has only {len(with_params)} stages "
                "with parameters; use -1 to train all of them"
            )
        if trainable_stages == -1:
            self._first_trainable = 0
        elif trainable_stages == 0:
            self._first_trainable = len(self.stages)
        else:
            self._first_trainable = with_params[-trainable_stages]
        self.trainable_stages = trainable_stages
        for stage in self.stages[: self._first_trainable]:
            stage.requires_grad_(False)
        if self.channels_last:
            self.stages.to(memory_format=torch.channels_last)
        self.train(self.training)

    @property
    def frozen_stages(self) -> int:
        """How many leading stages are frozen (``frozen_map`` runs them; all of them when ``frozen``)."""
        return self._first_trainable

    @property
    def frozen(self) -> bool:
        """True when no part of the CNN is trained (it then always runs under ``torch.no_grad``)."""
        return self._first_trainable == len(self.stages)

    def frozen_fingerprint(self) -> str:
        """A short hash of the frozen stages' weights and statistics: two encoders with the same fingerprint
        (and config) give ``frozen_map`` the same output, whatever seed or checkpoint the weights came from."""
        digest = hashlib.sha256()
        for stage in self.stages[: self._first_trainable]:
            for name, tensor in itertools.chain(stage.named_parameters(), stage.named_buffers()):
                digest.update(name.encode())
                digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def train(self, mode: bool = True) -> Encoder:
        """Set train/eval mode; frozen stages always stay in eval mode (BatchNorm statistics never update)."""
        super().train(mode)
        for stage in self.stages[: self._first_trainable]:
            stage.train(False)
        return self

    def _probe_shape(self, image_size: int) -> tuple[int, ...] | None:
        """Output shape of the trunk for one ``image_size`` image, on the meta device (no compute)."""
        tensors = itertools.chain(self.stages.named_parameters(), self.stages.named_buffers())
        meta = {key: torch.empty_like(value, device="meta") for key, value in tensors}
        dtype = next(self.stages.parameters()).dtype
        image = torch.empty(1, 3, image_size, image_size, device="meta", dtype=dtype)
        modes = {module: module.training for module in self.stages.modules()}
        self.stages.eval()  # same shapes, and the meta kernels of eval-mode BatchNorm are cheaper
        try:
            return tuple(torch.func.functional_call(self.stages, meta, (image,)).shape)
        except Exception:  # shape errors surface as RuntimeError, ValueError, AssertionError, ...
            return None
        finally:
            for module, mode in modes.items():
                module.training = mode

    def _pooled_grid(self, height: int, width: int) -> tuple[int, int]:
        if self.grid is None:
            return height, width
        if height < self.grid or width < self.grid:
            raise ConfigError(
                f"encoder.grid={self.grid} is larger than the {height}x{width} feature map of {self.name}; "
                "the grid only shrinks (upsampling adds no information): use a smaller grid or larger images"
            )
        return self.grid, self.grid

    def grid_size(self, image_size: int) -> tuple[int, int]:
        """The (H, W) attention grid for square ``image_size`` inputs; ConfigError when it cannot be made."""
        shape = self._probe_shape(image_size)
        if shape is None:
            raise ConfigError(f"image_size={image_size} is too small for encoder {self.name}")
        return self._pooled_grid(shape[2], shape[3])

    def frozen_map(self, images: Tensor) -> Tensor:
        """(B, 3, H_img, W_img) ImageNet-normalised images -> the frozen stages' output (B, C', H', W'),
        without autograd; pooled to the grid when every stage is frozen. What a feature cache holds."""
        x = images
        if self.input_scale is not None:
            x = x * self.input_scale + self.input_shift
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            for stage in self.stages[: self._first_trainable]:
                x = stage(x)
        return self._pool(x) if self.frozen else x

    def trained_map(self, frozen: Tensor) -> Tensor:
        """The trained stages and the pooling on :meth:`frozen_map`'s output: (B, C', H', W') -> (B, C, H, W).
        The identity for a frozen encoder."""
        if self.frozen:
            return frozen
        x = frozen
        for stage in self.stages[self._first_trainable :]:
            x = stage(x)
        return self._pool(x)

    def feature_map(self, images: Tensor) -> Tensor:
        """(B, 3, H_img, W_img) ImageNet-normalised images -> (B, C, H, W) feature map."""
        return self.trained_map(self.frozen_map(images))

    def _pool(self, x: Tensor) -> Tensor:
        height, width = self._pooled_grid(x.shape[2], x.shape[3])
        if (height, width) != tuple(x.shape[2:]):
            x = F.adaptive_avg_pool2d(x, (height, width))  # (B, C, grid, grid)
        return x

    def forward(self, images: Tensor) -> Tensor:
        """(B, 3, H_img, W_img) images -> (B, L = H * W, C) annotation vectors, row-major over the grid."""
        return self.feature_map(images).flatten(2).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, stage={self.stage!r}, grid={self.grid}, trainable_stages={self.trainable_stages}"
