"""Run ``python -m MODULE ARGS`` for the tests without paying the interpreter's start and imports each time.

A command-line test starts ``python -m distill.train ...``: about 6 s of imports (torch, lightning, diffusers,
transformers, peft) before the first line of its own. This module keeps one server process per pytest worker
that has imported those libraries and never computes anything; each command is a ``fork`` of it that sets the
command's working directory, environment, ``sys.argv`` and ``sys.path[0]`` as ``python -m`` does, runs the module as
``__main__`` (``runpy``), ends like an interpreter (non-daemon threads joined, ``atexit`` handlers, streams
flushed) and exits with the code ``python`` would give (``SystemExit``'s code, 1 after a traceback, ``-signal`` when
killed). What differs from a fresh interpreter is only what the server imported before the fork, so a command whose
environment differs from the server's in anything read at import time (anything but ``WANDB_MODE`` /
``WANDB_SILENT``, pytest's ``PYTEST_CURRENT_TEST``) runs in a fresh interpreter instead, as does every command when ``DISTILL_TEST_FORK=0``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

RUNTIME_ONLY = {"WANDB_MODE", "WANDB_SILENT", "PYTEST_CURRENT_TEST"}  # read when a command runs, not at import
PRELOAD = ("distill.train", "distill.evaluate", "distill.sample", "lightning.pytorch", "diffusers", "transformers",
           "peft")


def _child(request: dict) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` and exit as it would."""
    import atexit
    import runpy
    import threading
    import traceback

    os.setpgid(0, 0)  # its own group, so that a timeout kills what it started too
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [request["module"], *request["args"]]
    sys.path[0] = request["cwd"]
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: print the traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def serve() -> None:
    """The server: import once, then one JSON request per line on stdin; answer ``{"pid"}`` after the fork and
    ``{"returncode"}`` when the child has ended."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"returncode": code}), flush=True)


class ForkServer:
    """The client: ``run(module, args, cwd, env, timeout)`` -> ``subprocess.CompletedProcess`` (text output)."""

    def __init__(self):
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=self.env, cwd=str(Path(__file__).resolve().parents[1]))
        self._ready = False

    def _read(self, timeout: float | None) -> dict:
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test fork server ended (exit {self.proc.poll()})")
        return json.loads(line)

    def can_run(self, env: dict) -> bool:
        keys = (set(env) | set(self.env)) - RUNTIME_ONLY
        return self.proc.poll() is None and all(env.get(k) == self.env.get(k) for k in keys)

    def run(self, module: str, args: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
        if not self._ready:
            self._read(300)
            self._ready = True
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"module": module, "args": list(args), "cwd": str(cwd), "env": env, "stdout": str(out),
                       "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._read(60)["pid"]
            try:
                code = self._read(timeout)["returncode"]
            except TimeoutError:
                with_suppressed(lambda: os.killpg(pid, signal.SIGKILL))
                self._read(60)
                raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout,
                                                out.read_text(errors="replace"), err.read_text(errors="replace")) from None
            with_suppressed(lambda: os.killpg(pid, signal.SIGKILL))  # what the command left running, as a group
            return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code,
                                               out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def with_suppressed(action) -> None:
    try:
        action()
    except (ProcessLookupError, PermissionError):
        pass


_SERVER: ForkServer | None = None


def run_module(module: str, args: list[str], cwd: str | Path, env: dict, timeout: float,
               fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m module args`` in ``cwd`` with exactly ``env``: a fork of this worker's server where it can be
    one, a fresh interpreter otherwise or when ``fresh`` (same result object as ``subprocess.run(...,
    capture_output=True, text=True)``). ``fresh`` is for commands that ``torch.compile``: a compiled training
    hung in a fork of the server (timed out after 1200 s, CI of 2026-12-06; the cause, likely inductor's compile
    workers or locks inherited through the fork, not isolated) and passes in a fresh interpreter (419 s)."""
    global _SERVER
    if not fresh and os.environ.get("DISTILL_TEST_FORK", "1") != "0" and sys.platform.startswith("linux"):
        if _SERVER is None:
            _SERVER = ForkServer()
        if _SERVER.can_run(env):
            return _SERVER.run(module, args, str(cwd), env, timeout)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # import distill from the checkout, as the tests do
    serve()
