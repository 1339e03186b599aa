# The two commands a newcomer needs: `make demo` and `make test`.
#
# Every install comes from one lock, uv.lock (uv's universal lock: every transitive version, with
# hashes, for the runtime and each extra), so a fresh machine installs what was tested. uv itself
# is pinned here and bootstrapped with pip into .tools/. `make lock` refreshes the locks after a
# change to pyproject.toml; `make test` refuses a lock that no longer matches it (scripts/lock.py).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
UV_VERSION := 0.13.9
TOOLS := .tools/uv-$(UV_VERSION)
UV := $(TOOLS)/bin/uv
LOCK := UV=$(UV) $(PYTHON) scripts/lock.py
# uv builds .venv with $(PYTHON), never a Python of its own download, and modelyard's own wheel
# with the locked setuptools; the caller's uv settings (a config file, an index, UV_SYSTEM_PYTHON,
# which would send `pip sync` to the system's Python) must not change what gets installed.
export UV_PYTHON := $(PYTHON)
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)
export UV_BUILD_CONSTRAINT := deploy/image/build-requirements.txt
export UV_NO_CONFIG := 1
unexport UV_SYSTEM_PYTHON UV_INDEX UV_INDEX_URL UV_EXTRA_INDEX_URL UV_DEFAULT_INDEX UV_FIND_LINKS \
	UV_INDEX_STRATEGY UV_NO_INDEX UV_EXCLUDE_NEWER UV_CONSTRAINT UV_OVERRIDE UV_RESOLUTION \
	UV_PRERELEASE UV_FROZEN UV_LOCKED UV_NO_SYNC UV_NO_BINARY UV_ONLY_BINARY UV_NO_BUILD_ISOLATION

# The ranges pyproject.toml declares, tested at both ends (scripts/lock.py locks each end). The
# lowest end: the unit tests, and the integration tests that found a lower bound too low (aiohttp's
# server, redis). The newest end differs from uv.lock mostly in protobuf 7: the unit tests.
BOUNDS := tests/fixtures/bounds
LOWEST_TESTS := tests/unit tests/integration/test_lean_listener.py tests/integration/test_shared_state.py \
	tests/integration/test_redis_subscription.py
NEWEST_TESTS := tests/unit

.PHONY: demo clients dev test test-bounds lint lock lock-check browser container-tools unit integration bench proto clean

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)

# The runtime only; --inexact keeps what `make test` added (the same versions: one lock).
$(VENV)/.installed: pyproject.toml uv.lock | $(UV)
	@$(LOCK) check
	$(UV) sync -q --locked --inexact
	touch $@

$(STAMP): pyproject.toml uv.lock | $(UV)
	@$(LOCK) check
	$(UV) sync -q --locked --extra dev
	touch $@ $(VENV)/.installed

# One line, and exit 1, when a lock no longer matches pyproject.toml (scripts/lock.py says which).
lock-check: | $(UV)
	@$(LOCK) check

# After a change to pyproject.toml: `make lock` (keeps every version it can); `make lock
# UPGRADE=redis` upgrades one package (UPGRADE="redis rich" two), `make lock UPGRADE=all` every one.
lock: | $(UV)
	$(LOCK) write $(UPGRADE)

demo: $(VENV)/.installed
	$(BIN)/modelyard serve

# The clients the README's examples use (openai, numpy, tritonclient), beside the runtime.
clients: $(VENV)/.installed
	$(UV) sync -q --locked --inexact --extra clients

# The [dev] environment (the clients, schemathesis and the other test tools) without running tests.
dev: $(STAMP)

.venv-%/.installed: $(BOUNDS)/%.txt | $(UV)
	$(UV) venv -q --allow-existing .venv-$*
	$(UV) pip sync -q --python .venv-$*/bin/python $<
	touch $@

test-bounds: lock-check .venv-lowest/.installed .venv-newest/.installed
	.venv-lowest/bin/pytest -q -p no:cacheprovider $(LOWEST_TESTS)
	.venv-newest/bin/pytest -q -p no:cacheprovider $(NEWEST_TESTS)

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

test: lock-check lint test-bounds browser container-tools
	$(BIN)/pytest -q

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

integration: $(STAMP) browser container-tools
	$(BIN)/pytest -q tests/integration

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/overhead.py

# The gRPC code in src/modelyard/rpc/agent_v1/ and rpc/oip_v2/ is generated from proto/ and checked in,
# by the oldest grpcio-tools whose code runs on every protobuf runtime we declare (6.30 to 7.x: its
# protoc is 30.0, and tritonclient and KServe's client need protobuf 6). It runs in a throwaway uv
# environment, not .venv (grpcio-tools pins protobuf < 7). The proto packages stay modelyard.agent.v1
# and inference; the -I mapping only decides the Python module path. OIP's messages go into a private
# descriptor pool (the sed): tritonclient's and KServe's generated code put the same `inference.*`
# names into the default pool, and a process that imports both (our tests, an application embedding
# the gateway) would fail with "duplicate symbol".
PROTO_TOOLS := --with grpcio-tools==1.72.0 --with mypy-protobuf==5.1.0
PROTOC := $(UV) run -q --no-project --isolated $(PROTO_TOOLS) python -m grpc_tools.protoc \
	--python_out=src --grpc_python_out=src --mypy_out=src --mypy_grpc_out=src
proto: | $(UV)
	$(PROTOC) -Imodelyard/rpc/agent_v1=proto/modelyard/agent/v1 modelyard/rpc/agent_v1/agent.proto
	$(PROTOC) -Imodelyard/rpc/oip_v2=proto/inference modelyard/rpc/oip_v2/grpc_predict_v2.proto
	sed -i 's/_descriptor_pool\.Default()\.AddSerializedFile(/_descriptor_pool.DescriptorPool().AddSerializedFile(/' \
		src/modelyard/rpc/oip_v2/grpc_predict_v2_pb2.py
	@grep -q '_descriptor_pool\.DescriptorPool()\.AddSerializedFile(' src/modelyard/rpc/oip_v2/grpc_predict_v2_pb2.py \
		|| { echo "make proto: grpc_predict_v2_pb2.py is not in a private DescriptorPool (protoc's output changed?); fix the sed" >&2; exit 1; }

clean:
	rm -rf $(VENV) .venv-lowest .venv-newest .tools build dist src/*.egg-info .pytest_cache .ruff_cache
