# `make run`: set up, start a local cluster shaped like Asteroid's Env D at 100 Mbps (1 TX2-like + 3 Nano-like
# devices), then train MobileNetV2 on it through the coordinator (profile, plan, deploy, 30 rounds, checkpoints),
# measure DP and PP for 3 rounds each, print predicted against measured, draw out/loss.png and
# out/timeline.png, stop.
# `make test`: set up and run the test suite (needs Mosquitto: apt-get install -y mosquitto mosquitto-clients) on two
# pytest-xdist workers, a test file to a worker (its module fixtures stay in one process); the 25 slowest tests are
# listed at the end.

PYTHON ?= python3
VENV ?= .venv
ES := $(VENV)/bin/edgeswarm
PORT ?= 18830
HUB := mqtt://127.0.0.1:$(PORT)
OUT ?= out

.PHONY: venv run test clean

# constraints.txt pins this environment exactly (the package itself asks for ranges); a change to either file
# reinstalls.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

run: venv
	@mkdir -p $(OUT)
	@set -e; \
	$(ES) up --local --devices asteroid-env-d-100mbps --port $(PORT) --workdir $(OUT)/local-cluster & up=$$!; \
	trap 'kill -TERM $$up 2>/dev/null; wait $$up' EXIT; \
	$(ES) status --hub $(HUB) --wait-devices 4 --timeout 120; \
	$(ES) train examples/mobilenetv2-env-d.yaml --hub $(HUB) --wait --compare dp,pp --compare-rounds 3 \
		--json $(OUT)/train.json --loss-png $(OUT)/loss.png --timeline-png $(OUT)/timeline.png

test: venv
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=25

clean:
	rm -rf $(VENV) $(OUT) *.egg-info .pytest_cache .hypothesis
