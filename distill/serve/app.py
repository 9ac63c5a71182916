"""The HTTP service: FastAPI on uvicorn around a :class:`distill.serve.engine.Engine`.

    python -m distill.serve pipeline=<dir or hub id> [scheduler=dpmsolver steps=20 accelerate=deepcache]
    python -m distill.serve pipeline=<export> engine.mode=stream engine.max_batch_size=16 port=8000

Endpoints: ``POST /generate`` (JSON: prompt or prompts, steps, guidance_scale, seed, height, width, scheduler,
format ``base64`` (JSON with base64 PNGs) or ``png`` (the image itself), timeout_s), ``POST /jobs``,
``GET``/``DELETE /jobs/{id}`` (the same request, watched step by step and cancellable: distill.serve.jobs),
``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /docs`` (Swagger UI, served offline) and
``/openapi.json`` (OpenAPI), ``GET /`` (a playground page on the job routes). A full queue answers 429 with Retry-After, a request past its deadline 504, a bad value 422 naming the
field, a body over ``max_body_bytes`` (default 1 MiB) 413 before it is read in full; SIGTERM stops accepting at
once, finishes the requests in flight within ``drain_timeout_s``, answers what is left then 503 with Retry-After,
and exits 0.

Access control (top-level keys, like ``host=``): ``api_key=<token>`` makes every route but ``GET /health``, the
playground ``/`` and ``/docs`` need ``Authorization: Bearer <token>`` (401 otherwise; compared in constant
time); give it as the environment variable ``DISTILL_SERVE_API_KEY`` to keep it off the command line and out of
``ps``. ``allowed_hosts=[name,...]``: the Host header names served, any port (400 otherwise); by default, on a
loopback ``host=``, localhost, 127.0.0.1 and [::1] (a web page whose name an attacker points at 127.0.0.1, DNS
rebinding, is refused). ``cors_origins=[origin,...]``: origins whose pages may call the service (default none:
no CORS headers). A non-loopback ``host=`` without ``api_key`` exits 2 unless ``insecure=true``.

FastAPI + uvicorn rather than LitServe: LitServe batches requests into one ``predict`` call, but distill needs
its own scheduling between stages (three stage threads with bounded queues, and a denoiser that batches
steps of different requests), which sits below any serving framework's batching; FastAPI gives the request
validation (422 naming the field), the OpenAPI page and async handlers that wait on the engine's futures, and
uvicorn the graceful shutdown on SIGTERM.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import math
import secrets
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from distill.config.schema import ServeConfig
from distill.serve.engine import Draining, Engine, Job, QueueFull
from distill.serve.jobs import add_docs, add_job_routes, failure, result_json
from distill.serve.metrics import ServeMetrics

PLAYGROUND = Path(__file__).with_name("playground.html")
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
# served without the key, to anyone: they hold no data (the playground asks for the key; /docs is the API's schema)
OPEN_PATHS = ("/", "/health", "/docs", "/openapi.json")


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


def _retrieve(waiting: asyncio.Future) -> None:
    """Mark a handler's future read: one that gave up (deadline, hang-up) never reads the error the engine sets
    later, which asyncio would report as "Future exception was never retrieved"."""
    if not waiting.cancelled():
        waiting.exception()


class Guard:
    """Pure-ASGI checks of every HTTP request before the app sees it, answered in JSON and counted: its Host
    header (400 unless in ``allowed_hosts``, any port: DNS rebinding; ``None``: any host), its key (401 with
    ``WWW-Authenticate: Bearer`` unless ``Authorization: Bearer <api_key>``, except GET of :data:`OPEN_PATHS` and
    /docs' assets; ``None``: no key), and its body size (413 past ``max_body_bytes``: a larger Content-Length at
    once, a body without one, e.g. chunked, as it streams in; nothing past the limit is read)."""

    def __init__(self, app, *, max_body_bytes: int, api_key: str | None, allowed_hosts: list[str] | None,
                 answer):
        self.app, self.max_body_bytes, self.answer = app, max_body_bytes, answer
        self.key = None if api_key is None else api_key.encode()
        self.hosts = None if allowed_hosts is None else {host.lower() for host in allowed_hosts}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1"): value for name, value in scope["headers"]}
        refusal = self.refuse(scope, headers)
        if refusal is None:
            body, refusal = await self.read(receive, headers.get("content-length"))
        if refusal is not None:
            return await self.answer(refusal)(scope, receive, send)
        if body is None:  # the client left while sending
            return None
        replayed = False

        async def replay() -> dict:  # the body read here, then the client's own messages (its hang-up)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def refuse(self, scope, headers: dict[str, bytes]) -> Response | None:
        """The 400 or 401 answer of a request from a foreign host or without the key, else None."""
        if self.hosts is not None:
            host = headers.get("host", b"").decode("latin-1").lower()
            name = host[:host.index("]") + 1] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
            if name not in self.hosts:
                return JSONResponse(status_code=400, content={"detail": (
                    f"Host {host!r} is not served here (allowed_hosts={sorted(self.hosts)}, any port): "
                    "add the name the clients use to allowed_hosts=")})
        path = scope["path"]
        open_path = scope["method"] in ("GET", "HEAD") and (path in OPEN_PATHS or path.startswith("/docs/"))
        if self.key is None or open_path or scope["method"] == "OPTIONS":  # OPTIONS: a CORS preflight has no key
            return None
        scheme, _, token = headers.get("authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):  # constant time
            return None
        return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"}, content={
            "detail": "a missing or wrong API key: send the header Authorization: Bearer <api_key>"})

    async def read(self, receive, length: bytes | None) -> tuple[bytes | None, Response | None]:
        """The whole body, or the 413 answer as soon as it is known to pass the limit."""
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return None, self.too_large(f"Content-Length: {int(length)}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, self.too_large(f"more than {self.max_body_bytes} bytes sent")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def too_large(self, what: str) -> JSONResponse:
        return JSONResponse(status_code=413, content={"detail": (
            f"the request body is too large ({what}): at most max_body_bytes={self.max_body_bytes} bytes "
            "(a serve key: max_body_bytes=<bytes>)")})


def model_name(model: str) -> str:
    """The served model as clients see it: a local folder by its name (where it lies on the server's disk is no
    client's business), a hub id as it is."""
    path = Path(model)
    return path.name if path.is_absolute() or path.is_dir() else model


def create_app(engine: Engine, model: str = "", drain_timeout_s: float = ServeConfig.drain_timeout_s, *,
               max_body_bytes: int = ServeConfig.max_body_bytes, api_key: str | None = None,
               allowed_hosts: list[str] | None = None, cors_origins: list[str] = ()) -> FastAPI:
    """The FastAPI app serving ``engine`` (the keyword arguments: :class:`Guard`'s, and the origins a browser may
    call from, none by default); ``app.state.drain()`` (on SIGTERM) or closing the app (lifespan end) drains the
    engine: it stops taking requests at once and finishes those held within ``drain_timeout_s``; the ones still
    held then are answered 503 with Retry-After."""
    model = model_name(model)  # all that /health, the playground and /docs show of it
    metrics: ServeMetrics = engine.metrics or ServeMetrics()
    engine.metrics = metrics
    closing: list[threading.Thread] = []

    def drain() -> None:
        if not closing:
            engine.begin_drain()
            closing.append(threading.Thread(target=engine.close, args=(True, drain_timeout_s), name="drain",
                                            daemon=True))
            closing[0].start()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        drain()
        await asyncio.to_thread(closing[0].join)

    app = FastAPI(title="distill.serve", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,  # add_docs
                  description=f"Text-to-image generation with {model or 'a diffusion pipeline'} "
                              f"({engine.mode} mode)")
    app.state.drain = drain

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
            return answer(failure(job, err))
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
        waiting.add_done_callback(_retrieve)
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
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as err:  # noqa: BLE001 - failure(): 504 past the deadline, 503 draining, 500 a failed batch
            future.cancel()  # a no-op unless the engine still holds it (past its deadline): then it drops it
            return answer(failure(job, err))
        finally:
            metrics.inflight.dec()
        metrics.request_seconds.observe(result.latency_s)
        if body.format == "png":
            return answer(Response(result.png[0], media_type="image/png", headers={
                "X-Seed": str(result.seeds[0]), "X-Latency-S": f"{result.latency_s:.4f}"}))
        return answer(JSONResponse(result_json(job, result, job.scheduler or defaults()["scheduler"])))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: the probe of many load balancers
    async def health() -> JSONResponse:
        """Status (``ok``; with 503 ``draining`` during shutdown, or ``unhealthy`` when a stage stopped or stalled,
        named in ``reason``), mode, queue and the request defaults."""
        ok, reason = engine.health()
        status = "draining" if not engine.accepting else "ok" if ok else "unhealthy"
        body = {"status": status, "reason": reason, "model": model, "mode": engine.mode,
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

    add_job_routes(app, engine, admit, answer, defaults()["scheduler"], GenerateRequest)
    add_docs(app)
    # added last, so outermost: CORS headers on every answer (a 401 too) and preflights answered before the key
    app.add_middleware(Guard, max_body_bytes=max_body_bytes, api_key=api_key, allowed_hosts=allowed_hosts,
                       answer=answer)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["authorization", "content-type"],
                           expose_headers=["retry-after", "x-seed", "x-latency-s"])
    return app
