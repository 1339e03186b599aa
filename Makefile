# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint browser container-tools unit integration bench proto clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/modelyard serve

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/mypy

# The dashboard's browser tests drive Debian's chromium through chromium-driver: installed here when
# we can (root with apt-get); otherwise those tests are skipped, and this says so.
BROWSER_SKIPPED := the dashboard's browser tests will be skipped (they need /usr/bin/chromium and /usr/bin/chromedriver)
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
		:; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q chromium chromium-driver \
			|| { apt-get update -q && apt-get install -y -q chromium chromium-driver; } \
			|| echo "apt-get could not install chromium: $(BROWSER_SKIPPED)"; \
	else \
		echo "$(BROWSER_SKIPPED)"; \
	fi

# The image test builds the Dockerfile with podman (runc, and debootstrap for a base image, as no
# image registry is reachable here): installed like chromium, else that test is skipped.
CONTAINER_TOOLS := podman runc debootstrap
container-tools:
	@if command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null; then \
		:; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q $(CONTAINER_TOOLS) \
			|| { apt-get update -q && apt-get install -y -q $(CONTAINER_TOOLS); } \
			|| echo "apt-get could not install $(CONTAINER_TOOLS): the image test will be skipped"; \
	else \
		echo "the image test will be skipped (it needs root with $(CONTAINER_TOOLS))"; \
	fi

test: lint browser container-tools
	$(BIN)/pytest -q

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

integration: $(STAMP) browser container-tools
	$(BIN)/pytest -q tests/integration

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/overhead.py

# The gRPC code in src/modelyard/rpc/agent_v1/ and rpc/oip_v2/ is generated from proto/ and checked in.
# The proto packages stay modelyard.agent.v1 and inference; the -I mapping only decides the Python
# module path. OIP's messages go into a private descriptor pool (the sed): tritonclient's and KServe's
# generated code put the same `inference.*` names into the default pool, and a process that imports
# both (our tests, an application embedding the gateway) would fail with "duplicate symbol".
PROTOC := PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m grpc_tools.protoc \
	--python_out=src --grpc_python_out=src --mypy_out=src --mypy_grpc_out=src
proto: $(STAMP)
	$(PROTOC) -Imodelyard/rpc/agent_v1=proto/modelyard/agent/v1 modelyard/rpc/agent_v1/agent.proto
	$(PROTOC) -Imodelyard/rpc/oip_v2=proto/inference modelyard/rpc/oip_v2/grpc_predict_v2.proto
	sed -i 's/_descriptor_pool\.Default()\.AddSerializedFile(/_descriptor_pool.DescriptorPool().AddSerializedFile(/' \
		src/modelyard/rpc/oip_v2/grpc_predict_v2_pb2.py
	@grep -q '_descriptor_pool\.DescriptorPool()\.AddSerializedFile(' src/modelyard/rpc/oip_v2/grpc_predict_v2_pb2.py \
		|| { echo "make proto: grpc_predict_v2_pb2.py is not in a private DescriptorPool (protoc's output changed?); fix the sed" >&2; exit 1; }

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
