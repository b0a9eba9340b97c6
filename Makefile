# Two commands do all set-up: `make serve` and `make test` (see README.md).
PY := .venv/bin/python
MODEL_DIR ?= models/tiny-llama

.PHONY: serve test test-long test-clients restart-check restart-repeat chaos lint format model bench-gpu clean

.venv/.installed: pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh

# The tiny model's tokenizer_config.json carries a copy of the family's chat template: remake it when
# the template changes.
$(MODEL_DIR)/config.json: .venv/.installed engine/templates/llama.jinja
	$(PY) -m scripts.make_model tiny $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

serve: .venv/.installed $(MODEL_DIR)/config.json
	.venv/bin/serve run serve_config.yaml

lint: .venv/.installed
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: .venv/.installed
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

# Long runs stay out of `make test` (15 minutes at most on a 2-core machine): `make test-long` runs them.
LONG_TESTS := tests/test_hardening.py::test_soak_2min_w2 tests/test_serving_chaos.py \
	tests/test_serving_scaleout.py::test_prefix_routing_keeps_the_single_replica_hit_rate \
	tests/test_serving_scaleout.py::test_autoscaling_adds_a_replica_under_load_and_drains_it_when_the_load_ends \
	tests/test_kv_offload_serving.py::test_the_benchmark_smoke_serves_w4_with_the_tier_off_and_on \
	tests/test_serving_scaleout.py::test_losing_a_replica_loses_no_request_that_had_not_started_streaming

test: .venv/.installed lint $(MODEL_DIR)/config.json
	$(PY) -m pytest -q -p no:cacheprovider tests $(addprefix --deselect ,$(LONG_TESTS))

test-long: .venv/.installed $(MODEL_DIR)/config.json
	$(PY) -m pytest -q -p no:cacheprovider $(LONG_TESTS)

# The real lm-eval and guidellm clients against the server (tests/test_clients.py), apart from `make test`
# for time. They go in a venv of their own, since their pins (click, multidict) differ from the server's;
# it sees the project's packages (torch, transformers) behind its own through a .pth file.
CLIENTS := .venv/clients
$(CLIENTS)/.installed: .venv/.installed pyproject.toml
	$(PY) -m venv --system-site-packages $(CLIENTS)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(CLIENTS)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/project-venv.pth"
	$(CLIENTS)/bin/pip install -q -e ".[clients]"
	touch $@

test-clients: .venv/.installed $(MODEL_DIR)/config.json $(CLIENTS)/.installed
	MINSERVE_CLIENTS_PYTHON=$(CLIENTS)/bin/python MINSERVE_CLIENTS_REQUIRED=1 \
		$(PY) -m pytest -q -p no:cacheprovider tests/test_clients.py -k "real_lm_eval or real_guidellm"

# Ctrl-C and restart of `serve run serve_config.yaml` ten times on one port (issue 51's check): every
# round must return within 10 s and leave no process and no bound port.
restart-check: .venv/.installed $(MODEL_DIR)/config.json
	$(PY) -m scripts.restart_check --rounds 10 --out benchmarks/reports/restart_check_cpu

# The rolling-update and scale-down tests (a redeploy with one replica fewer while streams run on both,
# and autoscaling's drain) 20 times in a row; the first failure stops it. Run the test suite beside it
# for issue 51's "under the same load".
RESTART_TESTS := tests/test_serving_scaleout.py::test_scale_down_lets_the_leaving_replica_finish_its_streams \
	tests/test_serving_scaleout.py::test_autoscaling_adds_a_replica_under_load_and_drains_it_when_the_load_ends
restart-repeat: .venv/.installed $(MODEL_DIR)/config.json
	for i in $$(seq 20); do \
		echo "restart-repeat: run $$i of 20"; \
		$(PY) -m pytest -q -p no:cacheprovider $(RESTART_TESTS) || exit 1; \
	done

# The fault benchmark (scripts/chaos.py): three rounds of a redeploy, a scale-down, kill -9 of an engine
# core and of a replica, Ctrl-C and restart, under W2 load against `serve run` with two engine replicas
# on a free port. Exit 1 on any lost request, stream cut without an error event, or leftover.
chaos: .venv/.installed $(MODEL_DIR)/config.json
	$(PY) -m scripts.chaos --rounds 3 --out benchmarks/reports/chaos_cpu

clean:
	rm -rf .venv models .pytest_cache .ruff_cache
