# Two commands do all set-up: `make serve` and `make test` (see README.md).
PY := .venv/bin/python
MODEL_DIR ?= models/tiny-llama

.PHONY: serve test lint format model bench-gpu clean

.venv/.installed: pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh

$(MODEL_DIR)/config.json: .venv/.installed
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

test: .venv/.installed lint $(MODEL_DIR)/config.json
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf .venv models .pytest_cache .ruff_cache
