"""bench/accelerate_latency.py: variants parse into scheduler, steps, guidance and accelerator; bad ones exit 2
naming them; a tiny run times every variant and reports NFE and speed-ups against its plain baseline."""

from __future__ import annotations

import json

import pytest

from bench import accelerate_latency


def test_variants_parse():
    v = accelerate_latency.parse_variant("dpmsolver20@cfg1.5 deepcache:interval=3,schedule=nonuniform")
    assert (v["pipeline"], v["scheduler"], v["steps"], v["guidance_scale"]) == ("teacher", "dpmsolver", 20, 1.5)
    assert (v["kind"], v["options"]) == ("deepcache", {"interval": 3, "schedule": "nonuniform"})
    v = accelerate_latency.parse_variant("lcm:lcm4")
    assert (v["pipeline"], v["scheduler"], v["steps"], v["kind"]) == ("lcm", "lcm", 4, "none")


@pytest.mark.parametrize("variant, message", [("ddim", "is not <scheduler><steps>"),
                                              ("ddim8 warp", "accelerator 'warp'"),
                                              ("ddim8 deepcache:interval=0", "interval=0"),
                                              ("lcm:lcm4", "need --lcm")])
def test_bad_variants_exit_2_naming_them(variant, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        accelerate_latency.main(["--variants", variant])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_tiny_run_times_every_variant(tmp_path, capsys):
    out = tmp_path / "lat.json"
    accelerate_latency.main(["--variants", "ddim6", "ddim6 deepcache:interval=2", "ddim6 forecast:interval=2",
                             "--rounds", "1", "--batch-sizes", "1", "--out", str(out)])
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ddim6"]["nfe"] == 12 and rows["ddim6 deepcache:interval=2"]["nfe"] == 12  # CFG 3: two a step
    assert rows["ddim6 forecast:interval=2"]["nfe"] == 8  # real steps 0, 1, 3, 5
    assert rows["ddim6"]["speedup_b1"] == 1.0
    assert rows["ddim6 deepcache:interval=2"]["gflops_per_image"] < rows["ddim6"]["gflops_per_image"]
    assert "| ddim6 forecast:interval=2 | 8 |" in capsys.readouterr().out
