"""``python -m distill.serve`` / ``distill-serve``: serve any exported pipeline over HTTP (see distill.serve.app).

    python -m distill.serve pipeline=<dir or hub id>
    python -m distill.serve pipeline=<export> engine.mode=stream engine.max_batch_size=16 port=8000
    python -m distill.serve pipeline=<teacher> scheduler=dpmsolver steps=20 accelerate=forecast engine.mode=pipeline

    DISTILL_SERVE_API_KEY=<token> python -m distill.serve pipeline=<export> host=0.0.0.0 allowed_hosts=[gpu7.lan]

Request defaults: the command line's ``scheduler``/``steps``/``guidance_scale``, else the export's intended call
(its distill.json), else the pipeline's own call defaults. Bad settings exit 2 before the model is loaded, among
them a non-loopback ``host=`` without ``api_key`` (or the environment variable ``DISTILL_SERVE_API_KEY``, which
keeps the key off the command line) unless ``insecure=true``. ``max_body_bytes``, ``api_key``,
``allowed_hosts``, ``cors_origins``: see distill.serve.app.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Callable

import hydra
from omegaconf import DictConfig, OmegaConf

from distill.config.resolvers import register_resolvers
from distill.config.schema import register_configs
from distill.inference.loading import call_defaults

log = logging.getLogger(__name__)

register_configs()
register_resolvers()

DTYPES = ("float32", "float16", "bfloat16")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
# uvicorn's own shutdown deadline beyond drain_timeout_s: time for the handlers of what the drain cut off to answer
# 503, before uvicorn would cancel them (plain-text 500s and CancelledError tracebacks)
SHUTDOWN_GRACE_S = 5.0


def loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine alone."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(cfg: DictConfig) -> list[str] | None:
    """The Host names served: ``allowed_hosts`` if given, else on a loopback bind its names (a web page whose own
    name resolves to 127.0.0.1 cannot reach the service: DNS rebinding), else any (None)."""
    if cfg.allowed_hosts is not None:
        return list(cfg.allowed_hosts)
    if not loopback(cfg.host):
        return None
    bound = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    return list(dict.fromkeys((*LOOPBACK_NAMES, bound)))


def _check(cfg: DictConfig) -> None:
    """What the schema cannot check, before anything is loaded."""
    from distill.config.validate import missing_keys
    from distill.inference.schedulers import SCHEDULERS

    missing = missing_keys(cfg)
    if missing:
        raise ValueError(f"required value(s) missing: {', '.join(missing)}; e.g. {missing[0]}=<pipeline folder>")
    if cfg.scheduler is not None and cfg.scheduler.name not in SCHEDULERS:
        raise ValueError(f"scheduler.name={cfg.scheduler.name!r} is unknown; use one of {sorted(SCHEDULERS)}")
    if cfg.steps is not None and not 1 <= cfg.steps <= cfg.engine.max_steps:
        raise ValueError(f"steps={cfg.steps} must lie in [1, engine.max_steps={cfg.engine.max_steps}]")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype={cfg.dtype!r} is unknown; use one of {list(DTYPES)}")
    if not 0 <= cfg.port < 65536:
        raise ValueError(f"port={cfg.port} must lie in [0, 65535] (0: any free port)")
    if not loopback(cfg.host) and not cfg.api_key and not cfg.insecure:
        raise ValueError(f"host={cfg.host} serves other machines: set api_key=<token> (or the environment variable "
                         "DISTILL_SERVE_API_KEY), or insecure=true to serve them without one")
    if cfg.max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={cfg.max_body_bytes} must be >= 1")
    if cfg.accelerate.kind != "none" and cfg.engine.mode == "stream":
        raise ValueError(f"accelerate={cfg.accelerate.kind} keeps state along one trajectory, and engine.mode=stream "
                         "batches requests at different steps; set engine.mode=pipeline (or batch)")


def build(cfg: DictConfig):
    """(engine, model name) from a composed serve config."""
    import torch

    from distill.accelerate import make_accelerator
    from distill.families import denoiser_of
    from distill.inference.loading import load_pipeline, pipeline_defaults
    from distill.serve.engine import Engine
    from distill.serve.metrics import ServeMetrics

    node = OmegaConf.to_container(cfg.accelerate, resolve=True, enum_to_str=True)  # a guide named by ${distill.asset:...}
    accelerator = make_accelerator(str(node["kind"]), dict(node.get("options") or {}), path=str(cfg.pipeline))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pipe = load_pipeline(str(cfg.pipeline))
    denoiser_of(pipe)  # a pipeline of a registered model family (a ValueError naming them otherwise)
    for name in ("encode_prompt", "vae"):
        if not hasattr(pipe, name):
            raise ValueError(f"pipeline={cfg.pipeline!r} is a {type(pipe).__name__}; distill.serve serves text-to-image "
                             "pipelines of a registered model family (encode_prompt, a denoiser, vae)")
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe.to(device)
    if cfg.dtype != "float32":
        pipe.to(dtype=getattr(torch, cfg.dtype))
    defaults = pipeline_defaults(str(cfg.pipeline))
    steps, guidance = call_defaults(pipe)
    steps = cfg.steps or defaults.get("num_inference_steps") or steps
    guidance = cfg.guidance_scale if cfg.guidance_scale is not None else defaults.get("guidance_scale", guidance)
    settings = OmegaConf.to_container(cfg.engine, enum_to_str=True)
    settings.pop("_target_", None)
    name = None if cfg.scheduler is None else str(cfg.scheduler.name)
    options = {} if name is None else {name: OmegaConf.to_container(cfg.scheduler.options)}
    engine = Engine(pipe, steps=int(steps), guidance_scale=float(guidance), scheduler=name,
                    own_scheduler=defaults.get("name"), scheduler_options=options, accelerator=accelerator,
                    metrics=ServeMetrics(), **settings)
    return engine, str(cfg.pipeline)


def _server(config, drain: Callable[[], None]):
    """A uvicorn server whose SIGTERM (or first Ctrl-C) drains and then exits 0: uvicorn re-raises the signal
    after its graceful shutdown, which would end the process by the signal instead. ``drain`` starts the engine's
    drain as the shutdown begins, in the event loop (a signal handler may interrupt the loop holding the engine's
    lock), so that requests are refused and the drain timeout counted from then on."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C stops without waiting
            else:
                self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            drain()
            await super().shutdown(sockets)

    return Server(config)


def serve(cfg: DictConfig) -> None:
    import uvicorn

    from distill.serve.app import create_app

    _check(cfg)
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets it knows are TCP; without it a kept-alive client's
    # delayed ACK stalls each response (head and body are separate writes) by ~40 ms
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))  # before the model loads: a taken port fails at once
    except OSError as err:
        raise ValueError(f"cannot listen on {cfg.host}:{cfg.port} ({err.strerror}); choose another port=") from err
    engine, model = build(cfg)
    app = create_app(engine, model, cfg.drain_timeout_s, max_body_bytes=cfg.max_body_bytes, api_key=cfg.api_key or None,
                     allowed_hosts=allowed_hosts(cfg), cors_origins=list(cfg.cors_origins))
    server = _server(uvicorn.Config(app, log_level="warning",
                                    timeout_graceful_shutdown=cfg.drain_timeout_s + SHUTDOWN_GRACE_S),
                     app.state.drain)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    # listening before the address is announced: a client that reads it connects at once (queued until uvicorn
    # accepts) instead of being refused while the event loop starts
    sock.listen(2048)
    print(f"distill.serve: {model} ({engine.mode} mode, batch {engine.max_batch_size}, {engine.default_steps} steps, "
          f"guidance {engine.default_guidance}) on http://{host}:{port}", flush=True)
    server.run(sockets=[sock])
    print("distill.serve: stopped", flush=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    try:
        serve(cfg)
    except (ValueError, FileNotFoundError, OSError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
