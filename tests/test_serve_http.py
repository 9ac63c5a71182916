"""distill.serve's HTTP layer (issue 31): limits checked before any work (body size, prompts that are not text),
access control (bearer key, Host header, CORS), the drain's 503 answers and /health naming a stalled stage.

The real service runs in a subprocess (``python -m distill.serve port=0``, one for the module), as an operator
starts it; what needs a held-up engine runs the app in process on Starlette's test client.
"""

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from distill.serve.engine import DeadlineExceeded
from tests.conftest import ROOT

KEY = "test-key-31"
ORIGIN = "http://app.example"
PROMPT = "a handwritten digit seven"
TEN_MB = 10 * 2**20


def start(tmp_path, *overrides: str, key: str | None = None) -> tuple[subprocess.Popen, str]:
    """The service in a subprocess, its stdout and stderr in files under ``tmp_path``; (process, its URL)."""
    env = {k: v for k, v in os.environ.items() if k != "DISTILL_SERVE_API_KEY"}
    env["OMP_NUM_THREADS"] = "1"
    if key is not None:
        env["DISTILL_SERVE_API_KEY"] = key  # the documented way to keep the key off the command line
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    proc = subprocess.Popen([sys.executable, "-m", "distill.serve", "port=0", *overrides], cwd=ROOT, env=env,
                            stdout=out.open("w"), stderr=err.open("w"), text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in out.read_text().splitlines():
            if " on http://" in line:
                return proc, line.rsplit(" on ", 1)[1].strip()
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {err.read_text()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("server did not start within 120 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The service with an API key (from the environment) and one CORS origin; (URL, process id, log folder)."""
    logs = tmp_path_factory.mktemp("served")
    proc, url = start(logs, "steps=2", "engine.max_wait_ms=0",
                      f"cors_origins=[{ORIGIN}]", key=KEY)
    try:
        yield url, proc.pid, logs
    finally:
        stop(proc)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def count(url: str, code: int) -> float:
    from distill.serve.client import parse_metrics

    metrics = parse_metrics(httpx.get(f"{url}/metrics", headers=auth()).text)
    return metrics.get(f'distill_serve_requests_total{{code="{code}"}}', 0)


def test_a_10_mb_body_is_refused_413_at_once_with_bounded_memory(served):
    """A 10 MB prompt (Content-Length) and a 10 MB body streamed without a length (chunked) are each answered 413
    within a second, naming max_body_bytes, while the server's resident memory grows by less than 8 MB (the
    body is never read past the 1 MiB limit) and nothing of it reaches the log; the next ordinary request gets
    its image."""
    import psutil

    url, pid, logs = served
    server = psutil.Process(pid)
    body = json.dumps({"prompt": PROMPT * (TEN_MB // len(PROMPT))}).encode()
    before = count(url, 413)
    rss = server.memory_info().rss
    for content in (body, (body[i:i + 2**16] for i in range(0, len(body), 2**16))):
        start_s = time.perf_counter()
        response = httpx.post(f"{url}/generate", content=content, timeout=30,
                              headers={**auth(), "content-type": "application/json"})
        elapsed = time.perf_counter() - start_s
        assert response.status_code == 413, response.text[:300]
        assert "max_body_bytes=1048576" in response.json()["detail"]
        assert elapsed < 1.0, elapsed
    grown = server.memory_info().rss - rss
    assert grown < 8 * 2**20, grown / 2**20
    assert count(url, 413) == before + 2
    assert PROMPT * 2 not in (logs / "stdout").read_text() + (logs / "stderr").read_text()
    ok = httpx.post(f"{url}/generate", json={"prompt": PROMPT, "seed": 1}, headers=auth(), timeout=60)
    assert ok.status_code == 200 and ok.json()["seeds"] == [1]


@pytest.mark.parametrize("raw", [b'{"prompt": "\\ud800 seven"}', b'{"prompt": ["a seven", "\\udfff"]}'])
def test_a_prompt_with_a_lone_surrogate_is_a_422_naming_the_prompt(served, raw):
    url = served[0]
    response = httpx.post(f"{url}/generate", content=raw, timeout=60,
                          headers={**auth(), "content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert [e["loc"][-1] for e in response.json()["detail"]] == ["prompt"]


def test_every_route_but_the_open_pages_needs_the_api_key(served):
    from distill.serve.client import Client, ServeError

    url = served[0]
    before = count(url, 401)
    refused = [httpx.post(f"{url}/generate", json={"prompt": PROMPT}, headers=headers)
               for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"})]
    refused.append(httpx.get(f"{url}/metrics"))
    for response in refused:
        assert response.status_code == 401, response.text
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert "Authorization: Bearer" in response.json()["detail"]
    assert count(url, 401) == before + len(refused)
    for path in ("/health", "/", "/docs", "/openapi.json"):  # no data: the playground asks for the key
        assert httpx.get(f"{url}{path}").status_code == 200, path
    response = httpx.post(f"{url}/generate", json={"prompt": PROMPT, "seed": 3}, headers=auth(), timeout=60)
    assert response.status_code == 200 and response.json()["seeds"] == [3]
    with Client(url, timeout=60, api_key=KEY) as client:
        assert client.generate(PROMPT, seed=4).seeds == [4]
    with Client(url, timeout=60) as client, pytest.raises(ServeError) as refused:
        client.generate(PROMPT)
    assert refused.value.status == 401


def test_a_foreign_host_is_refused_400_and_loopback_names_are_served(served):
    """DNS rebinding: a page of evil.example whose name resolves to 127.0.0.1 reaches the service with its own
    name in the Host header, and is refused, key or not; the loopback names are served on any port."""
    url = served[0]
    response = httpx.get(f"{url}/health", headers={"Host": "evil.example"})
    assert response.status_code == 400 and "allowed_hosts" in response.json()["detail"]
    assert httpx.post(f"{url}/generate", json={"prompt": PROMPT}, headers={**auth(), "Host": "evil.example:80"},
                      timeout=60).status_code == 400
    for host in ("localhost:1234", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
        assert httpx.get(f"{url}/health", headers={"Host": host}).status_code == 200, host


def test_cors_answers_the_configured_origin_only(served):
    """A preflight from the configured origin is answered (without the key: browsers send none), and an answer
    carries the origin's header; another origin gets no CORS header."""
    url = served[0]
    preflight = httpx.options(f"{url}/generate", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert httpx.get(f"{url}/health", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in httpx.get(f"{url}/health", headers={"Origin": "http://evil.example"}
                                                          ).headers


def test_a_non_loopback_host_without_a_key_exits_2_naming_api_key_before_loading(monkeypatch):
    """host=0.0.0.0 without api_key exits 2 naming api_key and insecure=true, before the pipeline is loaded (a
    missing pipeline folder is never reached); a key, or insecure=true, passes that check."""
    import distill.serve.cli as cli
    from tests.test_serve import _compose_serve

    env = {k: v for k, v in os.environ.items() if k != "DISTILL_SERVE_API_KEY"}
    command = [sys.executable, "-m", "distill.serve", "port=0", "host=0.0.0.0", "pipeline=/nonexistent/pipe"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "api_key" in result.stderr and "insecure=true" in result.stderr, result.stderr
    assert "/nonexistent/pipe" not in result.stderr
    monkeypatch.delenv("DISTILL_SERVE_API_KEY", raising=False)
    for overrides in (["api_key=secret"], ["insecure=true"], ["host=127.0.0.2"], ["host=::1"]):
        cli._check(_compose_serve("host=0.0.0.0", *overrides))
    with pytest.raises(ValueError, match="api_key"):
        cli._check(_compose_serve("host=192.168.1.7"))
    assert cli.allowed_hosts(_compose_serve("host=127.0.0.2")) == ["localhost", "127.0.0.1", "[::1]", "127.0.0.2"]
    assert cli.allowed_hosts(_compose_serve("host=0.0.0.0", "insecure=true")) is None


def test_sigterm_past_the_drain_timeout_answers_503_json_and_exits_0(tmp_path):
    """A 1000-step request in flight when SIGTERM comes with drain_timeout_s=1: it is answered 503 in JSON with
    Retry-After about a second later (not uvicorn's plain-text 500 at its own deadline), the log holds no
    traceback, and the process exits 0."""
    proc, url = start(tmp_path, "drain_timeout_s=1", "engine.max_steps=1000", "engine.max_wait_ms=0")
    answers: list = []
    try:
        assert "access-control-allow-origin" not in httpx.get(f"{url}/health", headers={"Origin": ORIGIN}).headers
        thread = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/generate", json={"prompt": PROMPT, "steps": 1000}, timeout=60)))
        thread.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["in_flight"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        answered = time.monotonic() - signalled
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    response = answers[0]
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/json" and "Retry-After" in response.headers
    assert "stopped before request" in response.json()["detail"]
    assert 0.9 < answered < 5, answered
    log = (tmp_path / "stderr").read_text() + (tmp_path / "stdout").read_text()
    for bad in ("Traceback", "CancelledError", "never retrieved"):
        assert bad not in log, log
    assert proc.returncode == 0 and "distill.serve: stopped" in log


@pytest.fixture(scope="module")
def pipe():
    from distill.inference.loading import load_pipeline
    from distill.worlds.digits import asset_path

    return load_pipeline(str(asset_path("teacher")))


def held_engine(pipe, **kw):
    """A stream engine whose denoiser waits for the returned event before each step."""
    from distill.serve.engine import Engine
    from distill.serve.metrics import ServeMetrics

    engine = Engine(pipe, steps=2, guidance_scale=3.0, own_scheduler="ddim", max_wait_ms=0.0,
                    metrics=ServeMetrics(), **kw)
    gate = threading.Event()
    step = engine._stream_step
    engine._stream_step = lambda jobs: (gate.wait(60), step(jobs))
    return engine, gate


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_the_drain_answers_what_it_cuts_off_503_and_counts_it(pipe):
    """app.state.drain() (what SIGTERM calls) refuses new requests at once and, drain_timeout_s later, answers
    the request still held 503 with Retry-After, counted in /metrics."""
    from fastapi.testclient import TestClient

    from distill.serve.app import create_app
    from distill.serve.client import parse_metrics

    engine, gate = held_engine(pipe)
    answers: list = []
    try:
        with TestClient(create_app(engine, drain_timeout_s=0.5)) as client:
            thread = threading.Thread(target=lambda: answers.append(client.post("/generate", json={"prompt": PROMPT})))
            thread.start()
            wait_until(lambda: engine.inflight == 1)
            drained = time.monotonic()
            client.app.state.drain()
            refused = client.post("/generate", json={"prompt": PROMPT})
            thread.join(timeout=30)
            answered = time.monotonic() - drained
            health = client.get("/health")
            metrics = parse_metrics(client.get("/metrics").text)
            gate.set()
    finally:
        gate.set()
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
    assert answers[0].status_code == 503 and answers[0].headers["Retry-After"] == "5", answers[0].text
    assert 0.4 < answered < 5, answered
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert metrics['distill_serve_requests_total{code="503"}'] == 2


def test_a_handler_that_gave_up_leaves_no_unretrieved_future(pipe, caplog):
    """The engine settles a job with DeadlineExceeded just as its handler gives up at the deadline (the handler's
    cancel comes too late): the 504 goes out and asyncio reports no "Future exception was never retrieved"."""
    from fastapi.testclient import TestClient

    from distill.serve.app import create_app

    engine, gate = held_engine(pipe)
    submit = engine.submit

    def settled_first(job):
        future = submit(job)

        def late_cancel() -> bool:  # the engine dropped the job at its deadline a moment before
            future.set_exception(DeadlineExceeded(f"request {job.id} dropped"))
            return False

        future.cancel = late_cancel
        return future

    engine.submit = settled_first
    caplog.set_level(logging.ERROR, logger="asyncio")
    try:
        with TestClient(create_app(engine, drain_timeout_s=5)) as client:
            response = client.post("/generate", json={"prompt": PROMPT, "timeout_s": 0.3})
            gate.set()
    finally:
        gate.set()
    gc.collect()  # the event loop has ended: the handler's asyncio future is garbage, and asyncio says so
    assert response.status_code == 504
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


def test_health_turns_503_naming_a_stalled_stage(pipe):
    from fastapi.testclient import TestClient

    from distill.serve.app import create_app

    engine, gate = held_engine(pipe, stall_s=0.3)
    try:
        with TestClient(create_app(engine, drain_timeout_s=5)) as client:
            assert client.get("/health").json()["status"] == "ok"
            engine.submit(engine.job([PROMPT], seed=0))
            time.sleep(0.6)
            stalled = client.get("/health")
            gate.set()
    finally:
        gate.set()
    assert stalled.status_code == 503, stalled.text
    assert stalled.json()["status"] == "unhealthy" and "denoise" in stalled.json()["reason"]
