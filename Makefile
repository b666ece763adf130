.PHONY: setup test test-fast lint format demo
setup:
	bash scripts/setup.sh
test:
	bash scripts/test.sh
test-fast:
	bash scripts/setup.sh
	HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 .venv/bin/python -m pytest -q tests/unit tests/integration
lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
format:
	.venv/bin/ruff format . && .venv/bin/ruff check --fix .
demo:
	bash scripts/demo.sh
