"""Job-id routes of ``distill.serve`` (a request one can watch and cancel) and the offline ``/docs`` page.

    POST /jobs          the body of POST /generate; 202 {"id", "status_url"}, or /generate's 422/429/503
    GET /jobs/{id}      status (queued, running, done, failed, cancelled), stage, step of steps, elapsed_s; when
                        done, "result": /generate's base64 JSON; when failed, /generate's status and detail
    DELETE /jobs/{id}   cancel: the engine drops the job at its next denoising step or stage boundary

Polling rather than server-sent events: a poll is one short request that any client, proxy and the access
control treat like every other, and the progress it reads (:attr:`Job.step`) changes once per UNet call, which the
playground's poll every 100 ms follows closely. Ids are ``secrets.token_urlsafe`` strings, because an id is
all that guards a job's images: whoever has it may read or cancel them. The store keeps every unfinished job
(the engine's ``queue_size`` bounds them) and the :data:`MAX_FINISHED` latest finished ones, within
:data:`MAX_FINISHED_BYTES` of PNGs, for :data:`FINISHED_TTL_S` seconds; the oldest finished go first, so a client that
submits many jobs can push another's answer out before it is fetched (the id then answers 404). :func:`result_json` and :func:`failure` are /generate's answers too, so
that the two routes cannot drift apart.
"""

import base64
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from distill.serve.engine import DeadlineExceeded, Draining, Engine, Job, Result

FINISHED_TTL_S = 600.0  # how long a finished job's answer waits for its owner to fetch it
MAX_FINISHED = 64  # finished jobs kept at most (each holds its PNGs); the oldest are forgotten first
MAX_FINISHED_BYTES = 256 * 2**20  # and at most this many bytes of their PNGs (8 large images each on an SD model)
DOCS_ASSETS = "/docs/assets"


def result_json(job: Job, result: Result, scheduler: str) -> dict:
    """/generate's base64 JSON answer for a finished job; ``scheduler``: the name of the one it ran."""
    return {"id": job.id, "seeds": result.seeds, "latency_s": result.latency_s, "stages": result.timings,
            "batch_sizes": result.batch_sizes, "steps": job.steps, "guidance_scale": job.guidance_scale,
            "scheduler": scheduler, "height": job.height, "width": job.width,
            "images": [base64.b64encode(png).decode() for png in result.png]}


def failure(job: Job, err: BaseException, **fields) -> JSONResponse:
    """/generate's answer for a job that failed with ``err`` (504 past its deadline, 503 with Retry-After while
    draining, else 500), its "detail" beside ``fields``."""
    if isinstance(err, TimeoutError | DeadlineExceeded):
        return JSONResponse(status_code=504, content={**fields, "detail": (
            f"request {job.id} did not finish within timeout_s={job.timeout_s}; it was cancelled")})
    if isinstance(err, Draining):  # another replica (or this one, restarted) can take the request
        return JSONResponse(status_code=503, content={**fields, "detail": str(err)}, headers={"Retry-After": "5"})
    return JSONResponse(status_code=500, content={**fields, "detail": f"{type(err).__name__}: {err}"})


@dataclass(eq=False)
class Entry:
    """A job of the store: ``finished`` (monotonic seconds) and ``step`` (the steps it had done) once its future is
    settled; ``expired`` when the store cancelled it at its deadline (a 504, not the owner's cancel)."""

    job: Job
    finished: float | None = None
    step: int = 0
    expired: bool = False

    def status(self) -> str:
        future = self.job.future
        if not future.done():
            return "queued" if self.job.stage == "queued" else "running"
        if future.cancelled():
            return "failed" if self.expired else "cancelled"
        return "failed" if future.exception() is not None else "done"


class JobStore:
    """The jobs of ``POST /jobs`` by id, in submission order (so that the oldest finished go first)."""

    def __init__(self, ttl_s: float = FINISHED_TTL_S, max_finished: int = MAX_FINISHED,
                 max_bytes: int = MAX_FINISHED_BYTES):
        self.ttl_s, self.max_finished, self.max_bytes = ttl_s, max_finished, max_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()

    def add(self, job: Job) -> str:
        self.prune()
        key = secrets.token_urlsafe(16)
        entry = self.entries[key] = Entry(job)

        def finished(_):  # on the engine's thread (or the loop's, for a cancel); read by the event loop
            # a cancelled job's batch may go on stepping (a pipeline call runs to its end): its count stops here
            entry.step = job.step
            entry.finished = time.monotonic()

        job.future.add_done_callback(finished)
        return key

    def get(self, key: str) -> Entry | None:
        self.prune()
        return self.entries.get(key)

    def prune(self) -> None:
        """Cancel what is past its deadline (the engine would drop it at its next boundary; a job stuck in a
        stage is answered 504 all the same) and forget the finished jobs past the time or count limit."""
        now = time.monotonic()
        for entry in self.entries.values():
            if entry.finished is None and now > entry.job.deadline and entry.job.future.cancel():
                entry.expired = True
        finished = [key for key, entry in self.entries.items() if entry.finished is not None]
        held = sum(self.bytes(self.entries[key]) for key in finished)
        for i, key in enumerate(finished):
            entry = self.entries[key]
            if (len(finished) - i > self.max_finished or held > self.max_bytes
                    or now - entry.finished > self.ttl_s):
                held -= self.bytes(entry)
                del self.entries[key]

    @staticmethod
    def bytes(entry: Entry) -> int:
        """The PNG bytes a finished entry holds."""
        future = entry.job.future
        if future.cancelled() or future.exception() is not None:
            return 0
        return sum(len(png) for png in getattr(future.result(), "png", []))


def add_job_routes(app: FastAPI, engine: Engine, admit: Callable, answer: Callable[[Response], Response],
                   scheduler: str, request_model: type) -> JobStore:
    """Register the job-id routes on ``app``. ``admit(body)``: /generate's checks and submission (the submitted
    :class:`Job`, or the 422/429/503 answer, counted); ``answer(response)``: counts a response in /metrics and
    returns it; ``scheduler``: the name a job with ``scheduler=None`` ran (the served default); ``request_model``:
    /generate's body class (``app.GenerateRequest``), passed in because app imports this module."""
    store = JobStore()

    def progress(key: str, entry: Entry) -> dict:
        job, end = entry.job, entry.finished
        step = job.step if end is None else entry.step
        return {"id": key, "status": entry.status(), "stage": job.stage, "step": step, "steps": job.steps,
                "elapsed_s": round((end or time.monotonic()) - job.submitted, 3)}

    def settled(future) -> None:
        engine.metrics.inflight.dec()
        if not future.cancelled() and future.exception() is None:
            engine.metrics.request_seconds.observe(future.result().latency_s)

    def unknown(key: str) -> Response:
        return answer(JSONResponse(status_code=404, content={
            "detail": f"no job {key!r}: unknown, or finished more than {store.ttl_s:g} s ago (or beyond the "
                      f"{store.max_finished} latest) and forgotten"}))

    @app.post("/jobs", status_code=202, responses={
        202: {"description": "accepted: poll status_url"}, 429: {"description": "queue full"},
        503: {"description": "shutting down"}})
    async def submit_job(body: request_model, request: Request) -> Response:  # the class itself: FastAPI reads it
        """Start a generation (the body of ``POST /generate``) and answer its id at once."""
        if body.format != "base64":
            return answer(JSONResponse(status_code=422, content={"detail": [
                {"loc": ["body", "format"], "type": "value_error",
                 "msg": f"format={body.format} is not served by /jobs: a job's result is base64 JSON"}]}))
        admitted = admit(body)
        if not isinstance(admitted, Job):
            return admitted
        key = store.add(admitted)
        engine.metrics.inflight.inc()  # a job is in flight, as a waiting /generate is, until it settles
        admitted.future.add_done_callback(settled)
        url = str(request.url_for("job_status", id=key).path)
        return answer(JSONResponse(status_code=202, content={"id": key, "status_url": url},
                                   headers={"Location": url}))

    @app.get("/jobs/{id}", name="job_status", responses={404: {"description": "unknown or forgotten id"}})
    async def job_status(id: str) -> Response:
        """A job's progress; its result once done, or /generate's error status and detail once failed."""
        entry = store.get(id)
        if entry is None:
            return unknown(id)
        state = progress(id, entry)
        future = entry.job.future
        if state["status"] == "done":
            state["result"] = result_json(entry.job, future.result(), entry.job.scheduler or scheduler)
        elif state["status"] == "failed":
            return answer(failure(entry.job, DeadlineExceeded() if entry.expired else future.exception(), **state))
        return answer(JSONResponse(state))

    @app.delete("/jobs/{id}", responses={404: {"description": "unknown or forgotten id"}})
    async def cancel_job(id: str) -> Response:
        """Cancel a job (a finished one stays as it is); its state after the call."""
        entry = store.get(id)
        if entry is None:
            return unknown(id)
        entry.job.future.cancel()  # False when it already finished: nothing to stop
        return answer(JSONResponse(progress(id, entry)))

    return store


def add_docs(app: FastAPI) -> None:
    """``GET /docs``: Swagger UI from the assets of the package fastapi-offline, served here, so that the page
    works without a network (FastAPI's own /docs loads them from a CDN). Needs ``FastAPI(docs_url=None)``."""
    import fastapi_offline

    assets = Path(fastapi_offline.__file__).with_name("static")
    app.mount(DOCS_ASSETS, StaticFiles(directory=assets), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png")
