"""Job-id routes of the HTTP service (progress, cancel): engineer B of issue 31 fills this module in."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from distill.serve.engine import Engine


def add_job_routes(app: FastAPI, engine: Engine, admit: Callable, answer: Callable) -> None:
    """Add the job routes to ``app``: ``admit(body)`` queues a GenerateRequest's job (or returns the refusing
    answer), ``answer(response)`` counts a response by status. None yet."""
