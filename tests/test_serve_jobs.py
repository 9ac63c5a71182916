"""distill.serve's job-id routes (issue 31, item 7) and its offline /docs page, through Starlette's test client.

POST /jobs answers 202 and an id at once; GET /jobs/{id} reports the stage and the denoising step while the
engine works (the denoiser is held at a chosen step, so the reading is exact, not a race), then /generate's own
answer for the same seed; DELETE stops the job inside the denoiser; an unknown or forgotten id is a 404 naming it.
"""

from __future__ import annotations

import base64
import re
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from distill.serve.engine import Job
from distill.worlds.digits import asset_path

STEPS = 12
PROMPT = "a handwritten digit three"


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    from distill.inference.loading import load_pipeline
    from distill.serve.app import create_app
    from distill.serve.engine import Engine
    from distill.serve.metrics import ServeMetrics

    pipe = load_pipeline(str(asset_path("teacher")))
    engine = Engine(pipe, steps=4, guidance_scale=3.0, own_scheduler="ddim", mode="stream", max_wait_ms=0.0,
                    metrics=ServeMetrics())
    with TestClient(create_app(engine, "digits-teacher")) as client:
        yield client, engine


class Hold:
    """Holds the stream denoiser before the call that would take a job past ``step`` steps, until released."""

    def __init__(self, engine, step: int):
        self.engine, self.step, self.reached, self.go = engine, step, threading.Event(), threading.Event()
        self.calls: list[int] = []  # the step index of each denoiser call

    def __enter__(self):
        inner = self.engine._stream_step

        def held(jobs):
            if any(job.index == self.step for job in jobs):
                self.reached.set()
                self.go.wait(60)
            self.calls.extend(job.index for job in jobs)
            inner(jobs)

        self.inner, self.engine._stream_step = inner, held
        return self

    def __exit__(self, *exc):
        self.go.set()
        self.engine._stream_step = self.inner


def wait_job(client, url: str, timeout: float = 60.0, headers: dict | None = None):
    """GET ``url`` until the job is no longer queued or running; the last answer."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        response = client.get(url, headers=headers)
        if response.json().get("status") not in ("queued", "running"):
            return response
        time.sleep(0.02)
    raise AssertionError(f"{url} still {response.json()} after {timeout} s")


def test_a_job_shows_its_step_then_answers_generates_image(http):
    from distill.serve.client import parse_metrics

    client, engine = http
    request = {"prompt": PROMPT, "seed": 31, "steps": STEPS}
    with Hold(engine, 5) as hold:
        submitted = client.post("/jobs", json=request)
        assert submitted.status_code == 202, submitted.text
        key, url = submitted.json()["id"], submitted.json()["status_url"]
        assert url == f"/jobs/{key}" and submitted.headers["Location"] == url
        assert len(key) >= 22 and re.fullmatch(r"[A-Za-z0-9_-]+", key)  # 128 random bits, not a counter
        assert hold.reached.wait(60)
        state = client.get(url)
        assert state.status_code == 200
        body = state.json()
        assert body["status"] == "running" and body["stage"] == "denoise"
        assert (body["step"], body["steps"]) == (5, STEPS) and body["elapsed_s"] > 0
        assert "result" not in body
        hold.go.set()
        done = wait_job(client, url)
    assert done.status_code == 200
    body = done.json()
    assert body["status"] == "done" and body["stage"] == "done" and (body["step"], body["steps"]) == (STEPS, STEPS)
    assert hold.calls == list(range(STEPS))  # one denoiser call a step, none skipped or repeated
    result = body["result"]
    direct = client.post("/generate", json=request).json()
    assert set(result) == set(direct) and result["seeds"] == direct["seeds"] == [31]
    assert {k: result[k] for k in ("steps", "guidance_scale", "height", "width", "scheduler")} == \
        {k: direct[k] for k in ("steps", "guidance_scale", "height", "width", "scheduler")}
    ours, theirs = (np.asarray(_image(r["images"][0]), dtype=int) for r in (result, direct))
    assert np.abs(ours - theirs).max() <= 1 and ours.std() > 0
    assert client.get(url).json()["result"]["images"] == result["images"]  # kept for the owner to fetch again
    metrics = parse_metrics(client.get("/metrics").text)
    assert metrics['distill_serve_requests_total{code="202"}'] >= 1
    assert metrics["distill_serve_requests_in_flight"] == 0 and metrics["distill_serve_request_seconds_count"] == 2


def _image(b64: str):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")


def test_delete_cancels_a_job_inside_the_denoiser(http):
    client, engine = http
    with Hold(engine, 3) as hold:
        key = client.post("/jobs", json={"prompt": PROMPT, "steps": STEPS}).json()["id"]
        assert hold.reached.wait(60)
        cancelled = client.delete(f"/jobs/{key}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        hold.go.set()
        # the cancel settles the job (in-flight 0) at once; the held call then ends on the denoiser's thread
        deadline = time.monotonic() + 30
        while (engine.inflight or engine._working.get("denoise") is not None) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.inflight == 0 and engine._working.get("denoise") is None
    body = client.get(f"/jobs/{key}").json()
    # cancelled with 3 steps done (the step under way then may end, and counts no more); no other step is taken
    assert body["status"] == "cancelled" and body["step"] == 3 and "result" not in body
    assert hold.calls == [0, 1, 2, 3], "the denoiser went on with a cancelled job"
    assert client.delete(f"/jobs/{key}").json()["status"] == "cancelled"  # again: nothing changes


def test_a_job_past_its_deadline_is_a_504_and_refusals_are_generates(http):
    client, engine = http
    with Hold(engine, 1):  # 2 steps: admitted at any measured rate (a job that cannot finish in time is a 429)
        key = client.post("/jobs", json={"prompt": PROMPT, "steps": 2, "timeout_s": 0.3}).json()["id"]
        time.sleep(0.4)
        late = client.get(f"/jobs/{key}")
    assert late.status_code == 504, late.text
    assert late.json()["status"] == "failed" and "timeout_s=0.3" in late.json()["detail"]
    for body, field in (({"prompt": PROMPT, "steps": 0}, "steps"), ({"prompt": PROMPT, "format": "png"}, "format"),
                        ({"prompt": PROMPT, "stepz": 2}, "stepz")):
        refused = client.post("/jobs", json=body)
        assert refused.status_code == 422 and field in [e["loc"][-1] for e in refused.json()["detail"]], refused.text


def test_an_unknown_id_is_a_404_naming_it(http):
    client, _ = http
    for method in (client.get, client.delete):
        response = method("/jobs/no-such-job")
        assert response.status_code == 404 and "'no-such-job'" in response.json()["detail"]


def test_the_store_forgets_finished_jobs_by_age_and_count():
    from distill.serve.jobs import JobStore

    store = JobStore(ttl_s=0.2, max_finished=2)

    def job() -> Job:
        return Job(["a"], [0], 1, 1.0, 32, 32, future=Future(), submitted=time.monotonic())

    jobs = [job() for _ in range(4)]
    keys = [store.add(j) for j in jobs]
    assert len(set(keys)) == 4
    for j in jobs[:3]:
        j.future.set_result(None)
    assert store.get(keys[0]) is None  # three finished, two kept: the oldest goes
    assert store.get(keys[1]) is not None and store.get(keys[3]) is not None
    time.sleep(0.25)
    assert store.get(keys[1]) is None and store.get(keys[2]) is None
    assert store.get(keys[3]) is not None, "an unfinished job is never forgotten"


def test_the_store_keeps_finished_images_within_its_byte_budget():
    from distill.serve.engine import Result
    from distill.serve.jobs import JobStore

    store = JobStore(max_finished=10, max_bytes=2500)
    jobs = [Job(["a"], [0], 1, 1.0, 32, 32, future=Future(), submitted=time.monotonic()) for _ in range(3)]
    keys = [store.add(j) for j in jobs]
    for j in jobs:
        j.future.set_result(Result([b"x" * 1000], [0], 0.1, {}, {}))
    # 3000 bytes held against 2500: the oldest goes, the two latest stay
    assert store.get(keys[0]) is None and store.get(keys[1]) is not None and store.get(keys[2]) is not None


def test_docs_are_served_from_local_assets(http):
    client, _ = http
    page = client.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", page.text)
    assert len(urls) >= 3, urls
    assert not re.search(r"https?://", page.text), "the docs page loads something from another host"
    for url in urls:
        asset = client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 1000, url
    assert client.get("/redoc").status_code == 404  # FastAPI's CDN page is gone, not left blank


def test_clients_see_the_models_name_not_its_path(http):
    """A local folder is shown by its name on /health, the playground and /docs' description; a hub id as it is."""
    from fastapi.testclient import TestClient

    from distill.serve.app import create_app

    _, engine = http
    folder = str(asset_path("teacher"))
    for model, shown in ((folder, Path(folder).name), ("org/some-model", "org/some-model")):
        client = TestClient(create_app(engine, model))  # no lifespan: the fixture's app owns the engine
        assert client.get("/health").json()["model"] == shown
        for text in (client.get("/").text, client.get("/openapi.json").text):
            assert shown in text and (model == shown or model not in text)


def test_with_an_api_key_the_job_routes_need_it_and_the_docs_do_not(http):
    from fastapi.testclient import TestClient

    from distill.serve.app import create_app

    _, engine = http
    client = TestClient(create_app(engine, "digits-teacher", api_key="k3y"))  # the fixture's app owns the engine
    key = {"Authorization": "Bearer k3y"}
    assert client.post("/jobs", json={"prompt": PROMPT, "steps": 2}).status_code == 401
    submitted = client.post("/jobs", json={"prompt": PROMPT, "steps": 2}, headers=key)
    assert submitted.status_code == 202, submitted.text
    url = submitted.json()["status_url"]
    # nor read or cancelled without it
    assert client.get(url).status_code == 401 and client.delete(url).status_code == 401
    assert wait_job(client, url, headers=key).json()["status"] == "done"
    assert client.get("/docs").status_code == 200 and client.get("/docs/assets/swagger-ui.css").status_code == 200
