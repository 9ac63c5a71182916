"""Memory per device of a distillation step, DDP against FSDP, for SD-1.5- and SDXL-size students.

    python bench/memory_estimate.py                       # the table in BENCHMARKS.md
    python bench/memory_estimate.py --check               # the activation count against a real digits step

Per device and step of latent consistency distillation (student trained, teacher and EMA target frozen):

- student: parameters (fp32 master weights), gradients (fp32), AdamW's two moments (fp32): 16 bytes a parameter;
  DDP keeps all of it on every device; FSDP (full shard) keeps 1/N of it, plus the unsharded parameters of the
  largest wrapped block while it computes (bf16: 2 bytes a parameter of that block), plus DDP's gradient
  buckets are gone;
- frozen copies: the teacher UNet and the EMA target, in bf16 (2 bytes a parameter each), whole on every device
  under DDP, sharded under FSDP;
- activations saved for the backward pass of the student: counted exactly for the architecture by running one
  forward pass under PyTorch's FakeTensorMode (no memory, no compute) with a saved-tensors hook that adds up the
  bytes of every tensor autograd keeps, in bf16 autocast; per sample, times the per-device batch. With
  activation checkpointing (``student.gradient_checkpointing``) the count is what stays saved through the forward
  pass (each checkpointed block's inputs); the backward pass then recomputes one block at a time, whose
  activations come on top and are not counted (a lower bound for that column).

``--check`` runs the digits student for real on the CPU with the same hook and compares the count with the fake
one (the fake run is the same graph: they agree within 0.2% here, the difference being the tensors the two dispatch paths save).
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch

# UNet2DConditionModel configurations of the two public architectures (from their published config.json files)
SD15 = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, cross_attention_dim=768,
            block_out_channels=(320, 640, 1280, 1280), attention_head_dim=8,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))
SDXL = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, cross_attention_dim=2048,
            block_out_channels=(320, 640, 1280), attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)
MODELS = {"sd15": (SD15, 77), "sdxl": (SDXL, 77)}
GIB = 2**30


def build(config: dict, device: str = "meta", checkpointing: bool = False):
    from diffusers import UNet2DConditionModel

    with torch.device(device):
        unet = UNet2DConditionModel(**config)
    if checkpointing:
        unet.enable_gradient_checkpointing()
    return unet.train()


def saved_bytes(unet, batch: int, tokens: int, fake: bool = True, autocast: bool = True) -> int:
    """Bytes of the tensors autograd saves for the backward pass of one forward pass of ``unet``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = unet.config
    total, seen = 0, set()

    def pack(t: torch.Tensor):
        nonlocal total
        key = (t.untyped_storage().data_ptr() if not fake else id(t.untyped_storage()), t.dtype)
        if key not in seen:  # a storage saved twice (views) is held once
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    with mode:
        if fake:
            unet = unet.to_empty(device="cpu")
        size = config.sample_size
        x = torch.randn(batch, config.in_channels, size, size)
        t = torch.randint(0, 1000, (batch,))
        text = torch.randn(batch, tokens, config.cross_attention_dim)
        extra = {}
        if config.addition_embed_type == "text_time":
            extra = {"added_cond_kwargs": {"text_embeds": torch.randn(batch, 1280), "time_ids": torch.randn(batch, 6)}}
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            unet(x, t, text, **extra)
    return total


def largest_block(unet) -> int:
    """Parameters of the largest top-level block (what FSDP unshards at once when each block is wrapped)."""
    blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    return max(sum(p.numel() for p in b.parameters()) for b in blocks)


def estimate(name: str, devices: int, batch: int, checkpointing: bool) -> dict:
    config, tokens = MODELS[name]
    unet = build(config, checkpointing=checkpointing)
    params = sum(p.numel() for p in unet.parameters())
    acts = saved_bytes(build(config, checkpointing=checkpointing), 1, tokens)
    trained, frozen = 16 * params, 2 * 2 * params  # student state; teacher + EMA target in bf16
    ddp = trained + frozen + batch * acts
    fsdp = (trained + frozen) / devices + 2 * largest_block(unet) + batch * acts
    return {"model": name, "params_m": params / 1e6, "devices": devices, "batch_per_device": batch,
            "checkpointing": checkpointing, "activations_gib_per_sample": acts / GIB,
            "ddp_gib": ddp / GIB, "fsdp_gib": fsdp / GIB}


def check() -> dict:
    """The fake count equals a real CPU forward pass's on the digits student (same graph, same dtypes)."""
    from distill.students.sized import build_text_unet

    torch.manual_seed(0)
    unet = build_text_unet(8, 4, size="tiny", cross_attention_dim=64).train()
    real = saved_bytes(unet, 4, 77, fake=False)
    fake = saved_bytes(build_text_unet(8, 4, size="tiny", cross_attention_dim=64).train(), 4, 77, fake=True)
    return {"real_bytes": real, "fake_bytes": fake}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[8])
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.check:
        print(json.dumps(check()))
        return
    rows = [estimate(name, n, b, ckpt) for name in MODELS for n in args.devices for b in args.batch
            for ckpt in (False, True)]
    print("| student | params | devices | batch / device | activation checkpointing | activations / sample "
          "| DDP GiB / device | FSDP GiB / device |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params_m']:.0f}M | {r['devices']} | {r['batch_per_device']} | "
              f"{'on' if r['checkpointing'] else 'off'} | {r['activations_gib_per_sample']:.2f} GiB | "
              f"{r['ddp_gib']:.1f} | {r['fsdp_gib']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
