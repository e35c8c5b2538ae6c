# `make run`: set up, start a local cluster of 4 emulated devices, show it, profile it and plan MobileNetV2
# training on it (out/plan.png), benchmark the transport, stop.
# `make test`: set up and run the test suite (needs Mosquitto: apt-get install -y mosquitto mosquitto-clients).

PYTHON ?= python3
VENV ?= .venv
ES := $(VENV)/bin/edgeswarm
PORT ?= 18830
HUB := mqtt://127.0.0.1:$(PORT)
OUT ?= out

.PHONY: venv run test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

run: venv
	@mkdir -p $(OUT)
	@set -e; \
	$(ES) up --local --devices 4 --port $(PORT) --workdir $(OUT)/local-cluster & up=$$!; \
	trap 'kill -TERM $$up 2>/dev/null; wait $$up' EXIT; \
	$(ES) status --hub $(HUB) --wait-devices 4 --timeout 120; \
	$(ES) plan --hub $(HUB) --model mobilenetv2 --batch-sizes 1,8,32 --global-batch 256 --png $(OUT)/plan.png; \
	$(ES) bench transport --hub $(HUB) --out $(OUT)/bench-transport.json

test: venv
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) $(OUT) *.egg-info .pytest_cache .hypothesis
