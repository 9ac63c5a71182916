"""Serving exported pipelines: ``python -m distill.serve`` (an HTTP service with dynamic batching, pipelined
stages and stream batching; see :mod:`distill.serve.app` and :mod:`distill.serve.engine`) and its clients.

    python -m distill.serve pipeline=<dir or hub id>
    from distill.serve import Client
    Client("http://127.0.0.1:8000").generate("a red circle", seed=0).images[0]
"""

from distill.serve.client import AsyncClient, Client, Generation, ServeError, parse_metrics

__all__ = ["AsyncClient", "Client", "Generation", "ServeError", "parse_metrics"]
