"""Python clients of ``distill.serve``: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio), on httpx.

    from distill.serve import Client
    with Client("http://127.0.0.1:8000") as client:
        out = client.generate("a red circle", seed=0)
        out.images[0].save("circle.png")
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field

import httpx


class ServeError(RuntimeError):
    """A non-200 answer: ``status`` (401 missing or wrong API key, 413 body too large, 422 bad value, 429 queue
    full, 503 shutting down, 504 past the deadline),
    ``detail`` (the server's message, per field for 422) and ``retry_after`` (seconds, on 429)."""

    def __init__(self, status: int, detail, retry_after: float | None = None):
        super().__init__(f"{status}: {detail}")
        self.status, self.detail, self.retry_after = status, detail, retry_after


@dataclass
class Generation:
    """A 200 answer: the images (PIL), their PNG bytes, and the server's account of the request."""

    png: list[bytes]
    info: dict = field(default_factory=dict)

    @property
    def images(self):
        from PIL import Image

        return [Image.open(io.BytesIO(b)) for b in self.png]

    @property
    def seeds(self) -> list[int]:
        return self.info.get("seeds", [])

    @property
    def latency_s(self) -> float:
        return self.info.get("latency_s", float("nan"))


def _auth(api_key: str | None) -> dict:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def _payload(prompt, **options) -> dict:
    return {"prompt": prompt, **{k: v for k, v in options.items() if v is not None}}


def _parse(response: httpx.Response) -> Generation:
    if response.status_code != 200:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text
        retry = response.headers.get("Retry-After")
        raise ServeError(response.status_code, detail, float(retry) if retry else None)
    if response.headers.get("content-type", "").startswith("image/png"):
        return Generation([response.content], {"seeds": [int(response.headers["X-Seed"])],
                                               "latency_s": float(response.headers["X-Latency-S"])})
    data = response.json()
    return Generation([base64.b64decode(b) for b in data.pop("images")], data)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{label="v"}': value} (samples of every metric family)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


class Client:
    """Blocking client: ``generate(prompt, steps=, guidance_scale=, seed=, height=, width=, scheduler=,
    timeout_s=)`` returns a :class:`Generation` or raises :class:`ServeError`; ``api_key``: the service's
    ``api_key``, sent as ``Authorization: Bearer <api_key>``."""

    def __init__(self, url: str = "http://127.0.0.1:8000", timeout: float = 600.0, api_key: str | None = None):
        self.http = httpx.Client(base_url=url, timeout=timeout, headers=_auth(api_key))

    def generate(self, prompt: str | list[str], **options) -> Generation:
        return _parse(self.http.post("/generate", json=_payload(prompt, **options)))

    def health(self) -> dict:
        return self.http.get("/health").json()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.http.get("/metrics").text)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio client (the load test's): the same methods, awaited."""

    def __init__(self, url: str = "http://127.0.0.1:8000", timeout: float = 600.0, max_connections: int = 256,
                 api_key: str | None = None):
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, headers=_auth(api_key))

    async def generate(self, prompt: str | list[str], **options) -> Generation:
        return _parse(await self.http.post("/generate", json=_payload(prompt, **options)))

    async def health(self) -> dict:
        return (await self.http.get("/health")).json()

    async def metrics(self) -> dict[str, float]:
        return parse_metrics((await self.http.get("/metrics")).text)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
