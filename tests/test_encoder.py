"""Encoder: the cut of torchvision models, grid pooling, weight files offline, frozen stages."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import get_model

from captioner.errors import ConfigError
from captioner.model import encoder as encoder_module
from captioner.model.encoder import Encoder
from conftest import make_encoder, random_images


def _with_reference(name: str, monkeypatch: pytest.MonkeyPatch, **kwargs) -> tuple[Encoder, nn.Module]:
    """An Encoder and the torchvision model it was cut from (sharing the trunk modules), both in eval."""
    built = []

    def spy(*args, **kw) -> nn.Module:
        built.append(get_model(*args, **kw))
        return built[-1]

    monkeypatch.setattr(encoder_module, "get_model", spy)
    encoder = make_encoder(name, **kwargs).eval()
    return encoder, built[0].eval()


@pytest.mark.parametrize(
    "name, head, channels, size, grid",
    [
        ("resnet18", lambda m, x: m.fc(torch.flatten(m.avgpool(x), 1)), 512, 64, (2, 2)),
        ("mobilenet_v3_small", lambda m, x: m.classifier(torch.flatten(m.avgpool(x), 1)), 576, 64, (2, 2)),
        ("vgg11", lambda m, x: m.classifier(torch.flatten(m.avgpool(x), 1)), 512, 64, (2, 2)),
        ("squeezenet1_1", lambda m, x: torch.flatten(m.classifier(x), 1), 512, 64, (3, 3)),
    ],
)
def test_cut_is_the_trunk_before_global_pooling(monkeypatch, name, head, channels, size, grid):
    encoder, reference = _with_reference(name, monkeypatch)
    images = random_images(size=size)
    with torch.no_grad():
        feature_map = encoder.feature_map(images)  # (B, C, H, W)
        features = encoder(images)  # (B, L, C)
        # the classifier head applied to our map reproduces the full torchvision model
        torch.testing.assert_close(head(reference, feature_map), reference(images))
    assert encoder.out_channels == channels
    assert feature_map.shape == (2, channels, *grid)
    assert encoder.grid_size(size) == grid
    torch.testing.assert_close(features, feature_map.flatten(2).transpose(1, 2))
    torch.testing.assert_close(features[1, grid[1] + 1], feature_map[1, :, 1, 1])  # row-major locations


@pytest.fixture(scope="module")
def resnet18() -> Encoder:
    """A frozen resnet18 encoder without pooling, in eval mode (tests must not change it)."""
    return make_encoder("resnet18").eval()


def test_grid_pooling_equals_adaptive_avg_pool(resnet18):
    pooled = make_encoder("resnet18", grid=2).eval()
    pooled.load_state_dict(resnet18.state_dict())
    for size, map_size in ((128, 4), (96, 3), (64, 2)):  # 4 -> 2 in blocks, 3 -> 2 overlapping, 2 -> 2 as is
        images = random_images(size=size)
        with torch.no_grad():
            full = resnet18.feature_map(images)  # (B, C, map, map)
            expected = F.adaptive_avg_pool2d(full, 2)  # (B, C, 2, 2)
            torch.testing.assert_close(pooled.feature_map(images), expected)
            torch.testing.assert_close(pooled(images), expected.flatten(2).transpose(1, 2))
        assert full.shape[2:] == (map_size, map_size)
        assert pooled.grid_size(size) == (2, 2)
    assert resnet18.grid_size(96) == (3, 3)


def test_stage_reads_the_grid_from_an_earlier_stage(monkeypatch):
    encoder, reference = _with_reference("resnet18", monkeypatch, stage="layer3")
    images = random_images(size=96)
    with torch.no_grad():
        expected = reference.layer3(
            reference.layer2(
                reference.layer1(reference.maxpool(reference.relu(reference.bn1(reference.conv1(images)))))
            )
        )  # (B, 256, 6, 6)
        torch.testing.assert_close(encoder.feature_map(images), expected)
    assert list(encoder.stages._modules)[-1] == "layer3" and encoder.out_channels == 256
    assert encoder.grid_size(96) == (6, 6) and make_encoder("resnet18", stage="layer2", grid=6).grid_size(96) == (6, 6)
    with pytest.raises(
        ConfigError,
        match="encoder.stage='layer5' is not a stage of resnet18; choose one of: "
        "conv1, bn1, relu, maxpool, layer1, layer2, layer3, layer4",
    ):
        make_encoder("resnet18", stage="layer5")


def test_grid_never_upsamples():
    encoder = make_encoder("resnet18", grid=4)
    assert encoder.grid_size(160) == (4, 4)  # 5x5 map
    with pytest.raises(ConfigError, match=r"encoder.grid=4 is larger than the 2x2 feature map"):
        encoder.grid_size(64)
    with pytest.raises(ConfigError, match="only shrinks"):
        encoder(random_images(size=64))


def test_grid_size_of_too_small_image():
    encoder = make_encoder("squeezenet1_1")
    assert encoder.grid_size(24) == (1, 1)
    with pytest.raises(ConfigError, match="image_size=16 is too small for encoder squeezenet1_1"):
        encoder.grid_size(16)


def test_vision_transformer_refused():
    with pytest.raises(ConfigError, match="no spatial convolutional feature grid"):
        make_encoder("vit_b_32")


def test_unknown_model_refused():
    with pytest.raises(ConfigError, match=r"'resnet7'.*torchvision.models.list_models"):
        make_encoder("resnet7")


@pytest.mark.parametrize("weights", ["IMAGENET1K_V9", "ResNet50_Weights.IMAGENET1K_V1", "imagenet"])
def test_unknown_weights_refused(weights):
    with pytest.raises(ConfigError, match=r"choose one of: DEFAULT, IMAGENET1K_V1, ResNet18_Weights.IMAGENET1K_V1"):
        make_encoder("resnet18", weights=weights)


@pytest.mark.parametrize("weights", ["DEFAULT", "IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1"])
def test_missing_weight_file_names_url_and_path(tmp_path, monkeypatch, weights):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = os.path.join(tmp_path, "hub", "checkpoints", "resnet18-f37072fd.pth")
    with pytest.raises(ConfigError) as error:
        make_encoder("resnet18", weights=weights)
    message = str(error.value)
    assert "download https://download.pytorch.org/models/resnet18-f37072fd.pth" in message
    assert f"save it as {path}" in message and "TORCH_HOME" in message
    assert not os.path.exists(path)  # nothing was downloaded


def test_corrupt_weight_file_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=rf"weight file {path} could not be loaded.*download"):
        make_encoder("resnet18", weights="DEFAULT")


def _batchnorms(module: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]


def test_frozen_encoder_has_no_grad_and_fixed_batchnorm():
    encoder = make_encoder("resnet18")
    nn.ModuleDict({"encoder": encoder}).train()  # a training module around the encoder
    assert encoder.frozen and encoder.training
    assert not any(p.requires_grad for p in encoder.parameters())
    assert not any(bn.training for bn in _batchnorms(encoder))
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    features = encoder(random_images(size=64))
    assert not features.requires_grad
    for key, value in encoder.state_dict().items():  # running_mean/var, num_batches_tracked unchanged
        assert torch.equal(value, before[key]), key


def test_partially_trainable_trains_only_last_stages():
    encoder = make_encoder("resnet18", trainable_stages=2).train()
    assert not encoder.frozen
    trainable = {name.split(".")[1] for name, p in encoder.named_parameters() if p.requires_grad}
    assert trainable == {"layer3", "layer4"}
    assert {bn.training for bn in _batchnorms(encoder.stages.layer4)} == {True}
    assert {bn.training for bn in _batchnorms(encoder.stages[:6])} == {False}  # conv1 .. layer2
    frozen_stats = encoder.stages.layer2[0].bn1.running_mean.clone()
    trained_stats = encoder.stages.layer4[0].bn1.running_mean.clone()
    encoder(random_images(size=64)).sum().backward()
    assert torch.equal(encoder.stages.layer2[0].bn1.running_mean, frozen_stats)
    assert not torch.equal(encoder.stages.layer4[0].bn1.running_mean, trained_stats)
    assert encoder.stages.layer3[0].conv1.weight.grad.abs().sum() > 0
    assert encoder.stages.layer2[0].conv1.weight.grad is None


def test_trainable_stages_of_features_models_and_bounds():
    encoder = make_encoder("mobilenet_v3_small", trainable_stages=1)
    last = str(len(encoder.stages) - 1)
    assert {name.split(".")[1] for name, p in encoder.named_parameters() if p.requires_grad} == {last}
    assert all(p.requires_grad for p in make_encoder("mobilenet_v3_small", trainable_stages=-1).parameters())
    with pytest.raises(ConfigError, match="has only 13 stages with parameters"):
        make_encoder("mobilenet_v3_small", trainable_stages=14)
    with pytest.raises(ConfigError, match="trainable_stages"):
        make_encoder("mobilenet_v3_small", trainable_stages=-2)


def test_channels_last_gives_the_same_features(resnet18):
    fast = make_encoder("resnet18", channels_last=True).eval()
    fast.load_state_dict(resnet18.state_dict())
    images = random_images(size=64)
    with torch.no_grad():
        torch.testing.assert_close(fast(images), resnet18(images), rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_inception_style_input_transform_is_state():
    encoder = make_encoder("googlenet")  # random weights: torchvision's transform_input is off
    state = encoder.state_dict()
    assert torch.equal(state["input_scale"], torch.ones(1, 3, 1, 1))
    assert torch.equal(state["input_shift"], torch.zeros(1, 3, 1, 1))
    assert "input_scale" not in make_encoder("resnet18").state_dict()
