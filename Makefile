# Two commands, each sets itself up on a fresh machine.
PY := .venv/bin/python
# OpenMP threads that spin while waiting slow torch down badly when processes share 2 cores.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test test-all demo calibrate clean

setup:
	bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q

demo: setup
	$(PY) -m sglang_tasq.demo

calibrate: setup
	$(PY) -m calibrate --model smollm2-135m --out artifacts/smollm2

clean:
	rm -rf .venv artifacts
