# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is taken first so no dependency pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test test-triton bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,demo,eval,serve,triton]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m structkv.cli demo

# Two pytest processes: TRITON_INTERPRET must be set before Triton kernels are defined.
test: venv
	$(VENV)/bin/ruff check structkv tests benchmarks
	$(PY) -m pytest -q -p no:cacheprovider -m "not triton_interpret"
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -m triton_interpret

bench: venv
	$(PY) benchmarks/decoder_speed.py
	$(PY) benchmarks/ops_memory.py

clean:
	rm -rf $(VENV) .cache *.egg-info
