# Two commands do all set-up: `make serve` and `make test` (see README.md).
PY := .venv/bin/python
MODEL_DIR ?= models/tiny-llama

.PHONY: serve test lint format model bench-gpu clean

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

test: .venv/.installed lint $(MODEL_DIR)/config.json
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf .venv models .pytest_cache .ruff_cache
