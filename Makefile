# Two commands, each sets itself up on a fresh machine.
PY := .venv/bin/python
# OpenMP threads that spin while waiting slow torch down badly when processes share 2 cores.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test test-fast demo calibrate clean

setup:
	bash scripts/setup.sh

# Everything (what CI runs: .ci/run). 25-30 min on 2 cores (README: "Two commands"), plus a one-time ~10 min calibration.
test: setup
	$(PY) -m pytest -q

# The edit loop: no engine, server, real model or calibration (-m "not slow"; 4-9 min on 2 cores).
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

demo: setup
	$(PY) -m sglang_tasq.demo

calibrate: setup
	$(PY) -m calibrate --model smollm2-135m --out artifacts/smollm2

clean:
	rm -rf .venv artifacts
