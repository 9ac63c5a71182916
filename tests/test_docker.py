"""The Dockerfile installs what `make install` (and so CI) installs, and launch/k8s-job.yaml runs the image it builds
with the resuming training command. `docker build --check` (the Dockerfile's syntax and build checks, no build) runs
only where a Docker daemon answers."""

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "launch" / "k8s-job.yaml"


def _logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined and comments dropped."""
    return [line.strip() for line in re.sub(r"\\\n", " ", text).splitlines() if line.strip() and
            not line.lstrip().startswith("#")]


def _makefile() -> tuple[dict[str, str], dict[str, list[str]]]:
    """Variables (`NAME ?= value`) and the recipe lines of each target."""
    variables, recipes, target = {}, {}, None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if m := re.match(r"^(\w+)\s*\??=\s*(.*)$", line):
            variables[m[1]] = m[2].strip()
        elif m := re.match(r"^(\S[^:=]*):(?!=)", line):
            target = m[1].strip()
            recipes[target] = []
        elif line.startswith("\t") and target is not None:
            recipes[target].append(line.strip())
    return variables, recipes


def _pip_installs(commands: list[str], python: str, version_ref: str) -> list[list[str]]:
    """The arguments of each `<python> -m pip install`, with -q dropped and the torch version variable normalised."""
    found = []
    for command in commands:
        for part in command.split("&&"):
            words = shlex.split(part.replace(version_ref, "$TORCH_VERSION"))
            words = [w for w in words if not re.match(r"^\w+=", w) or "==" in w]  # FOO=bar prefixes (env)
            if words[:4] == [python, "-m", "pip", "install"]:
                found.append([w for w in words[4:] if w != "-q"])
    return found


def _dockerfile() -> tuple[dict[str, str], list[str], str]:
    """ARG defaults, the RUN commands and the WORKDIR."""
    lines = _logical_lines(DOCKERFILE.read_text())
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", "\n".join(lines), re.M))
    runs = [line[4:] for line in lines if line.startswith("RUN ")]
    [workdir] = [line.split()[1] for line in lines if line.startswith("WORKDIR ")]
    return args, runs, workdir


def test_dockerfile_installs_exactly_what_make_install_installs():
    variables, recipes = _makefile()
    make = _pip_installs(recipes["$(VENV)/.created"] + recipes["$(VENV)/.installed"], "$(PY)", "$(TORCH_VERSION)")
    assert make == [["--upgrade", "pip"], ["-c", "constraints.txt", "torch==$TORCH_VERSION"],
                    ["-c", "constraints.txt", "-e", "."]]  # what this test knows how to compare
    args, runs, _ = _dockerfile()
    docker = _pip_installs(runs, "python", "${TORCH_VERSION}")
    assert docker == make  # the same steps, in the same order: pip, torch first, then the package
    assert args["TORCH_VERSION"] == variables["TORCH_VERSION"]  # the same torch pin
    assert re.search(r"^torch==" + re.escape(variables["TORCH_VERSION"]) + "$", (ROOT / "constraints.txt").read_text(), re.M)
    # the only addition is the wheel index of the chosen build (cpu by default), on the torch step only
    text = DOCKERFILE.read_text()
    assert args["TORCH_INDEX"] == "cpu" and text.count("PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/${TORCH_INDEX}") == 1
    assert "python -m venv /opt/venv" in text and "PATH=/opt/venv/bin:$PATH" in text  # a venv, as make's


def test_dockerignore_keeps_local_environments_out_but_not_the_source():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for local in (".venv", ".git", "outputs", "multirun", "wandb"):
        assert local in ignored
    for needed in ("distill", "conf", "pyproject.toml", "constraints.txt", "launch", "README.md"):  # README: the readme
        assert needed not in ignored


def _documented_tags() -> dict[str, str]:
    """`docker build [--build-arg TORCH_INDEX=x] -t TAG .` lines of the Dockerfile's header: tag -> index."""
    tags = {}
    for m in re.finditer(r"^#\s+docker build (?:--build-arg TORCH_INDEX=(\S+) )?-t (\S+) \.", DOCKERFILE.read_text(), re.M):
        tags[m[2]] = m[1] or "cpu"
    return tags


def test_k8s_job_runs_the_documented_cuda_image_with_the_resuming_command(tmp_path):
    job = yaml.safe_load(K8S.read_text())
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    tags = _documented_tags()
    assert container["image"] in tags and tags[container["image"]].startswith("cu")  # GPUs: a CUDA build
    assert f"-t {container['image']} ." in K8S.read_text()  # the manifest names the build command too
    _, _, workdir = _dockerfile()
    assert container["workingDir"] == workdir
    assert pod["restartPolicy"] == "OnFailure" and pod["terminationGracePeriodSeconds"] >= 60

    # what the pod runs: launch/torchrun.sh, run with the pod's env and args and a fake torchrun that records them
    assert container["command"] == ["bash", "launch/torchrun.sh"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {tmp_path / "argv"}\n')
    (bin_dir / "torchrun").chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), *container["args"]], capture_output=True,
                          text=True, env={**os.environ, **env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert argv[:4] == ["--standalone", f"--nproc_per_node={gpus}", "-m", "distill.train"]  # the training entry
    overrides = argv[4:]
    assert "ckpt_path=last" in overrides and f"trainer.devices={gpus}" in overrides and "trainer=ddp" in overrides
    [run_dir] = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]  # a stable run directory
    mounts = {v["name"]: v["mountPath"] for v in container["volumeMounts"]}
    claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert any(Path(run_dir).is_relative_to(mounts[name]) for name in claims), run_dir  # on the persistent volume
    assert "+exp=consistency" in overrides


def _docker_daemon() -> str | None:
    """None when a Docker daemon answers, else why not."""
    if shutil.which("docker") is None:
        return "no docker command"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                              timeout=20)
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if info.returncode != 0 or not info.stdout.strip():
        return "no Docker daemon answers: " + (info.stderr.strip().splitlines() or ["?"])[-1]
    return None


def test_docker_build_check_passes():
    """BuildKit's checks of the Dockerfile (syntax, stages, instructions), without building the image."""
    reason = _docker_daemon()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run(["docker", "build", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
