"""The HTTP service: FastAPI on uvicorn around a :class:`distill.serve.engine.Engine`.

    python -m distill.serve pipeline=<dir or hub id> [scheduler=dpmsolver steps=20 accelerate=deepcache]
    python -m distill.serve pipeline=<export> engine.mode=stream engine.max_batch_size=16 port=8000

Endpoints: ``POST /generate`` (JSON: prompt or prompts, steps, guidance_scale, seed, height, width, scheduler,
format ``base64`` (JSON with base64 PNGs) or ``png`` (the image itself), timeout_s), ``GET /health``,
``GET /metrics`` (Prometheus text), ``GET /docs`` and ``/openapi.json`` (OpenAPI), ``GET /`` (a playground
page). A full queue answers 429 with Retry-After, a request past its deadline 504, a bad value 422 naming the
field; SIGTERM stops accepting, finishes the requests in flight, then exits.

FastAPI + uvicorn rather than LitServe: LitServe batches requests into one ``predict`` call, but distill needs
its own scheduling between stages (three stage threads with bounded queues, and a denoiser that batches
steps of different requests), which sits below any serving framework's batching; FastAPI gives the request
validation (422 naming the field), the OpenAPI page and async handlers that wait on the engine's futures, and
uvicorn the graceful shutdown on SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import html
import math
import secrets
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from distill.serve.engine import DeadlineExceeded, Draining, Engine, Job, QueueFull
from distill.serve.jobs import add_docs, add_job_routes
from distill.serve.metrics import ServeMetrics

PLAYGROUND = Path(__file__).with_name("playground.html")
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class GenerateRequest(BaseModel):
    """A generation request; what it leaves out takes the served model's defaults (``GET /health``)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[str] = Field(description="a prompt, or a list of prompts (one image each)")
    steps: int | None = Field(None, strict=True, description="denoising steps")
    guidance_scale: float | None = Field(None, description="classifier-free guidance scale (or the guidance "
                                                           "input of a student that takes one)")
    seed: int | None = Field(None, ge=0, lt=2**63, strict=True,
                             description="image i uses seed + i; default: random (returned)")
    height: int | None = Field(None, strict=True, description="a multiple of the VAE factor")
    width: int | None = Field(None, strict=True, description="a multiple of the VAE factor")
    scheduler: str | None = Field(None, description="a scheduler name (ddim, dpmsolver, euler, lcm, ...)")
    format: Literal["base64", "png"] = Field("base64", description="base64: JSON with base64 PNGs; png: the "
                                                                   "image (one prompt)")
    timeout_s: float | None = Field(None, allow_inf_nan=False,
                                    description="deadline in seconds from arrival (504 past it); at most the server's")


def _invalid(errors: list[tuple[str, str]]) -> JSONResponse:
    """422 in FastAPI's validation-error shape: one entry per field."""
    return JSONResponse(status_code=422, content={"detail": [
        {"loc": ["body", name], "msg": message, "type": "value_error"} for name, message in errors]})


def _draining(err: Draining) -> JSONResponse:
    """503 while the service shuts down: another replica (or this one, restarted) can take the request."""
    return JSONResponse(status_code=503, content={"detail": str(err)}, headers={"Retry-After": "5"})


def create_app(engine: Engine, model: str = "", drain_timeout_s: float = 60.0) -> FastAPI:
    """The FastAPI app serving ``engine``; closing the app (lifespan end) drains the engine."""
    metrics: ServeMetrics = engine.metrics or ServeMetrics()
    engine.metrics = metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.close, True, drain_timeout_s)

    app = FastAPI(title="distill.serve", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,  # add_docs
                  description=f"Text-to-image generation with {model or 'a diffusion pipeline'} "
                              f"({engine.mode} mode)")

    def answer(response: Response) -> Response:
        metrics.requests.labels(str(response.status_code)).inc()
        return response

    def defaults() -> dict:
        return {"steps": engine.default_steps, "guidance_scale": engine.default_guidance,
                "scheduler": engine.default_scheduler or engine.own_name or type(engine.pipe.scheduler).__name__,
                "height": engine.native, "width": engine.native, "max_steps": engine.max_steps,
                "max_batch_size": engine.max_batch_size, "vae_factor": engine.factor, "timeout_s": engine.timeout_s}

    def admit(body: GenerateRequest) -> Job | Response:
        """The request's job, queued in the engine, or the answer refusing it (422 naming the field, 429 with
        Retry-After when full, 503 while draining); shared by ``/generate`` and the job routes."""
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        errors = engine.check(prompts, body.steps, body.guidance_scale, body.height, body.width, body.scheduler,
                              body.timeout_s)
        if body.format == "png" and len(prompts) > 1:
            errors.append(("format", f"format=png answers one image; {len(prompts)} prompts need format=base64"))
        if errors:
            return answer(_invalid(errors))
        seed = secrets.randbits(31) if body.seed is None else body.seed
        job = engine.job(prompts, seed, body.steps, body.guidance_scale, body.height, body.width, body.scheduler,
                         body.timeout_s)
        try:
            engine.submit(job)
        except QueueFull as err:
            return answer(JSONResponse(status_code=429, content={"detail": str(err)},
                                       headers={"Retry-After": str(math.ceil(err.retry_after))}))
        except Draining as err:
            return answer(_draining(err))
        return job

    @app.post("/generate", responses={200: {"content": {"image/png": {}}}, 429: {"description": "queue full"},
                                      503: {"description": "shutting down"}, 504: {"description": "past deadline"}})
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """Generate one image per prompt."""
        job = admit(body)
        if isinstance(job, Response):
            return job
        future = job.future
        metrics.inflight.inc()
        waiting = asyncio.wrap_future(future)
        try:
            while True:  # the answer, the deadline, or the client hanging up: whichever comes first
                left = job.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait({waiting}, timeout=min(left, DISCONNECT_POLL_S))
                if done:
                    result = waiting.result()
                    break
                if await request.is_disconnected():  # nobody will read the images: stop making them
                    future.cancel()
                    return answer(Response(status_code=499))
        except (TimeoutError, DeadlineExceeded):
            future.cancel()
            return answer(JSONResponse(status_code=504, content={
                "detail": f"request {job.id} did not finish within timeout_s={job.timeout_s}; it was cancelled"}))
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Draining as err:
            return answer(_draining(err))
        except Exception as err:  # noqa: BLE001 - the batch failed; the service goes on
            return answer(JSONResponse(status_code=500, content={"detail": f"{type(err).__name__}: {err}"}))
        finally:
            metrics.inflight.dec()
        metrics.request_seconds.observe(result.latency_s)
        info = {"id": job.id, "seeds": result.seeds, "latency_s": result.latency_s, "stages": result.timings,
                "batch_sizes": result.batch_sizes, "steps": job.steps, "guidance_scale": job.guidance_scale,
                "scheduler": job.scheduler or defaults()["scheduler"], "height": job.height, "width": job.width}
        if body.format == "png":
            return answer(Response(result.png[0], media_type="image/png", headers={
                "X-Seed": str(result.seeds[0]), "X-Latency-S": f"{result.latency_s:.4f}"}))
        return answer(JSONResponse({**info, "images": [base64.b64encode(b).decode() for b in result.png]}))

    @app.get("/health")
    async def health() -> JSONResponse:
        """Status (``ok``, or ``draining`` with 503 during shutdown), mode, queue and the request defaults."""
        status = "draining" if not engine.accepting else "ok" if engine.healthy() else "stage stopped"
        body = {"status": status, "model": model, "mode": engine.mode,
                "queue_depth": len(engine.queue), "in_flight": engine.inflight, "defaults": defaults()}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition: queue depth, batch sizes, stage latencies, images/s, answers by status."""
        metrics.queue_depth.set(len(engine.queue))
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        from distill.inference.schedulers import SCHEDULERS

        page = PLAYGROUND.read_text()
        for key, value in {**defaults(), "model": model, "schedulers": " ".join(sorted(SCHEDULERS))}.items():
            page = page.replace("{{" + key + "}}", html.escape(str(value)))
        return HTMLResponse(page)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        # FastAPI's 422 shape without echoing the input (which may hold a NaN that JSON cannot carry), counted
        return answer(JSONResponse(status_code=422, content={"detail": [
            {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in err.errors()]}))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        return answer(JSONResponse(status_code=500, content={"detail": f"{type(err).__name__}: {err}"}))

    add_job_routes(app, engine, admit, answer, defaults()["scheduler"])
    add_docs(app)
    return app
