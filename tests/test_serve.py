"""distill.serve (issue 17): the engine's batching, stages and stream batching against diffusers' own pipeline
call, seeded determinism across batch compositions, backpressure and deadlines, the HTTP answers, and a
graceful shutdown of the real service.

The reference for every served image is the pipeline called the way a user calls it, alone, with a generator
seeded with the request's seed: ``pipe(prompt, num_inference_steps=..., guidance_scale=..., generator=g)``.
"""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from distill.serve.engine import DeadlineExceeded, Engine, Job, JobQueue, QueueFull
from distill.worlds.digits import asset_path
from tests.conftest import ROOT

PROMPTS = [f"a handwritten digit {d}" for d in range(10)]
STEPS, GUIDANCE = 6, 3.0


@pytest.fixture(scope="module")
def pipe():
    from distill.inference.loading import load_pipeline

    pipe = load_pipeline(str(asset_path("teacher")))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, prompt, seed, steps=STEPS, guidance=GUIDANCE, scheduler=None) -> np.ndarray:
    """The pipeline's own call for one request, alone, as uint8 (H, W, C)."""
    from distill.inference.schedulers import make_scheduler, scheduler_options

    own = pipe.scheduler
    if scheduler is not None:
        pipe.scheduler = make_scheduler(scheduler, own.config, **scheduler_options(scheduler))
    try:
        image = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance,
                     generator=torch.Generator().manual_seed(seed)).images[0]
    finally:
        pipe.scheduler = own
    return np.asarray(image.convert("RGB"))


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def assert_close(served: np.ndarray, expected: np.ndarray) -> None:
    """Within 1/255 per pixel (the issue's bound: batch composition changes float sums in the last bits)."""
    assert served.shape == expected.shape
    diff = np.abs(served.astype(int) - expected.astype(int))
    assert diff.max() <= 1, f"max pixel difference {diff.max()} > 1/255 ({(diff > 1).mean():.1%} of pixels)"


def make_engine(pipe, **kw) -> Engine:
    settings = {"steps": STEPS, "guidance_scale": GUIDANCE, "own_scheduler": "ddim", "max_wait_ms": 200.0, **kw}
    return Engine(pipe, **settings)


def spy_steps(engine: Engine) -> list[set]:
    """Record, for each stream denoiser call, the (job id, step index) of every job it advanced."""
    calls: list[set] = []
    step = engine._stream_step

    def recording(jobs):
        calls.append({(job.id, job.index) for job in jobs})
        step(jobs)

    engine._stream_step = recording
    return calls


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def run(engine: Engine, jobs: list[Job], stagger: float = 0.0) -> list:
    futures = []
    for job in jobs:
        futures.append(engine.submit(job))
        time.sleep(stagger)
    return [f.result(timeout=120) for f in futures]


@pytest.mark.parametrize("mode", ["sequential", "batch", "pipeline", "stream"])
def test_a_seeded_request_alone_and_in_a_mixed_batch_gives_the_pipelines_image(pipe, mode):
    """The same seeded request served alone and inside a batch of other requests (other prompts and seeds; in
    stream mode also other step counts and guidance, joining while others denoise) equals the pipeline's own
    call within 1/255, and the batch was really shared."""
    engine = make_engine(pipe, mode=mode, max_batch_size=8, max_wait_ms=0.0 if mode == "stream" else 200.0)
    try:
        alone = run(engine, [engine.job([PROMPTS[7]], seed=11)])[0]
        if mode == "stream":  # others at other steps and guidance, already denoising when ours arrives
            calls = spy_steps(engine)
            others = [engine.job([PROMPTS[i]], seed=100 + i, steps=STEPS + 6, guidance_scale=1.5 + i)
                      for i in range(3)]
            futures = [engine.submit(job) for job in others]
            wait_for(lambda: others[0].index >= 3)
            ours = engine.job([PROMPTS[7]], seed=11)
            mixed = run(engine, [ours])[0]
            extra = [f.result(timeout=120) for f in futures]
            assert_close(pixels(extra[1].png[0]), reference(pipe, PROMPTS[1], 101, STEPS + 6, 2.5))
            # one UNet call advanced ours at its first step and the others at a later one
            assert any((ours.id, 0) in call and (others[0].id, 0) not in call and
                       any(job_id == others[0].id for job_id, _ in call) for call in calls)
        else:
            jobs = [engine.job([PROMPTS[i]], seed=100 + i) for i in range(3)] + [engine.job([PROMPTS[7]], seed=11)]
            mixed = run(engine, jobs)[-1]
    finally:
        assert engine.close(timeout=60)
    expected = reference(pipe, PROMPTS[7], 11)
    assert alone.batch_sizes["denoise"] == 1
    assert mixed.batch_sizes["denoise"] > 1 or mode == "sequential"
    assert_close(pixels(alone.png[0]), expected)
    assert_close(pixels(mixed.png[0]), expected)


def test_stream_batching_advances_jobs_of_different_steps_guidance_and_schedulers_together(pipe):
    """One denoiser batch holds jobs with different schedulers (DDIM, DPM-Solver, Euler: each its own state),
    step counts and guidance (CFG and none); each finishes with its own image and leaves when done."""
    engine = make_engine(pipe, mode="stream", max_batch_size=8)
    specs = [("ddim", 4, 3.0), ("dpmsolver", 6, 2.0), ("euler", 5, 1.0), (None, 3, 4.0)]
    try:
        jobs = [engine.job([PROMPTS[i]], seed=i, steps=n, guidance_scale=w, scheduler=s)
                for i, (s, n, w) in enumerate(specs)]
        results = run(engine, jobs)
    finally:
        engine.close(timeout=60)
    for i, ((name, n, w), result) in enumerate(zip(specs, results)):
        assert_close(pixels(result.png[0]), reference(pipe, PROMPTS[i], i, n, w, name))
        assert result.batch_sizes["denoise"] >= 2  # shared the UNet batch with the others


def test_many_requests_keep_their_identity_and_arrival_order(pipe):
    """Twelve concurrent requests (some of two prompts) through the pipelined stages: every answer holds its own
    prompts' images (equal to one batched pipeline call with per-image generators), and requests of one batch
    key finish in arrival order."""
    from distill.serve.metrics import ServeMetrics

    engine = make_engine(pipe, mode="pipeline", max_batch_size=4, max_wait_ms=20.0, metrics=ServeMetrics())
    requests = [([PROMPTS[i % 10]] if i % 3 else [PROMPTS[i % 10], PROMPTS[(i + 5) % 10]], 1000 + 10 * i)
                for i in range(12)]
    done: list[int] = []
    lock = threading.Lock()
    try:
        futures = []
        for prompts, seed in requests:
            future = engine.submit(engine.job(prompts, seed))
            future.add_done_callback(lambda _, seed=seed: (lock.acquire(), done.append(seed), lock.release()))
            futures.append(future)
        results = [f.result(timeout=120) for f in futures]
    finally:
        engine.close(timeout=60)
    assert done == [seed for _, seed in requests]
    prompts = [p for ps, _ in requests for p in ps]
    seeds = [seed + i for ps, seed in requests for i in range(len(ps))]
    batch = pipe(prompts, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                 generator=[torch.Generator().manual_seed(s) for s in seeds]).images
    served = [png for r in results for png in r.png]
    assert [s for r in results for s in r.seeds] == seeds
    for png, image in zip(served, batch):
        assert_close(pixels(png), np.asarray(image.convert("RGB")))
    sizes = [r.batch_sizes["denoise"] for r in results]
    assert max(sizes) > 1 and max(sizes) <= 4
    assert engine.metrics.registry.get_sample_value("distill_serve_images_total") == len(prompts)


def test_batches_never_mix_incompatible_requests(pipe):
    """Requests that differ in steps, guidance or size arrive together: each pipeline call holds only its own
    kind (the batch sizes the answers report), and every image is its own request's."""
    engine = make_engine(pipe, mode="batch", max_batch_size=8, max_wait_ms=300.0)
    kinds = [{"steps": 3}, {"steps": 4}, {"steps": 3, "guidance_scale": 2.0}, {"steps": 3, "height": 24}]
    try:
        jobs = [engine.job([PROMPTS[k]], seed=k + 10 * i, **kind) for i in range(2) for k, kind in enumerate(kinds)]
        results = run(engine, jobs)
    finally:
        engine.close(timeout=60)
    assert [r.batch_sizes["denoise"] for r in results] == [2] * 8
    for job, result in zip(jobs, results):
        kind = kinds[PROMPTS.index(job.prompts[0])]
        if "height" not in kind:
            assert_close(pixels(result.png[0]), reference(pipe, job.prompts[0], job.seeds[0], job.steps,
                                                          job.guidance_scale))
        else:
            assert pixels(result.png[0]).shape == (24, 32, 3)


def test_the_queue_takes_only_compatible_jobs_oldest_first_and_refuses_when_full():
    queue = JobQueue(maxsize=5)
    stop = threading.Event()

    def job(steps, n=1, height=32):
        return Job(["p"] * n, list(range(n)), steps, 3.0, height, height)

    a, b, c, d, e = job(4), job(8), job(4, n=2), job(4, height=64), job(8)
    for j in (a, b, c, d, e):
        queue.put(j, retry_after=2.0)
    with pytest.raises(QueueFull) as err:
        queue.put(job(4), retry_after=2.0)
    assert err.value.retry_after == 2.0
    assert queue.take(Job.batch_key, 8, 0.0, stop) == [a, c]  # same size, steps, guidance, scheduler
    assert queue.take(Job.batch_key, 8, 0.0, stop) == [b, e]
    assert queue.take(Job.batch_key, 8, 0.0, stop) == [d]
    for j in (a, c, b):
        queue.put(j, retry_after=1.0)
    assert queue.take(Job.batch_key, 2, 0.0, stop) == [a]  # c (2 images) would exceed 2 images
    assert queue.take(Job.size_key, 8, 0.0, stop) == [c, b]  # any steps of one size
    stop.set()
    assert queue.take(None, 8, 0.0, stop) == []


def test_deadlines_cancel_and_close_drains_requests_in_flight(pipe):
    engine = make_engine(pipe, mode="pipeline", max_batch_size=2, max_wait_ms=0.0, queue_size=8)
    slow = [engine.job([PROMPTS[i]], seed=i, steps=40) for i in range(2)]
    futures = [engine.submit(job) for job in slow]
    time.sleep(0.1)  # both in the stages now
    late = engine.job([PROMPTS[3]], seed=3, timeout_s=0.01)
    waiting = [engine.submit(late), engine.submit(engine.job([PROMPTS[4]], seed=4))]
    with pytest.raises(DeadlineExceeded):
        waiting[0].result(timeout=120)  # dropped at the next stage boundary, never denoised
    assert engine.close(drain=True, timeout=120)  # the others finish before close returns
    assert all(f.done() and f.exception() is None for f in futures + waiting[1:])
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit(engine.job([PROMPTS[6]], seed=6))


def test_exports_are_served_as_their_default_call(tmp_path):
    """An LCM student (guidance as an input, a stochastic multistep scheduler drawing noise from the generator)
    and a timestep-MoE progressive student (one expert per noise level: a stream batch mixes them) are served,
    in stream and batch mode, with the images of ``DiffusionPipeline.from_pretrained(export)(prompt, generator=g)``."""
    from diffusers import DiffusionPipeline

    from distill.inference.loading import pipeline_defaults
    from distill.serve.cli import call_defaults
    from tests.sd_tiny import write_tiny_sd
    from tests.test_exports import consistency_copy, progressive_moe_timestep

    sd = write_tiny_sd(tmp_path / "sd")
    for build in (consistency_copy, progressive_moe_timestep):
        folder = build(sd).eval().export(tmp_path / build.__name__)
        export = DiffusionPipeline.from_pretrained(folder)
        export.set_progress_bar_config(disable=True)
        steps, guidance = call_defaults(export)
        own = pipeline_defaults(str(folder)).get("name")
        expected = [np.asarray(export("a handwritten digit three", generator=torch.Generator().manual_seed(s))
                               .images[0].convert("RGB")) for s in (5, 6)]
        for mode in ("stream", "batch"):
            engine = Engine(export, steps=steps, guidance_scale=guidance, own_scheduler=own, mode=mode,
                            max_wait_ms=0.0 if mode == "stream" else 100.0)
            try:
                # a second job a step or more behind (stream), or in the same call (batch)
                job = engine.job(["a handwritten digit three"], seed=5)
                first = engine.submit(job)
                if mode == "stream":
                    wait_for(lambda job=job: job.index >= 1 or job.future.done())
                second = engine.submit(engine.job(["a handwritten digit three"], seed=6))
                results = [first.result(timeout=120), second.result(timeout=120)]
            finally:
                engine.close(timeout=60)
            for result, image in zip(results, expected):
                assert_close(pixels(result.png[0]), image)


def test_an_accelerator_runs_on_every_call_and_is_refused_in_stream_mode(pipe):
    from distill.accelerate import DeepCache, accelerated

    with accelerated(pipe, DeepCache(interval=3)):
        expected = np.asarray(pipe(PROMPTS[2], num_inference_steps=9, guidance_scale=GUIDANCE,
                                   generator=torch.Generator().manual_seed(2)).images[0].convert("RGB"))
    plain = reference(pipe, PROMPTS[2], 2, steps=9)
    engine = make_engine(pipe, mode="pipeline", accelerator=DeepCache(interval=3))
    try:
        served = pixels(run(engine, [engine.job([PROMPTS[2]], seed=2, steps=9)])[0].png[0])
    finally:
        engine.close(timeout=60)
    assert_close(served, expected)
    assert np.abs(served.astype(int) - plain.astype(int)).max() > 1  # the cache changed the image: it ran
    with pytest.raises(ValueError, match="mode=pipeline"):
        make_engine(pipe, mode="stream", accelerator=DeepCache(interval=3))


@pytest.fixture(scope="module")
def http(pipe):
    """The FastAPI app on a pipelined engine, through Starlette's test client (lifespan included)."""
    from fastapi.testclient import TestClient

    from distill.serve.app import create_app
    from distill.serve.metrics import ServeMetrics

    engine = make_engine(pipe, mode="stream", max_batch_size=4, queue_size=2, metrics=ServeMetrics())
    with TestClient(create_app(engine, "digits-teacher")) as client:
        yield client, engine


@pytest.mark.parametrize("body, field", [
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", " "]}, "prompt"), ({"prompt": ["a"] * 5}, "prompt"),
    ({"prompt": "a", "steps": 0}, "steps"), ({"prompt": "a", "steps": 101}, "steps"),
    ({"prompt": "a", "height": 30}, "height"), ({"prompt": "a", "width": 4096}, "width"),
    ({"prompt": "a", "scheduler": "fast"}, "scheduler"), ({"prompt": "a", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": ["a", "b"], "format": "png"}, "format"), ({"prompt": "a", "format": "jpeg"}, "format"),
    ({"prompt": "a", "seed": -1}, "seed"), ({"prompt": "a", "timeout_s": 0}, "timeout_s"),
    ({"prompt": "a", "stepz": 4}, "stepz"), ({}, "prompt"), ({"prompt": "a", "steps": True}, "steps"),
    ({"prompt": "a", "timeout_s": 1e9}, "timeout_s"),
    ({"prompt": "a", "scheduler": "lcm", "steps": 60}, "steps"),  # beyond the LCM scheduler's training grid
])
def test_bad_input_is_a_422_naming_the_field_and_the_service_goes_on(http, body, field):
    client, _ = http
    response = client.post("/generate", json=body)
    assert response.status_code == 422, response.text
    assert field in [e["loc"][-1] for e in response.json()["detail"]]
    assert client.post("/generate", json={"prompt": "a handwritten digit one", "steps": 2}).status_code == 200


def test_http_answers_images_health_metrics_429_and_504(http, pipe):
    from distill.serve.client import parse_metrics

    client, engine = http
    response = client.post("/generate", json={"prompt": PROMPTS[4], "seed": 4, "steps": STEPS})
    assert response.status_code == 200
    body = response.json()
    assert body["seeds"] == [4] and body["steps"] == STEPS and body["guidance_scale"] == GUIDANCE
    import base64

    assert_close(pixels(base64.b64decode(body["images"][0])), reference(pipe, PROMPTS[4], 4))
    png = client.post("/generate", json={"prompt": PROMPTS[4], "seed": 4, "steps": STEPS, "format": "png"})
    assert png.headers["content-type"] == "image/png" and png.headers["X-Seed"] == "4"
    assert_close(pixels(png.content), pixels(base64.b64decode(body["images"][0])))
    two = client.post("/generate", json={"prompt": PROMPTS[:2], "seed": 9, "steps": 2}).json()
    assert two["seeds"] == [9, 10] and len(two["images"]) == 2

    # fill the service: the denoiser holds 4 images, one batch waits beside it, the stage queue holds two, the
    # encoder one, the request queue two (queue_size); nothing more is taken, and the next request is told
    # when to retry
    gate = threading.Event()
    step = engine._stream_step
    engine._stream_step = lambda jobs: (gate.wait(60), step(jobs))  # the denoiser holds until we let it go
    held = []
    try:
        with pytest.raises(QueueFull):
            for i in range(30):
                held.append(engine.submit(engine.job(PROMPTS[:4] if i == 0 else [PROMPTS[i % 10]], seed=i,
                                                     steps=2)))
                time.sleep(0.02)
        response = client.post("/generate", json={"prompt": PROMPTS[5]})
    finally:
        gate.set()
        engine._stream_step = step
    # bounded: the 4-image job denoising, then batches of at most 4 single jobs beside it (one), in the stage
    # queue (two), in the encoder (one), and queue_size=2 waiting jobs: memory cannot grow with the load
    assert len(held) <= 1 + 4 * (1 + 2 + 1) + 2
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    for future in held:
        future.result(timeout=120)
    # work that cannot be done by the deadline at the measured rate is refused at the door, naming the deadline
    response = client.post("/generate", json={"prompt": PROMPTS[5], "steps": 100, "timeout_s": 0.05})
    assert response.status_code == 429 and "timeout_s=0.05" in response.json()["detail"], response.text
    assert int(response.headers["Retry-After"]) >= 1
    # and a request that could be done in time but is held up past its deadline is cancelled with 504
    engine._stream_step = lambda jobs: (gate.wait(60), step(jobs))
    gate.clear()
    try:
        response = client.post("/generate", json={"prompt": PROMPTS[5], "steps": 1, "timeout_s": 0.5})
    finally:
        gate.set()
        engine._stream_step = step
    assert response.status_code == 504 and "timeout_s=0.5" in response.json()["detail"], response.text

    assert client.head("/health").status_code == 200
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["mode"] == "stream"
    assert health["defaults"]["steps"] == STEPS and health["defaults"]["height"] == 32
    metrics = parse_metrics(client.get("/metrics").text)
    assert metrics['distill_serve_requests_total{code="429"}'] >= 1
    assert metrics['distill_serve_requests_total{code="504"}'] >= 1
    assert metrics['distill_serve_requests_total{code="200"}'] >= 3
    assert metrics['distill_serve_batch_size_images_count{stage="denoise"}'] >= 1
    assert metrics["distill_serve_queue_depth"] == 0
    assert "distill_serve_images_per_second" in metrics
    assert "/generate" in client.get("/openapi.json").json()["paths"]
    page = client.get("/").text
    assert "digits-teacher" in page and f'value="{STEPS}"' in page


def test_a_prompt_over_the_character_limit_is_a_422_naming_it_before_any_tokenisation(http):
    """A 1,000,000-character prompt (inside the 1 MiB body limit) is answered 422 naming engine.max_prompt_chars
    within a second, and the text encoder never sees it; the next request is served."""
    client, engine = http
    seen = []
    embed = engine.embed
    engine.embed = lambda prompts, *args: (seen.append(max(map(len, prompts))), embed(prompts, *args))[1]
    try:
        start = time.perf_counter()
        response = client.post("/generate", json={"prompt": ["a seven", "7" * 1_000_000]})
        elapsed = time.perf_counter() - start
        ok = client.post("/generate", json={"prompt": "x" * engine.max_prompt_chars, "steps": 1})
    finally:
        engine.embed = embed
    assert response.status_code == 422, response.text[:300]
    (error,) = response.json()["detail"]
    assert error["loc"][-1] == "prompt" and f"max_prompt_chars={engine.max_prompt_chars}" in error["msg"]
    assert "1000000 characters" in error["msg"] and elapsed < 1.0, elapsed
    assert ok.status_code == 200 and seen == [engine.max_prompt_chars]  # only the prompt at the limit was encoded


def test_nan_deadlines_are_a_422_and_every_422_is_counted(http):
    from distill.serve.client import parse_metrics

    client, _ = http
    before = parse_metrics(client.get("/metrics").text).get('distill_serve_requests_total{code="422"}', 0)
    response = client.post("/generate", content=b'{"prompt": "a", "timeout_s": NaN}',
                           headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"][-1] == "timeout_s"
    assert client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    after = parse_metrics(client.get("/metrics").text)['distill_serve_requests_total{code="422"}']
    assert after == before + 2


def test_a_client_that_hangs_up_has_its_request_cancelled(pipe):
    """A client that gives up (closes the connection) before its image is made: the request is dropped in the
    denoiser, no image is counted, and the service answers the next request."""
    import httpx
    import uvicorn

    from distill.serve.app import create_app
    from distill.serve.client import parse_metrics
    from distill.serve.metrics import ServeMetrics

    engine = make_engine(pipe, mode="stream", max_wait_ms=0.0, metrics=ServeMetrics())
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started and server.servers)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/generate", json={"prompt": PROMPTS[1], "steps": 100}, timeout=0.3)
        wait_for(lambda: engine.inflight == 0, timeout=30)  # cancelled, not run to the end
        metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
        assert metrics['distill_serve_requests_total{code="499"}'] == 1
        assert metrics.get("distill_serve_images_total", 0) == 0 and metrics["distill_serve_dropped_total"] == 1
        assert httpx.post(f"{url}/generate", json={"prompt": PROMPTS[2], "steps": 2}, timeout=60).status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    assert not thread.is_alive()


def test_a_classifier_guide_without_labels_is_refused(pipe):
    from distill.accelerate import ClassifierGuidance

    with pytest.raises(ValueError, match="accelerate.options.labels"):
        make_engine(pipe, mode="pipeline", accelerator=ClassifierGuidance(
            scale=1.0, mode="noisy", classifier=str(asset_path("noisy_classifier"))))


def _start_server(*overrides: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "distill.serve", "port=0", *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        if " on http://" in line:
            return proc, line.rsplit(" on ", 1)[1].strip()
    proc.kill()
    raise AssertionError("server did not start within 120 s")


def test_sigterm_finishes_requests_in_flight_then_exits():
    """SIGTERM while four requests are being served: each gets its image, the service takes no new one, and the
    process exits 0."""
    from distill.serve import Client

    proc, url = _start_server("steps=30", "engine.mode=pipeline", "engine.max_batch_size=2")
    try:
        client = Client(url, timeout=120)
        assert client.health()["status"] == "ok"
        results: list = [None] * 4

        def send(i):
            try:
                results[i] = Client(url, timeout=120).generate(PROMPTS[i], seed=i).seeds
            except Exception as err:  # noqa: BLE001 - recorded, asserted below
                results[i] = err

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while client.metrics().get("distill_serve_requests_in_flight", 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the signal is handled: the listener closes
            try:
                if client.http.get("/health").status_code == 503:
                    break
            except Exception:  # noqa: BLE001 - connection refused: no longer listening
                break
            time.sleep(0.02)
        try:
            refused = client.generate(PROMPTS[9])
        except Exception as err:  # noqa: BLE001 - 503 while draining, or the listener is closed
            refused = err
        for thread in threads:
            thread.join(timeout=120)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert results == [[0], [1], [2], [3]], results
    assert not hasattr(refused, "seeds")
    assert proc.returncode == 0 and "distill.serve: stopped" in out, out


def _compose_serve(*overrides: str):
    from hydra import compose, initialize_config_dir

    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="serve", overrides=list(overrides))


@pytest.mark.parametrize("overrides, error", [
    (["steps=500"], "steps=500 must lie in \\[1, engine.max_steps=100\\]"),
    (["dtype=float8"], "dtype='float8' is unknown"),
    (["port=70000"], "port=70000 must lie in"),
    (["accelerate=deepcache", "engine.mode=stream"], "set engine.mode=pipeline"),
    (["pipeline=/nonexistent/pipe"], "/nonexistent/pipe"),
])
def test_bad_settings_are_refused_before_serving(overrides, error, monkeypatch):
    import distill.serve.cli as cli

    served = []
    monkeypatch.setattr(cli, "_server", lambda config: served.append(config))
    with pytest.raises((ValueError, OSError), match=error):
        cli.serve(_compose_serve("port=0", *overrides))
    assert not served


def test_a_taken_port_and_unknown_choices_are_refused_by_name(monkeypatch):
    import socket

    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ValidationError

    import distill.serve.cli as cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(cli, "build", lambda cfg: pytest.fail("the model was loaded"))
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            cli.serve(_compose_serve(f"port={port}"))
    with pytest.raises(MissingConfigException, match="scheduler"):
        _compose_serve("scheduler=fastest")
    with pytest.raises((ValidationError, ConfigCompositionException), match="turbo"):
        _compose_serve("engine.mode=turbo")
    cfg = _compose_serve("scheduler=dpmsolver", "engine.mode=batch", "engine.max_batch_size=16")
    assert cfg.scheduler.name == "dpmsolver" and cfg.engine.max_batch_size == 16


def test_the_command_exits_2_naming_the_bad_value():
    result = subprocess.run([sys.executable, "-m", "distill.serve", "port=0", "steps=500"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "steps=500 must lie in [1, engine.max_steps=100]" in result.stderr
    assert " on http://" not in result.stdout


@pytest.mark.slow
def test_30_second_soak_has_no_error_and_flat_memory():
    """Four clients back to back for 30 s: every answer is 200, and the server's resident memory in the second
    15 s does not exceed the first 15 s's peak by more than 32 MB."""
    import psutil

    from distill.serve import Client

    proc, url = _start_server("steps=4", "engine.mode=stream", "engine.max_batch_size=8")
    server = psutil.Process(proc.pid)
    rss: list[tuple[float, int]] = []
    errors: list = []
    count = [0]
    stop = time.monotonic() + 30

    def worker(k):
        client = Client(url, timeout=60)
        i = 0
        while time.monotonic() < stop:
            try:
                client.generate(PROMPTS[(k + i) % 10], seed=i)
                count[0] += 1
            except Exception as err:  # noqa: BLE001 - collected, asserted below
                errors.append(err)
            i += 1

    try:
        start = time.monotonic()
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        while time.monotonic() < stop:
            rss.append((time.monotonic() - start, server.memory_info().rss))
            time.sleep(0.25)
        for thread in threads:
            thread.join(timeout=60)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not errors and count[0] > 20
    first = max(r for t, r in rss if t < 15)
    second = max(r for t, r in rss if t >= 15)
    assert second <= first + 32 * 2**20, (first / 2**20, second / 2**20)
    assert proc.returncode == 0
    Path(os.environ.get("SERVE_SOAK_LOG", os.devnull)).write_text(json.dumps({"requests": count[0], "rss": rss}))


# ---------------------------------------------------------------- robustness (issue 31)

def test_prompts_are_tokenised_once_with_truncation_and_never_logged(pipe, caplog):
    """The engine's text encoding equals diffusers' encode_prompt (short prompts exactly; a long one as encode_prompt
    truncates it), without the second full tokenisation that echoes the cut text into the log."""
    engine = make_engine(pipe, mode="sequential")
    try:
        prompts = [PROMPTS[3], "seven " * 300]  # the second is far past the tokenizer's length
        expected = pipe.encode_prompt(prompts, engine.device, 1, False)[0]  # logs the cut "seven seven ..."
        caplog.clear()
        with caplog.at_level("INFO"):
            ours = engine.embed(prompts)["encoder_hidden_states"]  # the SD family's condition
        assert torch.equal(ours, expected)
        assert "seven" not in caplog.text
    finally:
        engine.close()


def test_overlong_and_non_text_prompts_are_refused_naming_the_field(pipe):
    engine = make_engine(pipe, mode="sequential", max_prompt_chars=50)
    try:
        (field, message), = engine.check(["x" * 51], None, None, None, None, None, None)
        assert field == "prompt" and "51 characters" in message and "max_prompt_chars=50" in message
        (field, message), = engine.check(["\ud800 seven"], None, None, None, None, None, None)
        assert field == "prompt" and "surrogate" in message
        assert engine.check(["x" * 50], None, None, None, None, None, None) == []
    finally:
        engine.close()


def _poison(engine: Engine, marker: str = "poison"):
    """A text encoding that gives the marker prompt NaN embeddings, and a UNet that refuses NaN conditioning:
    a failure of the shared denoising call that one request causes."""
    embed = engine.embed

    def embedding(prompts, *args):
        out = embed(prompts, *args)
        out["encoder_hidden_states"][[i for i, p in enumerate(prompts) if p == marker]] = float("nan")
        return out

    def refuse(module, args, kwargs):
        if torch.isnan(kwargs["encoder_hidden_states"]).any():
            raise FloatingPointError("NaN conditioning")

    engine.embed = embedding
    return engine.pipe.unet.register_forward_pre_hook(refuse, with_kwargs=True)


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_one_bad_request_fails_alone_and_its_batch_mates_get_their_images(pipe, mode, caplog):
    """Seven requests share the denoiser's batch; one makes the shared UNet call fail. It gets the error, and the
    six others are denoised again without it and get the images they get alone."""
    engine = make_engine(pipe, mode=mode, max_batch_size=8, max_wait_ms=300.0)
    hook = _poison(engine)
    try:
        prompts = [PROMPTS[i] for i in range(3)] + ["poison"] + [PROMPTS[i] for i in range(3, 6)]
        futures = [engine.submit(engine.job([p], seed=i, steps=2)) for i, p in enumerate(prompts)]
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result(timeout=60))
            except FloatingPointError as err:
                outcomes.append(err)
    finally:
        hook.remove()
        engine.close(timeout=60)
    assert isinstance(outcomes[3], FloatingPointError)
    good = [o for i, o in enumerate(outcomes) if i != 3]
    assert all(not isinstance(o, Exception) for o in good)
    # they were batched with the culprit at first
    assert any("running each alone" in r.getMessage() and len(r.args[-1]) >= 2
               for r in caplog.records), caplog.text
    for i, outcome in enumerate(outcomes):
        if i != 3:
            assert_close(pixels(outcome.png[0]), reference(pipe, prompts[i], i, steps=2))


def test_a_stalled_stage_makes_the_engine_unhealthy_naming_it(pipe):
    engine = make_engine(pipe, mode="stream", stall_s=0.3)
    gate = threading.Event()
    step = engine._stream_step
    engine._stream_step = lambda jobs: (gate.wait(30), step(jobs))
    try:
        assert engine.health() == (True, None)
        future = engine.submit(engine.job([PROMPTS[1]], seed=1, steps=2))
        wait_for(lambda: not engine.health()[0], timeout=10)
        ok, reason = engine.health()
        assert "stage denoise" in reason and "stall_s=0.3" in reason
        gate.set()
        future.result(timeout=30)
        assert engine.health() == (True, None)
    finally:
        gate.set()
        engine.close(timeout=30)


def test_close_settles_what_the_drain_timeout_cuts_off_as_draining(pipe):
    from distill.serve.engine import Draining

    engine = make_engine(pipe, mode="stream")
    gate = threading.Event()
    step = engine._stream_step
    engine._stream_step = lambda jobs: (gate.wait(30), step(jobs))
    future = engine.submit(engine.job([PROMPTS[1]], seed=1, steps=2))
    start = time.monotonic()
    closer = threading.Thread(target=lambda: engine.close(drain=True, timeout=0.3))
    closer.start()
    with pytest.raises(Draining):
        future.result(timeout=10)
    assert time.monotonic() - start < 5
    gate.set()
    closer.join(timeout=30)


def reference_size(pipe, prompt, seed, steps, size) -> np.ndarray:
    image = pipe(prompt, num_inference_steps=steps, guidance_scale=GUIDANCE, height=size, width=size,
                 generator=torch.Generator().manual_seed(seed)).images[0]
    return np.asarray(image.convert("RGB"))


def test_requests_that_cannot_finish_by_their_deadline_are_refused_at_the_door(pipe):
    """With a measured service rate, a burst larger than what the engine can do by the deadline is answered
    QueueFull at once for the part that would expire, and (nearly) every admitted request finishes in time."""
    engine = make_engine(pipe, mode="stream", max_batch_size=4, max_wait_ms=0.0, queue_size=200)
    try:
        for i, n in enumerate((2, 4, 1, 4, 2, 4)):  # the cost line is fitted over the call sizes of the burst
            run(engine, [engine.job([PROMPTS[(i + k) % 10]], seed=i, steps=6) for k in range(n)])
        assert engine.call_seconds(1.0) is not None
        admitted, refused = [], 0
        for i in range(120):
            try:
                admitted.append(engine.submit(engine.job([PROMPTS[i % 10]], seed=i, steps=6, timeout_s=3.0)))
            except QueueFull as err:
                refused += 1
                assert err.retry_after >= 1 and "timeout_s=3" in str(err)
        expired = 0
        for future in admitted:
            try:
                future.result(timeout=60)
            except DeadlineExceeded:
                expired += 1
    finally:
        engine.close(timeout=60)
    assert refused > 0 and len(admitted) >= 4
    # the 5% target is measured on idle cores (BENCHMARKS.md, the overload run: 0 expired); here another pytest
    # worker shares the 2 cores, so the rate fitted before the burst can be slower during it (CI once: 1 over)
    assert expired <= 0.1 * len(admitted) + 2, (expired, len(admitted))


def test_progress_of_a_request_is_visible_in_every_mode(pipe):
    """Job.stage and Job.step follow the request: the denoiser's step count rises to the job's steps."""
    for mode in ("batch", "pipeline", "stream"):
        engine = make_engine(pipe, mode=mode, max_wait_ms=0.0)
        seen: set[tuple[str, int]] = set()
        try:
            job = engine.job([PROMPTS[2]], seed=2, steps=5)
            future = engine.submit(job)
            while not future.done():
                seen.add((job.stage, job.step))
                time.sleep(0.001)
            future.result()
        finally:
            engine.close(timeout=30)
        assert job.stage == "done" and job.step == 5
        steps = sorted(step for stage, step in seen if stage == "denoise")
        assert len(set(steps)) >= 3, (mode, seen)  # watched mid-way through the steps


def test_a_cancelled_batch_stops_its_pipeline_call_at_the_next_step(pipe):
    """In the modes that call the pipeline, a batch whose requests all gave up skips its remaining steps (the
    pipeline's interrupt flag), instead of denoising to the end for nobody."""
    engine = make_engine(pipe, mode="batch", max_wait_ms=0.0)
    calls = []
    hook = pipe.unet.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        job = engine.job([PROMPTS[1]], seed=1, steps=100)
        future = engine.submit(job)
        wait_for(lambda: job.step >= 3, timeout=30)
        future.cancel()
        wait_for(lambda: engine.inflight == 0 and engine._working.get("denoise") is None, timeout=30)
        time.sleep(0.2)
    finally:
        hook.remove()
        engine.close(timeout=30)
    assert len(calls) < 30, len(calls)  # 100 steps, cancelled after 3: it stopped within a few more


def test_the_admission_estimate_follows_each_requests_own_size(pipe):
    """After calls of several sizes, the expected time of a request alone is its measured time within 50%, for
    one image and for eight: a burst of large calls does not make a small request look slow, nor the reverse.
    The median of three runs of each, interleaved: one load spike of a shared machine (once an estimate of 0.36 s
    for a run of 0.21 s) does not decide it."""
    engine = make_engine(pipe, mode="batch", max_batch_size=8, max_wait_ms=0.0)
    ratios: dict[int, list[float]] = {1: [], 8: []}
    try:
        for n in (1, 8, 1, 8, 4):  # calls of 1, 8 and 4 images (2 UNet rows each: guidance)
            run(engine, [engine.job([PROMPTS[i] for i in range(n)], seed=n, steps=6)])
        for _ in range(3):
            for n in ratios:
                job = engine.job([PROMPTS[i] for i in range(n)], seed=3, steps=8)
                expected = engine.expected_seconds(job)
                start = time.monotonic()
                run(engine, [job])
                ratios[n].append(expected / (time.monotonic() - start))
    finally:
        engine.close(timeout=60)
    for n, measured in ratios.items():
        assert 0.5 < sorted(measured)[1] < 1.5, (n, measured)  # expected / took


def test_stream_refuses_a_short_request_that_would_wait_behind_a_full_active_set(pipe):
    """The denoiser is full of long requests: a one-step request cannot start before one of them finishes, so
    with a deadline shorter than that it is refused at the door (before: admitted, then 504)."""
    engine = make_engine(pipe, mode="stream", max_batch_size=4, max_wait_ms=0.0)
    try:
        for _ in range(2):
            run(engine, [engine.job([PROMPTS[i]], seed=i, steps=3) for i in range(4)])
        long = [engine.submit(engine.job([PROMPTS[i]], seed=i, steps=60)) for i in range(4)]
        wait_for(lambda: sum(j.stage == "denoise" for j in engine.jobs) == 4, timeout=30)
        short = engine.job([PROMPTS[5]], seed=5, steps=1, timeout_s=0.5)
        alone = engine.call_seconds(short.units)
        assert alone < 0.2  # on its own it would be done in time
        with pytest.raises(QueueFull, match="timeout_s=0.5"):
            engine.submit(short)
        for future in long:
            future.result(timeout=120)
    finally:
        engine.close(timeout=60)


@pytest.mark.parametrize("stage", ["encode", "decode"])
def test_a_batch_whose_stage_fails_is_run_again_request_by_request(pipe, stage, caplog):
    """Failure isolation in the encoder and the decoder too: one request that the stage cannot take fails alone;
    the three requests of its batch are run again without it and get their own images."""
    engine = make_engine(pipe, mode="pipeline", max_batch_size=8, max_wait_ms=300.0)
    work = getattr(engine, f"_{stage}")

    def fragile(jobs):
        if any(job.prompts == ["poison"] for job in jobs):
            raise FloatingPointError(f"cannot {stage}")
        work(jobs)

    setattr(engine, f"_{stage}", fragile)
    try:
        prompts = [PROMPTS[0], "poison", PROMPTS[1], PROMPTS[2]]
        futures = [engine.submit(engine.job([p], seed=i, steps=2)) for i, p in enumerate(prompts)]
        with pytest.raises(FloatingPointError):
            futures[1].result(timeout=60)
        for i in (0, 2, 3):
            assert_close(pixels(futures[i].result(timeout=60).png[0]), reference(pipe, prompts[i], i, steps=2))
    finally:
        engine.close(timeout=60)
    assert any(f"{stage} failed" in r.getMessage() and len(r.args[-1]) >= 2 for r in caplog.records), caplog.text


def test_a_lone_surrogate_batched_with_six_good_prompts_is_the_only_422(pipe):
    """Seven concurrent requests, the fourth holding a lone surrogate: it alone is refused (422 naming the prompt)
    and the six others, encoded together, get their images."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from distill.serve.app import create_app

    engine = make_engine(pipe, mode="stream", max_batch_size=8, max_wait_ms=100.0)
    prompts = [PROMPTS[i] for i in range(3)] + ["\ud800 seven"] + [PROMPTS[i] for i in range(3, 6)]
    bodies = [json.dumps({"prompt": p, "seed": i, "steps": 2}, ensure_ascii=True) for i, p in enumerate(prompts)]
    with TestClient(create_app(engine)) as client, ThreadPoolExecutor(7) as pool:
        answers = list(pool.map(lambda body: client.post("/generate", content=body,
                                                         headers={"content-type": "application/json"}), bodies))
    codes = [a.status_code for a in answers]
    assert codes == [200, 200, 200, 422, 200, 200, 200], codes
    assert answers[3].json()["detail"][0]["loc"][-1] == "prompt"


def test_stream_encodes_and_admits_in_arrival_order_whatever_the_size(pipe):
    """Stream mode is first come, first served from the request queue on: a request of another size is encoded
    and admitted to the denoiser in its arrival order (before: the encoder took the oldest request and every
    younger one of its size, so requests of the common size overtook it at every batch)."""
    engine = make_engine(pipe, mode="stream", max_batch_size=8, max_wait_ms=0.0)
    gate, admitted = threading.Event(), []
    encode, prepare = engine._encode, engine._prepare
    engine._encode = lambda jobs: (gate.wait(30), encode(jobs))
    engine._prepare = lambda job: (admitted.append(job.id), prepare(job))
    try:
        first = engine.job([PROMPTS[0]], seed=0, steps=2)
        futures = [engine.submit(first)]
        wait_for(lambda: first.stage == "encode", timeout=30)  # the encoder holds it; the rest queue up
        jobs = [engine.job([PROMPTS[1]], seed=1, steps=2), engine.job([PROMPTS[2]], seed=2, steps=2, height=64,
                                                                      width=64),
                engine.job([PROMPTS[3]], seed=3, steps=2), engine.job([PROMPTS[4]], seed=4, steps=2)]
        futures += [engine.submit(job) for job in jobs]
        gate.set()
        for future in futures:
            future.result(timeout=60)
    finally:
        gate.set()
        engine.close(timeout=60)
    assert admitted == [job.id for job in [first, *jobs]], admitted


def test_stream_admits_another_size_within_its_stated_bound_under_16_clients(pipe, caplog):
    """Sixteen clients loop on native-size requests of S steps; a request of four times the area arrives. The
    stated bound (docs/serving.md, first come, first served): it starts once the (at most 16) requests ahead of it
    have left room, i.e. after at most ceil(17 / max_batch_size) trajectories of S denoiser calls; one more
    trajectory of slack for a slot left empty while the encoder catches up. Counted in denoiser calls, not
    seconds, so a busy machine cannot fail it, and the load still runs when it is admitted (before issue 31 it
    waited for the load to stop, past its deadline)."""
    steps, batch, clients = 4, 4, 16
    engine = make_engine(pipe, mode="stream", max_batch_size=batch, max_wait_ms=0.0, queue_size=64)
    calls, started = [0], []
    step = engine._stream_step
    big = engine.job([PROMPTS[9]], seed=9, steps=2, height=64, width=64)

    def counting(jobs):
        calls[0] += 1
        if big in jobs and not started:
            started.append(calls[0])
        step(jobs)

    engine._stream_step = counting
    stop = threading.Event()

    def client(i):
        while not stop.is_set():
            engine.submit(engine.job([PROMPTS[i % 10]], seed=i, steps=steps)).result(timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: engine.inflight >= clients - 2 and calls[0] >= 2 * steps, timeout=60)
        at = calls[0]
        future = engine.submit(big)
        result = future.result(timeout=60)
        load_running = not stop.is_set() and engine.inflight >= 8
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        engine.close(timeout=60)
    bound = (-(-(clients + 1) // batch) + 1) * steps  # each client holds at most one request ahead of it
    assert load_running
    assert started and started[0] - at <= bound, (started, at, bound)
    assert "running each alone" not in caplog.text  # sizes were never mixed in one decoder batch
    assert_close(pixels(result.png[0]), reference_size(pipe, PROMPTS[9], 9, 2, 64))


def test_a_stream_scheduler_step_that_raises_fails_only_its_job(pipe):
    """In stream mode one job's scheduler step raises mid-trajectory: that job alone fails, and the three jobs
    stepped in the same denoiser calls go on and get the images they get alone (fails if the error fails the
    whole call's jobs)."""
    engine = make_engine(pipe, mode="stream", max_batch_size=8, max_wait_ms=300.0)
    prepare = engine._prepare

    def fragile(job):
        prepare(job)
        if job.prompts == ["poison"]:
            own = job.sched.step

            def step(*args, **kwargs):
                if job.index == 2:
                    raise FloatingPointError("scheduler step failed")
                return own(*args, **kwargs)

            job.sched.step = step

    engine._prepare = fragile
    try:
        prompts = [PROMPTS[0], "poison", PROMPTS[1], PROMPTS[2]]
        futures = [engine.submit(engine.job([p], seed=i, steps=4)) for i, p in enumerate(prompts)]
        with pytest.raises(FloatingPointError):
            futures[1].result(timeout=60)
        results = {i: futures[i].result(timeout=60) for i in (0, 2, 3)}
    finally:
        engine.close(timeout=60)
    assert max(r.batch_sizes["denoise"] for r in results.values()) == 4  # they shared calls with the culprit
    for i, result in results.items():
        assert_close(pixels(result.png[0]), reference(pipe, prompts[i], i, steps=4))
