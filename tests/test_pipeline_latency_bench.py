"""bench/pipeline_latency.py: whole pipelines timed side by side, their NFE counted per image, bad variants exit 2
naming what is wrong."""

from __future__ import annotations

import json

import pytest

from bench import pipeline_latency
from distill.worlds.digits import asset_path


def test_variants_parse_with_their_call_arguments(tmp_path):
    folder = asset_path("flow_teacher")
    name, path, call = pipeline_latency.parse_variant(f"t@4={folder}:steps=4,guidance_scale=3.0,output_type=pt")
    assert (name, path, call) == ("t@4", folder, {"num_inference_steps": 4, "guidance_scale": 3.0,
                                                  "output_type": "pt"})
    with pytest.raises(ValueError, match="has no model_index.json"):
        pipeline_latency.parse_variant(f"x={tmp_path}")


@pytest.mark.parametrize("argv, message", [(["nofolder"], "give NAME=FOLDER"),
                                           (["a={f}", "a={f}"], "variant names must differ"),
                                           (["a={f}", "--reference", "b"], "--reference b is not a variant"),
                                           (["a={f}:steps"], "is not key=value"),
                                           (["a={f}:accelerate.threshold=0"], "without accelerate=PRESET")])
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    argv = [a.format(f=asset_path("flow_teacher")) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        pipeline_latency.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_tiny_run_times_every_variant_and_counts_its_evaluations(tmp_path):
    folder = asset_path("flow_teacher")
    path = tmp_path / "out.json"
    returned = pipeline_latency.main([f"cfg@2={folder}:steps=2,guidance_scale=3.0", f"plain@1={folder}:steps=1,"
                                      "guidance_scale=1.0", "--batch-sizes", "1", "2", "--rounds", "2",
                                      "--threads", "1", "--out", str(path)])
    out = json.loads(path.read_text())
    assert out["rows"] == json.loads(json.dumps(returned["rows"])) and out["reference"] == "cfg@2"
    cfg, plain = out["rows"]
    assert cfg["nfe_per_image"] == 4 and plain["nfe_per_image"] == 1  # 2 steps x (cond + uncond); 1 step, no CFG
    for row in out["rows"]:
        assert [len(row["rounds_s_per_image"][b]) for b in ("1", "2")] == [2, 2]
        assert all(s > 0 for b in ("1", "2") for s in row["rounds_s_per_image"][b])
        assert row["peak_memory_mb"] > 5  # the flow teacher's weights alone are ~5 MB in float32
    assert cfg["speedup_b1_median_of_ratios"] == 1.0 and cfg["speedup_b2_ratio_of_medians"] == 1.0
    assert "| plain@1 | num_inference_steps=1, guidance_scale=1.0 | 1 |" in out["table"]


def test_an_accelerated_variant_samples_with_its_preset_and_options(tmp_path):
    folder = asset_path("flow_teacher")
    out = pipeline_latency.main([f"plain={folder}:steps=4,guidance_scale=3.0",
                                 f"fb0={folder}:steps=4,guidance_scale=3.0,accelerate=fbcache,accelerate.threshold=0",
                                 f"fb={folder}:steps=4,guidance_scale=3.0,accelerate=fbcache,accelerate.threshold=100",
                                 "--batch-sizes", "1", "--rounds", "1", "--threads", "1"])
    plain, fb0, fb = out["rows"]
    assert plain["accelerator"] is None and fb0["accelerator"] == "fbcache(threshold=0)"
    assert plain["nfe_per_image"] == fb0["nfe_per_image"] == fb["nfe_per_image"] == 8  # cached calls still count
    assert plain["cached_share"] == fb0["cached_share"] == 0
    assert fb["cached_share"] == 3 / 4  # every call after the first skips the blocks after the first
    assert "| fb | num_inference_steps=4, guidance_scale=3.0, fbcache(threshold=100) | 8 |" in out["table"]
