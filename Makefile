# One entry point for humans and CI. Every target bootstraps .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The security scanner `make test` runs on deploy/ and on injected pods
# (tests/webhook/test_scanner.py), pinned. Its own venv: checkov pins boto3 and
# others to versions the project's constraints.txt does not allow.
CHECKOV_VERSION := 3.3.30
SCANNER_VENV := .venv-checkov
SCANNER := $(SCANNER_VENV)/.installed-$(CHECKOV_VERSION)
# torchtitan, for its trainer in the end-to-end tests (tests/e2e/test_torchtitan.py). Without
# its own pins: it caps `datasets` below the version TRL needs. What its trainer imports is
# in the dev extra (triton, tyro, torchdata, spmd_types, einops, tensorboard).
TORCHTITAN := torchtitan==0.3.0
# DeepSpeed, for its ZeRO runs in the end-to-end tests (HF's Trainer with ZeRO 2 and 3), from
# its source distribution with no compiled ops (DS_BUILD_OPS=0: on a CPU it trains with gloo
# through its CPU accelerator). Its setup imports torch, so it is built against the torch
# installed here (--no-build-isolation); the constraints keep that torch.
DEEPSPEED := deepspeed==0.19.8
# The environment's bin first on PATH, as in an activated venv and in the demo's pods, for
# every test process: DeepSpeed compiles its CPU communication op (shm) on first use with
# whichever `ninja` PATH finds, and a build made by another ninja is built again (25 s
# alone, minutes under the suite's load), so the whole suite must find the same one.
VENV_PATH = PATH=$(abspath $(BIN)):$$PATH

.PHONY: setup controlplane test test-quick lint typecheck typecheck-project typecheck-shim unit golden demo bench docs images images-deps images-check clean

setup: $(STAMP) $(SCANNER)

# Re-install only when the dependency definitions change (idempotent).
# torch==2.13.0 is named first so pip takes the CPU build (no multi-GB CUDA download).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(TORCHTITAN)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-build-isolation -c constraints.txt $(DEEPSPEED)
	# Its shm op, compiled once here (into the user's torch extensions cache) rather than
	# inside the first DeepSpeed test, where the other tests' load makes it minutes.
	$(VENV_PATH) $(BIN)/python -c 'from deepspeed.accelerator import get_accelerator; \
		get_accelerator().create_op_builder("ShareMemCommBuilder").load()'
	touch $(STAMP)

$(SCANNER): Makefile
	test -x $(SCANNER_VENV)/bin/python || $(PYTHON) -m venv $(SCANNER_VENV)
	$(SCANNER_VENV)/bin/python -m pip install -q 'checkov==$(CHECKOV_VERSION)'
	touch $(SCANNER)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The second run holds the shim to its promise, Python 3.9 and the standard
# library alone (no site-packages: torch and transformers are the user's).
# Two targets, so that `make -j2` runs them side by side (each keeps its own cache).
typecheck: typecheck-project typecheck-shim
typecheck-project: setup
	$(BIN)/mypy
typecheck-shim: setup
	$(BIN)/mypy --python-version 3.9 --no-site-packages --no-warn-unused-ignores shim

unit: setup
	$(VENV_PATH) $(BIN)/pytest -m 'not slow' $(PYTEST_ARGS)

# The suite in two workers (pytest-xdist): most of a test's time is one process starting
# (torch, transformers) on one core, so a second worker fills the other. Tests that share
# an expensive fixture carry one xdist_group, so it is built once. Then the tests marked
# `serial` (they load every CPU, or time a short wait), alone.
# The tests under tests/images run the images images-check built (JITCKPT_IMAGES).
# A part that PYTEST_ARGS leaves empty is no failure (pytest's exit status 5: no tests ran).
PYTEST_WORKERS ?= 2
PARALLEL = -n $(PYTEST_WORKERS) --dist loadgroup
PYTEST_PART = $(VENV_PATH) JITCKPT_IMAGES=$(abspath $(IMAGES_OUT)) \
	JITCKPT_CONTROLPLANE_CACHE=$(CONTROLPLANE_CACHE) $(BIN)/pytest
# The checks before the tests are independent and mostly one core each: two at a time.
test:
	$(MAKE) -j2 --output-sync=target lint typecheck images-check controlplane
	$(PYTEST_PART) $(PARALLEL) -m 'not serial' $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PYTEST_PART) -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The inner loop, not what CI runs: lint, types and the tests that need no training run
# and no pod (the webhook, the sidecar in-process, the shim's units and protocol).
QUICK_TESTS = tests/webhook tests/sidecar tests/shim/test_units.py tests/shim/test_layout.py \
	tests/shim/test_protocol_recorded.py tests/shim/test_reshard.py tests/shim/test_datareplay.py \
	tests/shim/test_hidden_state.py tests/docs
test-quick:
	$(MAKE) -j2 --output-sync=target lint typecheck
	$(VENV_PATH) $(BIN)/pytest $(PARALLEL) -m 'not slow and not serial' $(QUICK_TESTS) $(PYTEST_ARGS)

# Regenerate every golden file after an intended change of output, in one run:
# the injector's pods and results and the CLI's whole-command outputs (every
# test that compares with a golden is marked `golden`, see tests/webhook/conftest.py).
golden: setup
	$(BIN)/pytest -q -m golden --update-golden tests/webhook

demo: setup
	$(BIN)/jitckpt demo

# The control plane the tests under tests/controlplane run: etcd, kube-apiserver and its
# controllers, the job controllers (Kueue, the training-operator, the Trainer, JobSet), and
# helm for the chart in deploy/helm (tests/webhook/test_helm.py), built from the Go module
# proxy at the versions tools/controlplane/go.mod (and each component's own) pins into a cache
# outside the checkout (CONTROLPLANE_CACHE/<component>-<version>/), at the lowest priority;
# a no-op (no Go needed) once a machine has them. Not part of setup: the demo needs no Go.
# What the first build costs: README.md, "Development".
CONTROLPLANE_CACHE ?= $(IMAGES_CACHE)/controlplane
controlplane:
	JITCKPT_CONTROLPLANE_CACHE=$(CONTROLPLANE_CACHE) tools/controlplane/build.sh

# The docs site (mkdocs.yml, docs/) into site/. Its reference pages and compatibility matrix
# are generated from the code at every build (tools/docsgen); --strict fails on any warning,
# a broken link or a name the code defines that no page explains. `make test` builds it too
# (tests/docs). `python -m`: the hook imports tools/ from the repository root.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

bench: setup controlplane
	$(BIN)/python -m bench.run_all

# Build both images and push them: make images REGISTRY=registry.example.com/ml [VERSION=...]
# gives $(REGISTRY)/jitckpt-webhook:$(VERSION) and $(REGISTRY)/jitckpt-sidecar:$(VERSION),
# VERSION the project's by default. docker, else podman, else buildah (CONTAINER_ENGINE=...
# to choose). Both are built before either is pushed, the sidecar pushed first: a webhook
# must never name a sidecar image that is not there. buildah needs no daemon: it builds
# as images-check does (a Python base from Debian's packages), then pushes.
# Then it records the digests the registry gave them: deploy/base (PIN_DIR) pins both
# images by digest (kustomization.yaml's images: entry, configmap.yaml's sidecar_image),
# and so does the Helm chart (CHART_PIN_DIR: values.yaml's webhookImage and sidecarImage).
# docs/platform/install.md, "Images", says more.
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
CONTAINER_ENGINE ?= $(shell command -v docker || command -v podman || command -v buildah)
IMAGE_PREFIX = $(patsubst %/,%,$(REGISTRY))/jitckpt
PIN_DIR ?= deploy/base
CHART_PIN_DIR ?= deploy/helm/jitckpt
# Where images-check links the exported images (each an OCI layout and its root directory);
# the build cache (base image, buildah storage, exports) is outside the checkout.
IMAGES_OUT ?= build/images
IMAGES_CACHE ?= /var/cache/jitckpt
# The digest the registry gave image $(1) (part $(2)) on push, e.g. sha256:ab12...:
# buildah writes it to a file at push time, docker and podman keep it as a RepoDigest.
ifeq ($(notdir $(CONTAINER_ENGINE)),buildah)
digest_of = d=$$(cat $(IMAGES_OUT)/$(2).digest) \
	&& case "$$d" in sha256:*) ;; *) echo "make images: no digest for $(1)" >&2; exit 1 ;; esac
else
digest_of = d=$$($(CONTAINER_ENGINE) image inspect --format '{{index .RepoDigests 0}}' $(1)) \
	&& d=$${d\#*@} && case "$$d" in sha256:*) ;; *) echo "make images: no digest for $(1)" >&2; exit 1 ;; esac
endif

images:
	@test -n "$(REGISTRY)" || { echo "make images: set REGISTRY, where to push (e.g. make images REGISTRY=registry.example.com/ml)" >&2; exit 2; }
	@test -n "$(VERSION)" || { echo "make images: no VERSION given and none found in pyproject.toml" >&2; exit 2; }
	@test -n "$(CONTAINER_ENGINE)" || { echo "make images: none of docker, podman or buildah is installed (or set CONTAINER_ENGINE)" >&2; exit 2; }
ifeq ($(notdir $(CONTAINER_ENGINE)),buildah)
	$(PYTHON) -m tools.images --out $(IMAGES_OUT) --cache $(IMAGES_CACHE) --push-prefix $(IMAGE_PREFIX) --version $(VERSION)
else
	$(CONTAINER_ENGINE) build -f Dockerfile.webhook -t $(IMAGE_PREFIX)-webhook:$(VERSION) .
	$(CONTAINER_ENGINE) build -f Dockerfile.sidecar -t $(IMAGE_PREFIX)-sidecar:$(VERSION) .
	$(CONTAINER_ENGINE) push $(IMAGE_PREFIX)-sidecar:$(VERSION)
	$(CONTAINER_ENGINE) push $(IMAGE_PREFIX)-webhook:$(VERSION)
endif
	@$(call digest_of,$(IMAGE_PREFIX)-sidecar:$(VERSION),sidecar) && \
	sed -i "s|^\(    sidecar_image: \).*|\1$(IMAGE_PREFIX)-sidecar:$(VERSION)@$$d|" $(PIN_DIR)/configmap.yaml && \
	sed -i "s|^\(sidecarImage: \).*|\1$(IMAGE_PREFIX)-sidecar:$(VERSION)@$$d|" $(CHART_PIN_DIR)/values.yaml
	@$(call digest_of,$(IMAGE_PREFIX)-webhook:$(VERSION),webhook) && \
	sed -i -e "s|^\(    newName: \).*|\1$(IMAGE_PREFIX)-webhook|" -e "s|^\(    newTag: \).*|\1$(VERSION)|" \
		-e "s|^\(    digest: \).*|\1$$d|" $(PIN_DIR)/kustomization.yaml && \
	sed -i -e "s|^\(  repository: \).*|\1$(IMAGE_PREFIX)-webhook|" -e "s|^\(  tag: \).*|\1\"$(VERSION)\"|" \
		-e "s|^\(  digest: \).*|\1$$d|" $(CHART_PIN_DIR)/values.yaml
	@echo "pushed, and pinned by digest in $(PIN_DIR) (kustomization.yaml, configmap.yaml) and $(CHART_PIN_DIR)/values.yaml"

# buildah and debootstrap from Debian's packages, where they are missing (as root).
images-deps:
	@command -v buildah >/dev/null && command -v debootstrap >/dev/null || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah debootstrap; }

# Both images built from the Dockerfiles as they are, with no daemon and no registry,
# exported for tests/images (cached under IMAGES_CACHE while nothing that built them changes).
images-check: images-deps
	$(PYTHON) -m tools.images --out $(IMAGES_OUT) --cache $(IMAGES_CACHE)

clean:
	rm -rf $(VENV) $(SCANNER_VENV) .mypy_cache .ruff_cache .pytest_cache
