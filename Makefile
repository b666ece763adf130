.PHONY: setup test lint format demo
setup:
	bash scripts/setup.sh
test:
	bash scripts/test.sh
lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
format:
	.venv/bin/ruff format . && .venv/bin/ruff check --fix .
demo:
	bash scripts/demo.sh
