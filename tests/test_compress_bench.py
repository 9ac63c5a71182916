"""bench/compress_latency.py: every variant is measured side by side, fused QKV computes what the teacher does,
variant names parse and bad ones exit 2 naming them."""

from __future__ import annotations

import json

import pytest
import torch

from bench import compress_latency

TEACHER_PARAMS = 1_489_028  # the digits teacher's UNet


def test_variant_names_parse_into_a_base_and_fusions():
    spec = compress_latency.parse_variant("pruned50+compile+qkv", {})
    assert (spec.base, spec.fusions, spec.tolerance) == ("pruned50", ("qkv", "compile"), 1e-4)
    spec = compress_latency.parse_variant("channels_last", {})
    assert (spec.base, spec.fusions, spec.tolerance) == ("teacher", ("channels_last",), 1e-5)
    assert compress_latency.parse_variant("kd+qkv", {"kd": "x"}).base == "kd"
    assert compress_latency.parse_variant("lowrank25", {}).tolerance is None


@pytest.mark.parametrize("name, message", [("pruned150", "base 'pruned150' is none of"),
                                           ("qkv+fast", r"\['fast'\] are not fusions"),
                                           ("qkv+qkv", "names a fusion twice")])
def test_bad_variant_names_exit_2_naming_them(name, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        compress_latency.main(["--variants", name])
    assert exit_.value.code == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_tiny_run_measures_every_variant_and_fusions_match_their_base(tmp_path, capsys):
    from distill.compress.lowrank import lowrank_unet
    from distill.inference.loading import load_pipeline
    from distill.worlds.digits import asset_path

    export = load_pipeline(str(asset_path("teacher")))  # a stand-in for a trained low-rank student's export
    export.unet, _ = lowrank_unet(export.unet, budget=0.5)
    export.save_pretrained(tmp_path / "export")
    path = tmp_path / "out.json"
    returned = compress_latency.main(["--variants", "teacher", "lowrank50", "qkv", "kd+qkv", "--export",
                                      f"kd={tmp_path / 'export'}", "--steps", "1", "--rounds", "1", "--repeats", "1",
                                      "--unet-repeats", "1", "--batch-sizes", "1", "2",
                                      "--threads", str(torch.get_num_threads()), "--out", str(path)])
    out = json.loads(path.read_text())
    assert out == json.loads(json.dumps(returned))
    v = out["variants"]
    assert list(v) == ["teacher", "lowrank50", "qkv", "kd+qkv", "kd"]
    assert out["evals_per_step"] == 2 and {r["nfe_per_image"] for r in v.values()} == {2}  # 1 step, CFG: 2
    assert v["teacher"]["params"] == TEACHER_PARAMS and v["teacher"]["max_output_diff"] == 0
    assert v["qkv"]["max_output_diff"] < 1e-5 and v["qkv"]["within_tolerance"] is True
    assert v["qkv"]["applied"] == ["qkv: to_qkv in 7 self-attention, to_kv in 7 cross-attention layers"]
    assert v["qkv"]["unet_gflops"] == v["teacher"]["unet_gflops"]
    # budget 0.5 keeps half the factorisable weights; conv_in, conv_out, the time MLP and the norms stay
    assert 0.5 < v["lowrank50"]["params"] / TEACHER_PARAMS < 0.52
    assert v["lowrank50"]["unet_gflops"] < 0.7 * v["teacher"]["unet_gflops"]
    assert v["lowrank50"]["within_tolerance"] is None and v["lowrank50"]["max_output_diff"] > 1e-2
    # the export: its own weights (here the same SVD), fused and checked against itself unfused
    assert v["kd"]["weights"] == f"trained: {tmp_path / 'export'}" and v["kd"]["params"] == v["lowrank50"]["params"]
    assert v["kd"]["max_output_diff"] == pytest.approx(v["lowrank50"]["max_output_diff"], rel=1e-4)
    assert v["kd+qkv"]["fusion_diff"] < 1e-5 and v["kd+qkv"]["within_tolerance"] is True
    for r in v.values():
        assert set(r["ms"]) == {"unet_b1", "unet_b2", "sample_b1", "sample_b2"} and min(r["ms"].values()) > 0
        assert r["peak_memory_mb"] > r["weights_mb"] > 0
    assert v["teacher"]["speedup"] == {key: 1.0 for key in v["teacher"]["ms"]}
    assert out["out_of_tolerance"] == [] and out["threads"] == torch.get_num_threads()
    table = capsys.readouterr().out
    assert "| qkv | teacher | 1.592M |" in table and "| kd+qkv | trained: " in table


def test_speed_ups_are_reported_as_median_of_ratios_and_ratio_of_medians():
    teacher, variant = [4.0, 5.0, 9.0], [2.0, 4.0, 3.0]  # per-round seconds; per-round ratios 2, 1.25, 3
    assert compress_latency.median_of_ratios(teacher, variant) == 2.0
    assert compress_latency.ratio_of_medians(teacher, variant) == pytest.approx(5.0 / 3.0)


def test_pruned_variant_is_the_network_the_compress_experiment_trains():
    """prunedNN counts FLOPs at the tokenizer's text length as student=pruned does: at 77 tokens (torch's
    SD default) the stop point moved and pruned50 was another network (0.801M parameters against 0.822M)."""
    from distill.inference.loading import load_pipeline
    from distill.students.compressed import pruned_student
    from distill.worlds.digits import asset_path

    pipe = load_pipeline(str(asset_path("teacher")))
    trained = pruned_student(pipe.unet, 0.5, teacher=pipe)  # conf/student/pruned.yaml's defaults
    unet, _, report = compress_latency._base_unet("pruned50", pipe.unet, {}, pipe.tokenizer.model_max_length)
    shapes = {k: t.shape for k, t in unet.state_dict().items()}
    assert shapes == {k: t.shape for k, t in trained.state_dict().items()}
    assert report["params_after"] == sum(p.numel() for p in trained.parameters())
