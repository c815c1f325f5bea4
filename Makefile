# Each target does its own set-up on a fresh machine: venv, project install, default-corpus cache.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.soma-installed
DEMO_STAMP := $(VENV)/.soma-demo-installed

.PHONY: setup demo-setup test demo bench clean

# The project's own bytecode: an editable install leaves it uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set, every process (a Flower ClientApp is one per message) compiled the sources again: ~0.4 s of CPU.
# compileall skips what is up to date.
PACKAGES := soma_edge coordinator worker export
COMPILE = $(PY) -m compileall -q

# What the tests need: the dev extra (pytest, torch for the references, ruff, ...) and the CPU ONNX Runtime.
setup: $(STAMP)
	@$(COMPILE) $(PACKAGES) bench tests >/dev/null
	@$(PY) -m soma_edge.corpus fetch

# What the demo needs, and no more: the CPU ONNX Runtime and matplotlib for `soma-coord report` (no torch).
demo-setup: $(DEMO_STAMP)
	@$(COMPILE) $(PACKAGES) >/dev/null
	@$(PY) -m soma_edge.corpus fetch

$(VENV)/.created:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# A .venv made before the cpu/cuda extras holds onnxruntime-gpu: both packages own the module onnxruntime.
	@! $(PY) -m pip show --quiet onnxruntime-gpu >/dev/null 2>&1 || $(PY) -m pip uninstall --quiet -y onnxruntime-gpu
	@touch $@

# Both installs go through uv (flwr depends on it, in this range: nothing extra in the venv), which fetches
# and unpacks in parallel: the dev install ~20 s here, bytecode included, where pip took ~70 s.
# tools/uv_install.py hands uv the package sources pip is configured with (uv does not read pip's
# configuration), so the dev extra's torch comes from wherever pip would take it; should uv fail, pip
# installs instead.
UV_INSTALL = $(PY) -m pip install --quiet 'uv>=0.13.5,<0.14' && $(PY) tools/uv_install.py

$(STAMP): pyproject.toml $(VENV)/.created
	$(UV_INSTALL) -e '.[dev,cpu]' || $(PY) -m pip install --quiet -e '.[dev,cpu]'
	@touch $@ $(DEMO_STAMP)

# The dev install holds everything the demo needs, so a box that ran `make test` installs nothing more here.
$(DEMO_STAMP): pyproject.toml $(VENV)/.created
	$(UV_INSTALL) -e '.[cpu,report]' || $(PY) -m pip install --quiet -e '.[cpu,report]'
	@touch $@

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=20 -n 2 --dist loadgroup tests

# The demo: an embedded SuperLink, 2 local workers, 4 experts, a few rounds on the default corpus, then
# the ONNX deploy bundle, the run's report (its path is printed), and its held-out (test split)
# nats/byte, which is the last line printed.
DEMO_RUN ?= runs/demo
DEMO_ROUNDS ?= 4
DEMO_ROUND_SECONDS ?= 55
HELDOUT = import json, sys; r = sys.argv[1]; p = json.load(open(r + "/prepare.json")); \
	print(" ".join("--data %s/shards/%s.bin" % (r, c["shards"]["test"]) for c in p["clusters"] if c["bytes"]["test"]))

demo: demo-setup
	rm -rf $(DEMO_RUN)
	$(VENV)/bin/soma-coord start --run $(DEMO_RUN) --config examples/demo.toml --local-workers 2 --experts 4 \
		--rounds $(DEMO_ROUNDS) --round-seconds $(DEMO_ROUND_SECONDS) --port 0
	$(VENV)/bin/soma-export onnx $(DEMO_RUN) --out $(DEMO_RUN)/deploy --force
	$(VENV)/bin/soma-coord report $(DEMO_RUN)
	$(VENV)/bin/soma-export eval $(DEMO_RUN)/deploy $$($(PY) -c '$(HELDOUT)' $(DEMO_RUN))

clean:
	rm -rf runs .pytest_cache
