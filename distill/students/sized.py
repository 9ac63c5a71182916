"""Students trained from scratch: diffusers UNets by size name (a name -> config table, as DiT does), class-
conditional (``student=class_unet``) or text-conditional (``student=text_unet``), and SD3's MMDiT
(``student=sd3_transformer``, a flow-matching teacher in SD3's layout)."""

from __future__ import annotations

from diffusers import SD3Transformer2DModel, UNet2DConditionModel, UNet2DModel

from distill.students import STUDENTS

# Widths per resolution level; one attention level in the middle. "debug" is the CI model.
UNET_SIZES: dict[str, dict] = {
    "debug": {"block_out_channels": (16, 32), "layers_per_block": 1, "attention_head_dim": 8},
    "tiny": {"block_out_channels": (32, 64, 64), "layers_per_block": 1, "attention_head_dim": 16},
    "small": {"block_out_channels": (64, 128, 128), "layers_per_block": 2, "attention_head_dim": 32},
    "base": {"block_out_channels": (128, 256, 256), "layers_per_block": 2, "attention_head_dim": 64},
}


def _size(size: str) -> dict:
    if size not in UNET_SIZES:
        raise ValueError(f"student.size={size!r} is unknown; use one of {sorted(UNET_SIZES)}")
    return dict(UNET_SIZES[size])


def _levels(spec: dict, sample_size: int, size: str) -> int:
    """Resolution levels of the UNet; the sample size must halve cleanly at each."""
    levels = len(spec["block_out_channels"])
    if sample_size % 2 ** (levels - 1):
        raise ValueError(
            f"sample size {sample_size} is not divisible by 2**{levels - 1} (UNet size {size!r}); "
            f"pick a resolution that is a multiple of {2 ** (levels - 1)}"
        )
    return levels


def _unet(cls: type, spec: dict, sample_size: int, in_channels: int, out_channels: int | None, down: list[str],
          up: list[str], gradient_checkpointing: bool, **conditioning):
    """A ``cls`` UNet of the size ``spec`` with these blocks and ``conditioning`` (its class or text inputs)."""
    unet = cls(
        sample_size=sample_size,
        in_channels=in_channels,
        out_channels=out_channels or in_channels,
        block_out_channels=spec["block_out_channels"],
        layers_per_block=spec["layers_per_block"],
        attention_head_dim=spec["attention_head_dim"],
        down_block_types=tuple(down),
        up_block_types=tuple(up),
        norm_num_groups=8,
        **conditioning,
    )
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return unet


@STUDENTS.register("class_unet", choices={"size": UNET_SIZES})
def build_class_unet(
    sample_size: int, in_channels: int = 1, out_channels: int | None = None, size: str = "tiny", num_classes: int = 10,
    gradient_checkpointing: bool = False,
) -> UNet2DModel:
    """A class-conditional pixel/latent UNet; class index ``num_classes`` is the null (unconditional) class.

    ``gradient_checkpointing`` recomputes each block in the backward pass (diffusers' switch, non-reentrant);
    forwards without gradients (sampling) are unaffected."""
    spec = _size(size)
    levels = _levels(spec, sample_size, size)
    down = ["DownBlock2D"] * levels
    up = ["UpBlock2D"] * levels
    if levels > 1:
        down[1], up[-2] = "AttnDownBlock2D", "AttnUpBlock2D"
    return _unet(UNet2DModel, spec, sample_size, in_channels, out_channels, down, up, gradient_checkpointing,
                 num_class_embeds=num_classes + 1)


@STUDENTS.register("text_unet", choices={"size": UNET_SIZES})
def build_text_unet(
    sample_size: int, in_channels: int = 4, out_channels: int | None = None, size: str = "tiny", *,
    cross_attention_dim: int, gradient_checkpointing: bool = False,
) -> UNet2DConditionModel:
    """A Stable-Diffusion-style UNet conditioned by cross-attention on text-encoder hidden states
    (``gradient_checkpointing`` as in ``build_class_unet``): ``sample_size`` is the latent size (image size /
    VAE factor), ``cross_attention_dim`` the text encoder's hidden size."""
    spec = _size(size)
    levels = _levels(spec, sample_size, size)
    down = ["CrossAttnDownBlock2D"] * (levels - 1) + ["DownBlock2D"]
    up = ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * (levels - 1)
    return _unet(UNet2DConditionModel, spec, sample_size, in_channels, out_channels, down, up, gradient_checkpointing,
                 cross_attention_dim=cross_attention_dim)


# MMDiT depth and width (heads x head_dim), as DiT's size table; "debug" is the CI model.
SD3_SIZES: dict[str, dict] = {
    "debug": {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8},
    "tiny": {"num_layers": 4, "num_attention_heads": 3, "attention_head_dim": 32},
    "small": {"num_layers": 8, "num_attention_heads": 6, "attention_head_dim": 32},
}


@STUDENTS.register("sd3_transformer", choices={"size": SD3_SIZES})
def build_sd3_transformer(
    sample_size: int, in_channels: int = 4, out_channels: int | None = None, size: str = "tiny", patch_size: int = 1,
    *, joint_attention_dim: int, pooled_projection_dim: int, qk_norm: str | None = "rms_norm",
    gradient_checkpointing: bool = False,
) -> SD3Transformer2DModel:
    """An ``SD3Transformer2DModel`` (MMDiT, Esser et al. 2024) on ``sample_size``-square latents in patches of
    ``patch_size``; ``joint_attention_dim`` the text states' width (SD3: both CLIPs' widths, padded to T5's),
    ``pooled_projection_dim`` the pooled text vector's (both CLIPs' projections); ``qk_norm`` as SD3.5's."""
    if size not in SD3_SIZES:
        raise ValueError(f"student.size={size!r} is unknown; use one of {sorted(SD3_SIZES)}")
    if sample_size % patch_size:
        raise ValueError(f"student.sample_size={sample_size} is not divisible by student.patch_size={patch_size}")
    spec = SD3_SIZES[size]
    model = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=patch_size, in_channels=in_channels, out_channels=out_channels or in_channels,
        joint_attention_dim=joint_attention_dim, pooled_projection_dim=pooled_projection_dim,
        caption_projection_dim=spec["num_attention_heads"] * spec["attention_head_dim"],
        pos_embed_max_size=sample_size // patch_size, qk_norm=qk_norm, **spec)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model
