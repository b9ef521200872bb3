# make demo : set up .venv if needed, then train the example causal LM on 2 CPU ranks with "stage": "odc"
# make test : set up .venv if needed, then run the whole test suite
# make test-unit : the seconds-long loop (tests/unit: no processes spawned)
# make lint / make typecheck : ruff and mypy, with the settings in pyproject.toml (CI runs both before the tests;
#   mypy must find no error anywhere in ds_odc/)
# make test-perturbed : opt-in: the contract and parity suites under CPU contention and schedule perturbation,
#   seeds 1-5 (tests/compat/run_perturbed.py; about an hour)
# make schema : regenerate config_schemas/odc.schema.json and docs/options.md from ds_odc/config.py
export DS_ACCELERATOR := cpu
export OMP_NUM_THREADS := 1
# JIT-built ops (DeepSpeed's CPU comm op, ds_odc's CUDA op) go into this checkout's venv: a build of
# another checkout, or the lock file a killed build leaves in ~/.cache, cannot block or clash with it.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.venv/torch_extensions
STEPS ?= 100

.PHONY: venv demo test test-unit test-perturbed lint typecheck schema

venv:
	@bash scripts/bootstrap.sh

demo: venv
	.venv/bin/torchrun --nproc_per_node 2 --master_port 29571 examples/train_causal_lm.py --steps $(STEPS)

test: venv
	.venv/bin/python -m pytest tests

test-unit: venv
	.venv/bin/python -m pytest tests/unit

test-perturbed: venv
	.venv/bin/python tests/compat/run_perturbed.py

lint: venv
	.venv/bin/ruff check .

typecheck: venv
	.venv/bin/python -m mypy

schema: venv
	.venv/bin/python -m ds_odc.config_schema
