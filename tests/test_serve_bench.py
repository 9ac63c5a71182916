"""bench/serve_load.py: a tiny load test (the shipped teacher, 2 steps, modes sequential and stream, concurrency
1 and 2, one round) starts and stops its servers, and every request gets an image."""

from __future__ import annotations

import json

import pytest

from bench import serve_load


@pytest.mark.slow  # 25-35 s: in `make test-all`, out of the 15-minute default suite
def test_quick_load_test_answers_every_request(tmp_path):
    out = tmp_path / "load.json"
    result = serve_load.main(["--quick", "--pipelines", "teacher", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == json.loads(json.dumps(result["rows"]))
    cells = {(r["mode"], r["concurrency"]): r for r in data["rows"]}
    assert set(cells) == {(m, c) for m in ("sequential", "stream") for c in (1, 2)}
    for row in cells.values():
        assert row["images_per_s"] > 0 and row["statuses"] == {"200": 4}
        assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"] and row["peak_rss_mb"] > 0
    assert cells[("sequential", 2)]["mean_denoise_batch"] == 1  # one request at a time
    assert cells[("stream", 2)]["speedup"] > 0 and cells[("sequential", 1)]["speedup"] == 1
    assert [s["exit_code"] for s in data["servers"]] == [0, 0]  # SIGTERM drains, then exits 0
    assert "| teacher | stream | 2 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow  # about 20 s
def test_quick_mixed_traffic_run_reports_every_class(tmp_path):
    from bench import serve_mixed

    out = tmp_path / "mixed.json"
    serve_mixed.main(["--pipeline", "teacher", "--quick", "--classes", "short=1", "long=4:ddim", "--out", str(out)])
    data = json.loads(out.read_text())
    assert {r["mode"] for r in data["rows"]} == {"batch", "stream"}
    for row in data["rows"]:
        assert row["errors"] == 0 and row["images_per_s"] > 0
        for name in ("short", "long"):
            assert 0 < row["classes"][name]["p50_ms"] <= row["classes"][name]["p95_ms"]
    assert "stream" in data["verdict"] and "| 4 | stream |" in out.with_suffix(".md").read_text()
