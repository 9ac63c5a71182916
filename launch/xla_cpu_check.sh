#!/usr/bin/env bash
# trainer=tpu on XLA's CPU device (PJRT_DEVICE=CPU): one latent-consistency-distillation training step and one
# sampling call, in an environment of its own. torch-xla 2.9 (the newest on PyPI) runs only beside torch 2.9,
# while distill's own environment has torch 2.13; on x86_64, PyPI's torch 2.9.1 is a CUDA build (~7 GB installed).
#
#   bash launch/xla_cpu_check.sh            # creates $XLA_ENV once (default ~/.cache/distill/xla-env), then runs
#   XLA_ENV=/path bash launch/xla_cpu_check.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ENV=${XLA_ENV:-$HOME/.cache/distill/xla-env}
PY=${PYTHON:-python3.11}
if [ ! -f "$ENV/.distill-ready" ]; then  # written once every install below has finished
  "$PY" -m venv "$ENV"
  "$ENV/bin/pip" install -q --upgrade pip
  "$ENV/bin/pip" install -q torch==2.9.1 torch-xla==2.9.0
  # distill's dependencies from pyproject.toml, except torch (kept at 2.9.1); distill itself from this checkout
  deps=$("$ENV/bin/python" - "$ROOT/pyproject.toml" <<'PYEOF'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(" ".join(d for d in deps if not d.replace(" ", "").startswith("torch>")))
PYEOF
)
  # shellcheck disable=SC2086
  "$ENV/bin/pip" install -q $deps "torch==2.9.1"
  "$ENV/bin/pip" install -q --no-deps -e "$ROOT"
  touch "$ENV/.distill-ready"
fi
"$ENV/bin/python" -c "import torch, torch_xla; print('torch', torch.__version__, 'torch_xla', torch_xla.__version__)"
export PJRT_DEVICE=CPU
exec "$ENV/bin/python" "$ROOT/launch/xla_cpu_check.py" "$@"
