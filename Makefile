# make demo : set up .venv if needed, then train the example causal LM on 2 CPU ranks with "stage": "odc"
# make test : set up .venv if needed, then run the whole test suite (two workers where tests/workers.py can isolate
#   them; ODC_TEST_WORKERS=1 for one process), but for the release surfaces
# make test-unit : the seconds-long loop (tests/unit: no processes spawned, no network)
# make test-releases : every private name against the source of every release in the declared ranges (downloads
#   sdists into ~/.cache/ds_odc/sdists once; CI runs it after make test)
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

.PHONY: venv demo test test-unit test-releases test-perturbed lint typecheck schema

venv:
	@bash scripts/bootstrap.sh

demo: venv
	.venv/bin/torchrun --nproc_per_node 2 --master_port 29571 examples/train_causal_lm.py --steps $(STEPS)

test: venv
	ODC_WORKER_PYTHON=$(CURDIR)/.venv/bin/python .venv/bin/python -m pytest tests -m "not release_surfaces" \
		$$(.venv/bin/python tests/workers.py)

test-unit: venv
	.venv/bin/python -m pytest tests/unit -m "not release_surfaces"

test-releases: venv
	.venv/bin/python -m pytest tests/unit/test_release_surfaces.py

test-perturbed: venv
	.venv/bin/python tests/compat/run_perturbed.py

lint: venv
	.venv/bin/ruff check .

typecheck: venv
	.venv/bin/python -m mypy

schema: venv
	.venv/bin/python -m ds_odc.config_schema
