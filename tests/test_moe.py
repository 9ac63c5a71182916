"""Mixture-of-experts students: routing, auxiliary losses, equivalence with the dense student, save/load."""

import math

import pytest
import torch
from diffusers import DDPMScheduler
from torch.utils.checkpoint import checkpoint

from distill.families import load_teacher
from distill.models.moe import (
    MoEFeedForward,
    TimestepMoEUNet,
    TokenMoEUNet,
    expert_boundaries,
    no_routing_record,
)
from distill.students.copies import copy_student
from distill.students.moe import timestep_moe_student, token_moe_student
from tests.sd_tiny import write_tiny_sd


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return load_teacher(str(write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")))


def _inputs(n=4, seed=0, w_dim=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, 8, 8, generator=g)
    t = torch.tensor([10, 600, 999, 250][:n])
    cond = torch.randn(n, 7, 32, generator=g)
    extra = {} if w_dim is None else {"timestep_cond": torch.randn(n, w_dim, generator=g)}
    return x, t, cond, extra


# ---------------------------------------------------------------- timestep routing


def test_boundaries_split_steps_or_log_snr_equally():
    assert expert_boundaries(4, "equal_step") == [250, 500, 750]
    abar = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).alphas_cumprod
    b = expert_boundaries(3, "equal_snr", abar)
    logsnr = torch.log(abar / (1 - abar))
    span = float(logsnr[0] - logsnr[-1])
    # each hand-over is the first timestep past 1/3 and 2/3 of the log-SNR span
    for k, t in enumerate(b, start=1):
        assert float(logsnr[0] - logsnr[t]) >= k * span / 3 > float(logsnr[0] - logsnr[t - 1])
    with pytest.raises(ValueError, match="split"):
        expert_boundaries(2, "equal_flops")


def test_routing_is_deterministic_per_timestep(teacher):
    moe = timestep_moe_student(teacher.denoiser, num_experts=3, boundaries=[300, 700]).eval()
    t = torch.tensor([0, 299, 300, 699, 700, 999])
    assert moe.expert_of(t).tolist() == [0, 0, 1, 1, 2, 2]
    with torch.no_grad():  # make the experts differ so that routing is visible in the output
        for k, expert in enumerate(moe.experts):
            expert.conv_out.bias.fill_(float(k))
        x, tt, cond, _ = _inputs()
        mixed = moe(x, tt, cond).sample
        for i in range(len(tt)):  # a mixed batch equals each sample run alone by its own expert
            k = int(moe.expert_of(tt[i:i + 1]))
            alone = moe.experts[k](x[i:i + 1], tt[i:i + 1], cond[i:i + 1]).sample
            torch.testing.assert_close(mixed[i:i + 1], alone, rtol=1e-5, atol=1e-5)
    assert moe.router_stats()["router/load/e2"] == pytest.approx(0.25)  # t=999 is one of four samples


def test_one_expert_per_call_at_sampling_time(teacher):
    moe = timestep_moe_student(teacher.denoiser, num_experts=2, boundaries=[500]).eval()
    calls = []
    for k, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, a, o, k=k: calls.append(k))
    x, _, cond, _ = _inputs()
    with torch.no_grad():
        moe(x, torch.tensor(800), cond)
        moe(x, torch.tensor(100), cond)
    assert calls == [1, 0]
    assert moe.active_parameters() == sum(p.numel() for p in teacher.denoiser.parameters())


def test_shared_layers_are_one_set_of_weights_and_round_trip(teacher, tmp_path):
    moe = timestep_moe_student(teacher.denoiser, num_experts=2, boundaries=[500], time_cond_proj_dim=8,
                               shared_layers=["conv_in", "time_embedding", "down_blocks.0"])
    assert moe.experts[1].conv_in is moe.experts[0].conv_in
    assert not any(k.startswith("experts.1.conv_in") for k in moe.state_dict())  # stored once
    with torch.no_grad():
        moe.experts[1].conv_out.weight.mul_(0.5)
    moe.save_pretrained(tmp_path / "moe")
    back = TimestepMoEUNet.from_pretrained(tmp_path / "moe").eval()
    assert back.experts[1].down_blocks[0] is back.experts[0].down_blocks[0]
    x, t, cond, extra = _inputs(w_dim=8)
    with torch.no_grad():
        torch.testing.assert_close(back(x, t, cond, **extra).sample, moe.eval()(x, t, cond, **extra).sample)
    fresh = timestep_moe_student(teacher.denoiser, num_experts=2, boundaries=[500], time_cond_proj_dim=8,
                                 shared_layers=["conv_in", "time_embedding", "down_blocks.0"])
    fresh.load_state_dict(moe.state_dict())  # strict: the aliases are filled from the stored copy
    assert torch.equal(fresh.experts[1].conv_out.weight, moe.experts[1].conv_out.weight)


# ---------------------------------------------------------------- token routing


def test_top_k_sends_each_token_to_exactly_k_experts():
    torch.manual_seed(0)
    layer = MoEFeedForward(torch.nn.Linear(16, 16), 16, num_experts=5, top_k=2, capacity_factor=None)
    x = torch.randn(300, 16)
    _, probs, chosen, gates, kept = layer.route(x)
    assert chosen.shape == (300, 2) and kept.all()
    assert all(len(set(row)) == 2 for row in chosen.tolist())  # two distinct experts per token
    torch.testing.assert_close(gates.sum(-1), torch.ones(300))
    assert torch.equal(chosen, probs.topk(2, dim=-1).indices)  # the k most probable


def test_capacity_caps_every_expert_and_keeps_first_choices_first():
    layer = MoEFeedForward(torch.nn.Linear(8, 8), 8, num_experts=4, top_k=2, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 5.0  # every token prefers expert 0
    x = torch.randn(40, 8).abs()
    _, _, chosen, _, kept = layer.route(x)
    capacity = math.ceil(1.0 * 40 * 2 / 4)
    for e in range(4):
        assert int(((chosen == e) & kept).sum()) <= capacity
    assert int(((chosen[:, 0] == 0) & kept[:, 0]).sum()) == capacity  # the first 20 first choices fit
    assert kept[:capacity, 0].all() and not kept[capacity:, 0].any()


def test_load_balancing_loss_equals_its_formula():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(50, 4, generator=g).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    f = [sum(int(e in row) for row in chosen.tolist()) / (50 * 2) for e in range(4)]
    P = probs.mean(0).tolist()
    expected = 4 * sum(fi * pi for fi, pi in zip(f, P))
    assert MoEFeedForward.load_balancing_loss(probs, chosen, 4).item() == pytest.approx(expected, rel=1e-6)
    uniform = torch.full((8, 4), 0.25)  # perfectly balanced routing gives exactly 1
    assert MoEFeedForward.load_balancing_loss(uniform, torch.arange(8).remainder(4)[:, None], 4).item() == pytest.approx(1.0)
    logits = torch.randn(6, 4, generator=g)
    assert MoEFeedForward.z_loss(logits).item() == pytest.approx(
        sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 6, rel=1e-5)


def _router_task_loss(layer: MoEFeedForward, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (layer(x) - target).square().sum()


@pytest.mark.parametrize("top_k", [1, 2])
def test_task_loss_alone_trains_the_router_and_matches_finite_differences(top_k):
    torch.manual_seed(0)
    layer = MoEFeedForward(torch.nn.Linear(6, 6), 6, num_experts=4, top_k=top_k, capacity_factor=None,
                           load_balance_weight=0.0, z_loss_weight=0.0).double()
    with torch.no_grad():
        layer.router.weight.normal_()  # a spread of router probabilities
        for expert in layer.experts:  # experts that differ, so that the gates matter
            expert.weight.normal_()
    x, target = torch.randn(24, 6, dtype=torch.float64), torch.randn(24, 6, dtype=torch.float64)
    weight = layer.router.weight
    (grad,) = torch.autograd.grad(_router_task_loss(layer, x, target), weight)
    assert grad.norm() > 1e-2  # the task loss reaches the router with k = 1 as with k = 2
    chosen = layer.route(x)[2]
    eps, numeric = 1e-6, torch.zeros_like(weight)
    with torch.no_grad():
        for idx in [(i, j) for i in range(weight.shape[0]) for j in range(weight.shape[1])]:
            losses = []
            for step in (eps, -2 * eps):
                weight[idx] += step
                assert torch.equal(layer.route(x)[2], chosen)  # no routing flips within +-eps
                losses.append(_router_task_loss(layer, x, target))
            weight[idx] += eps
            numeric[idx] = (losses[0] - losses[1]) / (2 * eps)
    torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-8)


def test_top_1_gate_is_the_router_probability_of_the_chosen_expert():
    torch.manual_seed(0)
    layer = MoEFeedForward(torch.nn.Linear(8, 8), 8, num_experts=4, top_k=1, capacity_factor=None)
    with torch.no_grad():
        layer.router.weight.normal_()
    x = torch.randn(50, 8)
    _, _, chosen, gates, _ = layer.route(x)
    logits = x @ layer.router.weight.T
    p = logits.exp() / logits.exp().sum(-1, keepdim=True)  # Switch eq. 1
    assert torch.equal(chosen[:, 0], p.argmax(-1))
    torch.testing.assert_close(gates[:, 0], p.max(-1).values)  # eq. 2: y = p_i(x) E_i(x)
    assert gates.max() < 1.0 and gates.min() > 0.25  # a real probability, at least 1/E for the arg-max
    with torch.no_grad():  # y = p_i(x) E_i(x) token by token
        out = layer(x)
        for n in range(0, 50, 7):
            e = int(chosen[n, 0])
            torch.testing.assert_close(out[n], p[n, e] * layer.experts[e](x[n]))


def _formula_aux(logits: list[torch.Tensor], num_experts: int, top_k: int, lb_weight: float, z_weight: float):
    """sum over layers of lb_weight * E sum_i f_i P_i + z_weight * mean(logsumexp^2), from each layer's logits."""
    total = 0.0
    for layer_logits in logits:
        p = layer_logits.double().softmax(-1)
        chosen = p.topk(top_k, dim=-1).indices
        f = torch.stack([(chosen == i).any(-1).double().mean() / top_k for i in range(num_experts)])
        lb = num_experts * float((f * p.mean(0)).sum())
        z = float(torch.logsumexp(layer_logits.double(), -1).pow(2).mean())
        total += lb_weight * lb + z_weight * z
    return total


def test_aux_loss_is_the_weighted_sum_over_layers(teacher):
    moe = token_moe_student(teacher.denoiser, num_experts=3, top_k=2, load_balance_weight=0.01, z_loss_weight=0.001,
                            time_cond_proj_dim=None)
    with torch.no_grad():
        for layer in moe.moe_layers():
            layer.router.weight.normal_()
    logits = []
    for layer in moe.moe_layers():
        def recording(x, route=layer.route):  # each layer's router logits, as its forward computes them
            out = route(x)
            logits.append(out[0].detach())
            return out
        layer.route = recording
    x, t, cond, _ = _inputs()
    moe(x, t, cond)
    assert len(logits) == len(moe.moe_layers()) > 1
    expected = _formula_aux(logits, 3, 2, 0.01, 0.001)  # Switch sec. 2.2: every layer's loss joins the total
    assert moe.aux_loss().item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("build", [token_moe_student, timestep_moe_student])
def test_marked_target_pass_keeps_the_students_routing_record(teacher, build):
    moe = build(teacher.denoiser, num_experts=2, time_cond_proj_dim=None).train()
    x, t, cond, _ = _inputs()
    moe(x, t, cond)
    aux, stats = moe.aux_loss(), moe.router_stats()
    x_prev, t_prev = x.flip(0) * 2, torch.tensor([700, 800, 900, 990])  # all on the high-noise expert
    with torch.no_grad(), no_routing_record(moe):  # the LCM target pass through the student itself: other x, t
        moe(x_prev, t_prev, cond)
    assert all(getattr(m, "records_routing", True) for m in moe.modules())  # the mark ends with the block
    assert moe.router_stats() == stats
    if aux is not None:
        assert moe.aux_loss().grad_fn is not None and moe.aux_loss().item() == aux.item()
    with torch.no_grad():  # sampling (eval mode) records its own routing
        moe.eval()(x_prev, t_prev, cond)
    assert moe.router_stats() != stats


def test_reentrant_checkpoint_forward_records_the_students_routing(teacher):
    moe = token_moe_student(teacher.denoiser, num_experts=3, top_k=2, z_loss_weight=0.001, time_cond_proj_dim=None)
    x, t, cond, _ = _inputs()
    moe(x, t, cond)
    plain_aux, plain_stats = moe.aux_loss().item(), moe.router_stats()
    moe(x.flip(0) * 2, t.flip(0), cond)  # an earlier forward's record, which the checkpointed one must replace
    assert moe.router_stats() != plain_stats
    x = x.clone().requires_grad_(True)
    out = checkpoint(lambda s: moe(s, t, cond).sample, x, use_reentrant=True)  # runs the forward under no_grad
    aux = moe.aux_loss()
    assert moe.router_stats() == plain_stats and aux.item() == pytest.approx(plain_aux, rel=1e-6)
    assert aux.grad_fn is None  # a reentrant checkpoint keeps no graph of side outputs: the router gets no aux gradient
    (out.square().mean() + aux).backward()  # no stale graph of an earlier forward is reused
    assert x.grad.abs().sum() > 0


def test_consistency_with_ema_decay_0_adds_the_students_aux_loss(teacher):
    import functools

    from distill.methods.consistency import LatentConsistencyDistillation

    torch.manual_seed(0)
    method = LatentConsistencyDistillation(
        teacher, functools.partial(token_moe_student, num_experts=2, top_k=1, time_cond_proj_dim=8),
        optimizer=torch.optim.AdamW, ema_decay=0.0, cache_prompts=False)
    student, passes, task = method.student, [], []
    student.register_forward_hook(lambda m, a, o: passes.append((torch.is_grad_enabled(), m.aux_loss())))
    loss_fn = method.loss
    method.loss = lambda batch, generator=None: task.append(loss_fn(batch, generator)) or task[-1]
    batch = {"pixel_values": torch.rand(4, 1, 32, 32) * 2 - 1, "caption": ["a handwritten digit one"] * 4}
    total = method.training_step(batch, 0)
    assert [grad for grad, _ in passes] == [True, False]  # the student's pass, then the stop-gradient target
    own_aux = passes[0][1]
    assert total.item() == pytest.approx((task[0] + own_aux).item(), rel=1e-6)
    routers = [layer.router.weight for layer in student.moe_layers()]
    grads = torch.autograd.grad(total - task[0], routers, allow_unused=True)  # the aux term's router gradient
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("kind", ["token", "timestep"])
def test_one_expert_computes_the_dense_function(teacher, kind):
    dense = copy_student(teacher.denoiser, time_cond_proj_dim=8).eval()
    with torch.no_grad():
        dense.time_embedding.cond_proj.weight.normal_()
    if kind == "token":
        moe = token_moe_student(dense, num_experts=1, top_k=1, time_cond_proj_dim=None).train()  # capacity on
    else:
        moe = timestep_moe_student(dense, num_experts=1, time_cond_proj_dim=None).train()
    x, t, cond, extra = _inputs(w_dim=8)
    torch.testing.assert_close(moe(x, t, cond, **extra).sample, dense(x, t, cond, **extra).sample,
                               rtol=1e-6, atol=1e-6)


def test_token_moe_counts_active_parameters_and_round_trips(teacher, tmp_path):
    moe = token_moe_student(teacher.denoiser, num_experts=4, top_k=1, time_cond_proj_dim=8).eval()
    dense = sum(p.numel() for p in copy_student(teacher.denoiser, time_cond_proj_dim=8).parameters())
    routers = sum(layer.router.weight.numel() for layer in moe.moe_layers())
    assert moe.active_parameters() == dense + routers
    assert sum(p.numel() for p in moe.parameters()) > dense
    x, t, cond, extra = _inputs(w_dim=8)
    with torch.no_grad():
        out = moe(x, t, cond, **extra).sample
    stats = moe.router_stats()
    assert sum(stats[f"router/load/e{e}"] for e in range(4)) == pytest.approx(1.0)
    moe.save_pretrained(tmp_path / "moe")
    back = TokenMoEUNet.from_pretrained(tmp_path / "moe").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x, t, cond, **extra).sample, out)


def test_pipeline_with_a_moe_unet_loads_with_diffusers(teacher, tmp_path):
    from diffusers import StableDiffusionPipeline

    moe = token_moe_student(teacher.denoiser, num_experts=2, top_k=1, time_cond_proj_dim=None).eval()
    pipe = StableDiffusionPipeline(vae=teacher.vae, text_encoder=teacher.text_encoder, tokenizer=teacher.tokenizer,
                                   unet=moe, scheduler=teacher.scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(tmp_path / "pipe")
    back = StableDiffusionPipeline.from_pretrained(tmp_path / "pipe")
    back.set_progress_bar_config(disable=True)
    assert isinstance(back.unet, TokenMoEUNet)
    kwargs = {"num_inference_steps": 2, "height": 16, "width": 16, "output_type": "pt"}
    a = pipe(["a"], generator=torch.Generator().manual_seed(0), **kwargs).images
    b = back(["a"], generator=torch.Generator().manual_seed(0), **kwargs).images
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- training with the distillation methods


@pytest.fixture(scope="module")
def tiny_sd_path(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd_cli") / "pipe")


@pytest.mark.parametrize("student, cls", [pytest.param("moe_token", TokenMoEUNet, marks=pytest.mark.slow),
                                          ("moe_timestep", TimestepMoEUNet)])  # token MoE: ~30 s, slow
def test_moe_trains_with_consistency_logs_router_stats_and_exports(tiny_sd_path, tmp_path, student, cls):
    import csv

    from diffusers import StableDiffusionPipeline

    from tests.conftest import run_train

    run_dir = tmp_path / "run"
    common = ["+exp=consistency", f"student={student}", f"teacher.pretrained_model_name_or_path={tiny_sd_path}",
              "student.time_cond_proj_dim=8", "data.batch_size=8", "callbacks.quality_cost=null", "logger=csv",
              "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", f"hydra.run.dir={run_dir}"]
    proc = run_train(*common, "trainer.max_steps=2", "export=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = run_train(*common, "trainer.max_steps=3", "ckpt_path=last")  # loads the MoE checkpoint
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    loads = [float(r["router/load/e0"]) for r in rows if r.get("router/load/e0")]
    assert loads and all(0.0 <= v <= 1.0 for v in loads)
    assert any(r.get("train/aux_loss") for r in rows) == (cls is TokenMoEUNet)  # routing by t needs no balancing
    pipe = StableDiffusionPipeline.from_pretrained(run_dir / "export")
    assert isinstance(pipe.unet, cls)


@pytest.mark.parametrize("student, cls", [("moe_timestep", TimestepMoEUNet), ("moe_token", TokenMoEUNet)])
def test_moe_students_train_with_progressive(tiny_sd_path, tmp_path, student, cls):
    from tests.conftest import run_train

    run_dir = tmp_path / "run"
    proc = run_train("+exp=progressive", f"student={student}", "student.time_cond_proj_dim=null",
                     f"teacher.pretrained_model_name_or_path={tiny_sd_path}", "data.batch_size=8",
                     "method.start_steps=4", "method.final_steps=1", "method.steps_per_round=1",
                     "trainer.max_steps=2", "trainer.limit_val_batches=1", "callbacks.quality_cost=null",
                     "logger=csv", "export=false", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    round_one = cls.from_pretrained(run_dir / "rounds" / "002-steps" / "unet")  # the round-1 student, a teacher in round 2
    assert isinstance(round_one, cls)
    if cls is TimestepMoEUNet:
        assert round_one.num_experts == 2 and round_one.handover_timesteps.numel() == 1


@pytest.mark.parametrize("build", [token_moe_student, timestep_moe_student])
def test_gradient_checkpointing_changes_no_gradient(teacher, build):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        moe = build(teacher.denoiser, time_cond_proj_dim=None, gradient_checkpointing=checkpointing)
        assert any(getattr(m, "gradient_checkpointing", False) for m in moe.modules()) == checkpointing
        x, t, cond, _ = _inputs()
        moe(x, t, cond).sample.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6)


def test_router_runs_in_float32_under_bfloat16_autocast():
    """Switch Transformer's selective precision (sec. 2.4): the router's input and matmul are float32."""
    layer = MoEFeedForward(torch.nn.Linear(8, 8), dim=8, num_experts=4, top_k=1)
    x = torch.randn(16, 8)
    expected = (x.double() @ layer.router.weight.double().T).softmax(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, probs, *_ = layer.route(x.bfloat16())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(probs.double(), expected, atol=1e-2, rtol=0)  # bf16 input rounding only
    exact = torch.nn.functional.linear(x.bfloat16().float(), layer.router.weight)
    torch.testing.assert_close(logits, exact, atol=1e-6, rtol=1e-6)


def test_router_statistics_are_read_only_on_logging_steps(teacher):
    """Reading router statistics is a host sync: off logging steps the aux loss still trains, no stats are read."""
    import functools
    import types

    from distill.methods.consistency import LatentConsistencyDistillation

    torch.manual_seed(0)
    method = LatentConsistencyDistillation(
        teacher, functools.partial(token_moe_student, num_experts=2, top_k=1, time_cond_proj_dim=8),
        optimizer=torch.optim.AdamW, cache_prompts=False)
    reads = []
    stats_fn = method.student.router_stats
    method.student.router_stats = lambda prefix="router/": reads.append(1) or stats_fn(prefix)
    method.log, method.log_dict = (lambda *a, **k: None), (lambda *a, **k: None)
    batch = {"pixel_values": torch.rand(4, 1, 32, 32) * 2 - 1, "caption": ["a handwritten digit one"] * 4}
    for logging in (False, True):
        connector = types.SimpleNamespace(should_update_logs=logging)
        method._trainer = types.SimpleNamespace(_logger_connector=connector)
        task = method.loss(batch, torch.Generator().manual_seed(0))
        total = method.add_student_aux_loss(task, 4)
        assert total.item() > task.item()  # the aux loss is added either way
    assert reads == [1]  # read on the logging step only
