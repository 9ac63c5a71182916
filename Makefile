# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: venv install install-dev demo test test-slow test-all notebooks lint assets constraints clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@touch $@

# torch is installed first and pinned so that pip takes the local CPU wheel
# instead of resolving a multi-GB CUDA build.
# constraints.txt pins every package to the version CI tests (`make constraints` rewrites it from the venv).
$(VENV)/.installed: $(VENV)/.created pyproject.toml constraints.txt
	$(PY) -m pip install -q -c constraints.txt torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -c constraints.txt -e .
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $@

venv: $(VENV)/.created
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(PY) -m distill.train +exp=$(or $(EXP),consistency)

# One pytest worker per core, at most 4 (TEST_WORKERS=0 runs in-process); a test file stays on one worker so that its
# module fixtures (straight reference runs) are built once.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
test: install-dev
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

# Every notebook top to bottom with small settings (nbclient), 1.5-4.5 min each; CI runs it after `make test`.
notebooks: install-dev
	$(PY) -m pytest -q -m notebooks tests/test_notebooks.py --durations=5

# The slow tests alone (CI's third step): end-to-end SIGKILL resumes, FSDP = DDP, torchrun, submitit, the serving soak.
test-slow: install-dev
	$(PY) -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile --durations=20

test-all: install-dev
	$(PY) -m pytest -q -m "" -n $(TEST_WORKERS) --dist loadfile --durations=20

# Retrain every shipped digits asset (classifier, VAE, CLIP, teacher) and copy it into the package.
assets: install
	$(PY) -m distill.worlds.digits.build

# Pin what the venv holds now (local version tags such as +cpu dropped, so that a CUDA torch of the same
# version satisfies the pin too).
constraints: install-dev
	$(PY) -m pip freeze --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$$//' | grep -v '^distill' > constraints.txt

lint: install-dev
	$(VENV)/bin/ruff check distill tests

clean:
	rm -rf outputs multirun .pytest_cache
