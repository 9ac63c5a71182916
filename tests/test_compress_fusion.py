"""Kernel fusion: folded Conv+BN(+ReLU) and fused QKV / channels-last UNets compute what the originals do."""

import pytest
import torch
from diffusers import UNet2DConditionModel
from torch import nn

from distill.compress.fusion import find_conv_bn_relu_chains, fuse_conv_bn, fuse_unet
from distill.compress.lowrank import lowrank_unet
from distill.models.classifier import ImageClassifier
from distill.worlds.digits import asset_path
from tests import test_compress_lowrank

teacher_unet, unet_inputs = test_compress_lowrank.teacher_unet, test_compress_lowrank.unet_inputs  # fixtures


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _randomise_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Running statistics and affine parameters far from the identity, so that folding them matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 3 + 0.1)
                m.weight.copy_(torch.randn(m.num_features, generator=g))
                m.bias.copy_(torch.randn(m.num_features, generator=g))
    return model


def test_fused_classifier_equals_the_unfused_one():
    torch.manual_seed(0)
    model = _randomise_batchnorm(ImageClassifier()).eval()
    fused, applied = fuse_conv_bn(model)
    # channels (32, 64, 64): one Conv-BN-ReLU block in the first stage, two in each later one
    assert len(applied) == 5 and all(line.endswith("-> ConvReLU2d") for line in applied)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 5  # the original is left as it was
    x = torch.rand(16, 1, 32, 32) * 2 - 1
    with torch.no_grad():
        assert _rel(fused.features(x), model.features(x)) < 1e-5
        assert _rel(fused(x), model(x)) < 1e-5


def test_fused_synthetic_sequential_equals_the_unfused_one():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),  # biased conv, BN, ReLU
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=4, bias=False), nn.BatchNorm2d(8),  # grouped, strided
        nn.Sequential(nn.Conv2d(8, 6, 1), nn.ReLU()),  # nested, no BN
        nn.Conv2d(6, 6, 3, padding=2, dilation=2),  # a lone conv: nothing to fuse
        nn.MaxPool2d(2), nn.BatchNorm2d(6),  # a BN after no conv stays
    )
    _randomise_batchnorm(model).eval()
    assert find_conv_bn_relu_chains(model) == [["0", "1", "2"], ["3", "4"], ["5.0", "5.1"]]
    fused, applied = fuse_conv_bn(model)
    assert applied == ["0 + 1 + 2 -> ConvReLU2d", "3 + 4 -> Conv2d", "5.0 + 5.1 -> ConvReLU2d"]
    assert isinstance(fused[8], nn.BatchNorm2d) and isinstance(fused[1], nn.Identity)
    x = torch.randn(4, 3, 17, 17)
    with torch.no_grad():
        assert _rel(fused(x), model(x)) < 1e-5


class _ConvBlock(nn.Module):
    """Conv and BN as attributes, outside any Sequential: found only by name."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_named_chains_outside_sequentials_are_fused():
    torch.manual_seed(0)
    model = _randomise_batchnorm(_ConvBlock()).eval()
    assert find_conv_bn_relu_chains(model) == []
    fused, applied = fuse_conv_bn(model, [["conv", "bn"]])
    assert applied == ["conv + bn -> Conv2d"] and isinstance(fused.bn, nn.Identity)
    x = torch.randn(2, 4, 9, 9)
    with torch.no_grad():
        assert _rel(fused(x), model(x)) < 1e-5
    with pytest.raises(ValueError, match=r"chain \['bn', 'conv'\] is \['BatchNorm2d', 'Conv2d'\]"):
        fuse_conv_bn(model, [["bn", "conv"]])


def test_fusing_in_training_mode_raises():
    model = ImageClassifier().train()
    with pytest.raises(RuntimeError, match=r"training mode.*call model\.eval\(\) first"):
        fuse_conv_bn(model)


def test_qkv_fused_teacher_unet_equals_the_unfused_one(teacher_unet, unet_inputs):
    fused = UNet2DConditionModel.from_pretrained(asset_path("teacher") / "unet").eval()
    fused, applied = fuse_unet(fused)
    # the teacher: 7 transformer blocks (1 in each of 2 down blocks, 1 mid, 2 in each of 2 up blocks), each with
    # one self- and one cross-attention
    assert applied == ["qkv: to_qkv in 7 self-attention, to_kv in 7 cross-attention layers"]
    assert sum(hasattr(m, "to_qkv") for m in fused.modules()) == 7
    assert {type(p).__name__ for p in fused.attn_processors.values()} == {"FusedAttnProcessor2_0"}
    with torch.no_grad():
        assert _rel(fused(*unet_inputs).sample, teacher_unet(*unet_inputs).sample) < 1e-5


def test_channels_last_teacher_unet_equals_the_contiguous_one(teacher_unet, unet_inputs):
    fused = UNet2DConditionModel.from_pretrained(asset_path("teacher") / "unet").eval()
    fused, applied = fuse_unet(fused, qkv=False, channels_last=True)
    assert applied == ["channels_last: 4-d weights"]
    assert fused.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not fused.conv_in.weight.is_contiguous()
    with torch.no_grad():
        assert _rel(fused(*unet_inputs).sample, teacher_unet(*unet_inputs).sample) < 1e-5


def test_qkv_fusion_is_skipped_for_factorised_projections(teacher_unet, unet_inputs):
    low, _ = lowrank_unet(teacher_unet, rank=8, keep_dense=("conv_in", "conv_out", "time_embedding.*", "*.to_out.*"))
    with torch.no_grad():
        before = low(*unet_inputs).sample
    _, applied = fuse_unet(low)
    assert applied == ["qkv: skipped, 14 attention layers have factorised (low-rank) projections that cannot "
                       "be concatenated"]
    with torch.no_grad():
        assert torch.equal(low(*unet_inputs).sample, before)


@pytest.mark.slow
def test_compiled_qkv_fused_unet_equals_the_unfused_one(teacher_unet, unet_inputs):
    fused = UNet2DConditionModel.from_pretrained(asset_path("teacher") / "unet").eval()
    fused, applied = fuse_unet(fused, channels_last=True, compile=True)
    assert applied[-1] == "torch.compile: inductor, on the first call"
    with torch.no_grad():
        assert _rel(fused(*unet_inputs).sample, teacher_unet(*unet_inputs).sample) < 1e-4
