"""Memory per device of a distillation step, DDP against FSDP, for SD-1.5- and SDXL-size students.

    python bench/memory_estimate.py                       # the table in BENCHMARKS.md
    python bench/memory_estimate.py --check               # the activation count against a real digits step
    python bench/memory_estimate.py --dmd2                # DMD2 with a full and a LoRA fake score, SDXL and Flux

Per device and step of latent consistency distillation (student trained, teacher and EMA target frozen):

- student: parameters (fp32 master weights), gradients (fp32), AdamW's two moments (fp32): 16 bytes a parameter;
  DDP keeps all of it on every device plus its gradient buckets (``BUCKETS``, 4 bytes a trained parameter); FSDP
  (full shard) keeps 1/N of it, plus the unsharded parameters of the largest wrapped block while it computes (bf16:
  2 bytes a parameter of that block), and no buckets;
- frozen copies: the teacher UNet and the EMA target, in bf16 (2 bytes a parameter each: the teacher loaded with
  ``teacher.torch_dtype=bfloat16``; loaded in float32 add 2 bytes a parameter), whole on every device under DDP,
  sharded under FSDP;
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
from collections.abc import Callable
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
# FluxTransformer2DModel of FLUX.1-dev (its published transformer/config.json): 11.9B parameters; at 1024 px 4,096
# packed image tokens of 64 channels and 512 T5 tokens
FLUX = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
FLUX_TOKENS = (4096, 512)
GIB = 2**30
# DDP's gradient buckets: with gradient_as_bucket_view=False (torch's default, which distill keeps) they hold a second
# float32 copy of the trained gradients for the all-reduce, 4 bytes a trained parameter
BUCKETS = 4


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


def build_flux(device: str = "meta"):
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        return FluxTransformer2DModel(**FLUX).train()


def flux_inputs(batch: int) -> tuple[tuple, dict]:
    image, text = FLUX_TOKENS
    kwargs = dict(encoder_hidden_states=torch.randn(batch, text, FLUX["joint_attention_dim"]),
                  pooled_projections=torch.randn(batch, FLUX["pooled_projection_dim"]),
                  timestep=torch.rand(batch), img_ids=torch.zeros(image, 3), txt_ids=torch.zeros(text, 3),
                  guidance=torch.full((batch,), 3.5))
    return (torch.randn(batch, image, FLUX["in_channels"]),), kwargs


def sdxl_inputs(batch: int) -> tuple[tuple, dict]:
    size = SDXL["sample_size"]
    return (torch.randn(batch, 4, size, size), torch.randint(0, 1000, (batch,)),
            torch.randn(batch, 77, SDXL["cross_attention_dim"])), {
        "added_cond_kwargs": {"text_embeds": torch.randn(batch, 1280), "time_ids": torch.randn(batch, 6)}}


def saved_bytes_of(network, inputs: tuple[tuple, dict], input_grad: bool = False) -> int:
    """Bytes autograd saves for the backward pass of one forward of ``network`` (a meta-device model, run as fake
    tensors under bf16 autocast) on ``inputs`` (built inside the fake mode); with ``input_grad`` the first input
    requires a gradient (a loss back-propagated through a frozen network into its input: DMD2's GAN term)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    total, seen = 0, set()

    def pack(t: torch.Tensor):
        nonlocal total
        key = (id(t.untyped_storage()), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with FakeTensorMode(allow_non_fake_inputs=True):
        network = network.to_empty(device="cpu")
        args, kwargs = inputs()
        if input_grad:
            args = (args[0].requires_grad_(True), *args[1:])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            network(*args, **kwargs)
    return total


def lora_parameters(network, rank: int) -> int:
    """Parameters of distill's LoRA adapters of ``rank`` on ``network`` (the class's ``LORA_TARGET_MODULES``,
    ``add_lora_adapter``), counted on the meta device."""
    from distill.students.copies import add_lora_adapter

    with torch.device("meta"):
        add_lora_adapter(network, rank, adapter_name="count")
    return sum(p.numel() for n, p in network.named_parameters() if ".count." in n)


def head_parameters(name: str) -> int:
    """DMD2's discriminator head on the fake score's middle feature (``distill.methods.dmd2``): a convolutional head
    on SDXL's mid block (1280 channels), a token MLP on Flux's middle block (3072 wide)."""
    from distill.methods.dmd2 import DiscriminatorHead, TokenDiscriminatorHead

    with torch.device("meta"):
        head = DiscriminatorHead(1280) if name == "sdxl" else TokenDiscriminatorHead(3072)
    return sum(p.numel() for p in head.parameters())


DMD2_MODELS = {"sdxl": (lambda: build(SDXL), sdxl_inputs, "1024 px, 77 tokens"),
               "flux": (build_flux, flux_inputs, "1024 px: 4,096 image + 512 text tokens")}


def estimate_dmd2(name: str, fake: str, batch: int, rank: int = 64) -> dict:
    """Memory per device of one DMD2 step under DDP (a multi-role method is not sharded): the generator (a full
    copy, trained: 16 bytes a parameter), the frozen teacher (bf16, 2 bytes: ``teacher.torch_dtype=bfloat16``), the
    fake score (``copy``: a second trained full copy, 16 bytes a parameter; ``lora``: adapters of ``rank`` on the
    teacher's own network, 16 bytes an adapter parameter) and the discriminator head (trained; both in float32
    whatever the teacher's dtype), DDP's gradient buckets for every trained parameter, plus the activations of the larger of the two
    updates: the generator's (its own forward, and the fake score's forward that the GAN term back-propagates
    through into the sample) and the critic's (the fake score's one forward of 3 rows a sample: the denoising loss's
    and the GAN's real and fake rows). The real score runs without gradient (nothing saved)."""
    make, inputs, where = DMD2_MODELS[name]
    params = sum(p.numel() for p in make().parameters())
    head = head_parameters(name)
    if fake == "lora":
        def critic_net():
            net = make().requires_grad_(False)
            lora_parameters(net, rank)
            for n, p in net.named_parameters():
                p.requires_grad_(".count." in n)
            return net
        adapters = lora_parameters(make(), rank)
        fake_state = 16 * (adapters + head)
    else:
        critic_net, adapters = make, 0
        fake_state = 16 * (params + head)
    generator = per_sample_and_fixed(lambda n: saved_bytes_of(make(), lambda: inputs(n)))
    gan = per_sample_and_fixed(lambda n: saved_bytes_of(make().requires_grad_(False), lambda: inputs(n),
                                                        input_grad=True))
    critic = per_sample_and_fixed(lambda n: saved_bytes_of(critic_net(), lambda: inputs(3 * n)))
    trained_fake = fake_state // 16
    states = 16 * params + 2 * params + fake_state + BUCKETS * (params + trained_fake)
    generator_step = tuple(a + b for a, b in zip(generator, gan, strict=True))
    totals = {"generator": generator_step[1] + batch * generator_step[0], "critic": critic[1] + batch * critic[0]}
    larger = max(totals, key=totals.get)
    acts = generator_step if larger == "generator" else critic
    return {"model": name, "params_m": params / 1e6, "fake_score": fake if fake == "copy" else f"lora r{rank}",
            "adapter_params_m": adapters / 1e6, "head_params_m": head / 1e6, "batch_per_device": batch,
            "inputs": where, "states_gib": states / GIB, "larger_update": larger,
            "activations_gib_per_sample": acts[0] / GIB, "activations_gib_fixed": acts[1] / GIB,
            "ddp_gib": (states + totals[larger]) / GIB}


def largest_block(unet) -> int:
    """Parameters of the largest top-level block (what FSDP unshards at once when each block is wrapped)."""
    blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    return max(sum(p.numel() for p in b.parameters()) for b in blocks)


def per_sample_and_fixed(count: Callable[[int], int]) -> tuple[int, int]:
    """(bytes a sample, bytes independent of the batch) of a saved-tensor count ``count(batch)``, from batches 1
    and 2: what autograd saves grows linearly with the batch, on top of what it saves once (under autocast the
    bf16 copies of the weights, 2 bytes a parameter)."""
    one, two = count(1), count(2)
    return two - one, 2 * one - two


def estimate(name: str, devices: int, batch: int, checkpointing: bool) -> dict:
    config, tokens = MODELS[name]
    unet = build(config, checkpointing=checkpointing)
    params = sum(p.numel() for p in unet.parameters())
    acts, fixed = per_sample_and_fixed(lambda n: saved_bytes(build(config, checkpointing=checkpointing), n, tokens))
    trained, frozen = 16 * params, 2 * 2 * params  # student state; teacher + EMA target in bf16
    ddp = trained + BUCKETS * params + frozen + fixed + batch * acts
    fsdp = (trained + frozen) / devices + 2 * largest_block(unet) + fixed + batch * acts
    return {"model": name, "params_m": params / 1e6, "devices": devices, "batch_per_device": batch,
            "checkpointing": checkpointing, "activations_gib_per_sample": acts / GIB,
            "activations_gib_fixed": fixed / GIB, "ddp_gib": ddp / GIB, "fsdp_gib": fsdp / GIB}


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
    parser.add_argument("--dmd2", action="store_true", help="DMD2 with a full and a LoRA fake score (SDXL, Flux)")
    parser.add_argument("--rank", type=int, default=64, help="the LoRA fake score's rank (method.fake_score_rank)")
    args = parser.parse_args()
    if args.check:
        print(json.dumps(check()))
        return
    if args.dmd2:
        rows = [estimate_dmd2(name, fake, b, args.rank) for name in DMD2_MODELS for fake in ("copy", "lora")
                for b in args.batch]
        print("| teacher and generator | params | fake score | trained fake-score parameters | batch / device "
              "| states GiB | larger update | activations: fixed + per sample | GiB / device (DDP) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            trained = r["params_m"] + r["head_params_m"] if r["fake_score"] == "copy" else (
                r["adapter_params_m"] + r["head_params_m"])
            print(f"| {r['model']} ({r['inputs']}) | {r['params_m']:.0f}M | {r['fake_score']} | {trained:.0f}M | "
                  f"{r['batch_per_device']} | {r['states_gib']:.1f} | {r['larger_update']} | "
                  f"{r['activations_gib_fixed']:.2f} + {r['activations_gib_per_sample']:.2f} GiB | {r['ddp_gib']:.1f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return
    rows = [estimate(name, n, b, ckpt) for name in MODELS for n in args.devices for b in args.batch
            for ckpt in (False, True)]
    print("| student | params | devices | batch / device | activation checkpointing | activations: fixed + per sample "
          "| DDP GiB / device | FSDP GiB / device |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params_m']:.0f}M | {r['devices']} | {r['batch_per_device']} | "
              f"{'on' if r['checkpointing'] else 'off'} | {r['activations_gib_fixed']:.2f} + "
              f"{r['activations_gib_per_sample']:.2f} GiB | "
              f"{r['ddp_gib']:.1f} | {r['fsdp_gib']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
