# Everything a fresh Debian machine of our kind needs: `make demo`, `make test`.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
# System packages: libvirt (daemon, test driver, headers for libvirt-python), QEMU for real
# guest memory layouts, xmllint for virt-xml-validate, umockdev (+ its GObject introspection
# data and python3-gi, which the uevent test's testbed API needs) for uevent tests, etcd-server
# for the cluster registry (tests start a private etcd), etcd-client for the etcdctl that runs
# the users-and-roles script 'vmlend registry roles' prints (the auth test runs it), openssl to
# make the TLS test's certificates, graphviz to check and draw the fabric's and paths' pictures
# (tests, make pictures); Debian's packaging tools and python3-venv/-dev for 'make deb' (its
# own virtualenv, libvirt-python compiled into it), debootstrap for the test that installs the
# package into a clean bookworm root (tests/scenarios/test_debian_package.py).
APT_PKGS := libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients libvirt-dev \
            pkg-config qemu-system-x86 libxml2-utils umockdev \
            python3-gi gir1.2-umockdev-1.0 etcd-server etcd-client openssl graphviz \
            debhelper dh-virtualenv dpkg-dev python3-venv python3-dev debootstrap
DEMO_DIR := $(CURDIR)/.demo

.PHONY: all demo test test-fast test-kernel test-kernel-backports lint bench pictures man sysdeps venv clean promtool deb

all: test

sysdeps:
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "missing system packages (run as root or install):" $$missing >&2; exit 1; fi; \
	  echo "installing system packages:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: sysdeps $(VENV)/.installed

# mypy: strict over vmlend/ and kernel-tier/resolve.py ([tool.mypy] in pyproject.toml); ~3 s
# cold, <1 s with .mypy_cache.
lint: venv
	$(VENV)/bin/ruff check vmlend tests bench hooks kernel-tier
	$(VENV)/bin/mypy

# Bytecode written here too (see test-fast): the suite starts thousands of Python processes
# (the simulated nodes' hooks, CLI calls, agents), each compiling what it imports without it.
# Two passes, which between them run every test once: the tests that start no daemon and are
# not 'slow' on two xdist workers (test-fast's set, with every hypothesis example), then the
# daemon and slow ones in one process, where the faults they time (the nemesis, agent
# restarts, QEMU and libvirtd) have the machine as before (docs/testing.md). Both always run.
test: venv lint promtool
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist worksteal -m 'not daemon and not slow' \
	  --durations=10; first=$$?; \
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m 'daemon or slow' --durations=25; second=$$?; \
	test $$first -eq 0 -a $$second -eq 0

# The kernel tier (docs/testing.md): Debian's 6.1 kernel with VFIO, the mdev core and a stand-in
# for the SmartIO driver (kernel-tier/smartio_stub.c, the kernel's mtty sample as its mdev
# parent), booted under QEMU (TCG) with an emulated IOMMU; tests/kernel runs inside it against
# the real sysfs. Downloads and builds are cached under $(KERNEL_BUILD).
KERNEL_BUILD ?= build/kernel
KERNEL_TESTS ?= tests/kernel
KERNEL_APT_PKGS := gcc-12 make libc6-dev file patch qemu-system-x86
test-kernel: venv
	@missing=$$(for p in $(KERNEL_APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	bash kernel-tier/run.sh $(KERNEL_BUILD) -q -m kernel --durations=8 $(KERNEL_TESTS)

# The backports tier (docs/testing.md): Linux 6.12, QEMU 10 and libvirt 11.3 from Debian's
# bookworm-backports, through a private apt under $(KERNEL_BPO_BUILD), never installed on the
# host; one guest live-migrates an mdev VM. Its own build dir and time budget.
KERNEL_BPO_BUILD ?= build/kernel-bpo
KERNEL_BPO_TESTS ?= tests/kernel
test-kernel-backports: venv
	@missing=$$(for p in $(KERNEL_APT_PKGS) xz-utils debian-archive-keyring; do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	bash kernel-tier/backports/run.sh $(KERNEL_BPO_BUILD) -q -m backports --durations=8 $(KERNEL_BPO_TESTS)

# The tests that start no daemon (etcd, libvirtd, QEMU, the agent) and signal no process
# (tests/support/daemon_marks.py keeps the 'daemon' mark honest), and are not 'slow'.
# Bytecode is written even where the environment sets PYTHONDONTWRITEBYTECODE (our machines
# do): without it every run, and every Python subprocess a test starts, compiles vmlend and
# rewrites the ~300 test modules from source again: ~11 s CPU of pytest's collection alone
# (13.5 s -> 2.5 s user, issue 34). The .pyc files are caches that .gitignore already keeps out.
# Two workers (pytest-xdist), one per core of our machines; worksteal because a few
# hypothesis tests take seconds while most take milliseconds. Only this tier: whether the
# full one ('make test', CI) is not xdist-clean yet: 59 failures on two workers (docs/testing.md).
# Hypothesis's 'fast' profile (tests/support/hypothesis_tiers.py): a fifth of every
# property's and state machine's examples, as deep; 'make test' runs them all.
test-fast: venv
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist worksteal -m 'not daemon and not slow' \
	  --hypothesis-profile=fast

demo: venv
	rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	VMLEND_STATE=$(DEMO_DIR)/state.db $(VENV)/bin/vmlend demo

# The pictures in docs/pictures, drawn again from a fresh simulated cluster.
pictures: venv
	VMLEND=$(CURDIR)/$(VENV)/bin/vmlend sh docs/pictures/draw.sh

# promtool, Prometheus's rule checker, for the tests of the shipped alert rules and dashboard
# (tests/unit/data/test_monitoring.py runs this target when it finds no promtool): Debian's
# prometheus package carries it, so the binary is taken out of the .deb (apt-get download +
# dpkg-deb, as the kernel tier's fetch does); no server is installed or started. Cached under
# $(PROMTOOL_DIR); a fresh machine fetches 19 MB once. Fetched in a directory of its own and
# moved into place, so an interrupted or concurrent run never leaves half a binary.
PROMTOOL_DIR ?= build/promtool
PROMTOOL := $(PROMTOOL_DIR)/usr/bin/promtool
promtool: $(PROMTOOL)

$(PROMTOOL):
	@mkdir -p $(PROMTOOL_DIR) && tmp=$$(mktemp -d $(PROMTOOL_DIR)/fetch.XXXXXX) && \
	trap 'rm -rf "$$tmp"' EXIT && \
	{ (cd "$$tmp" && apt-get download -q -o APT::Sandbox::User=root prometheus >/dev/null) || \
	  { echo "promtool: apt-get download prometheus failed (run apt-get update?)" >&2; exit 1; }; } && \
	dpkg-deb --fsys-tarfile "$$tmp"/prometheus_*.deb | tar -x -C "$$tmp" ./usr/bin/promtool && \
	mkdir -p $(@D) && mv "$$tmp/usr/bin/promtool" $@ && \
	echo "promtool: $$($@ --version 2>&1 | head -1)"

# The Debian package (debian/, docs/packaging.md): $(DEB_BUILD)/vmlend_<version>_<arch>.deb,
# built by dpkg-buildpackage from a copy of the checkout's files (git's, uncommitted changes
# included; not .venv or build/), so the tree stays clean and the outputs land in $(DEB_BUILD).
# Built again only when a file the package is made of (the code, debian/, the man pages, the
# project's metadata) is newer than the last build ($(DEB_STAMP)).
# Needs the network: dh-virtualenv pip-installs vmlend's dependencies into the package.
DEB_BUILD ?= build/deb
DEB_STAMP := $(DEB_BUILD)/.built
DEB_SOURCES := $(filter vmlend/% debian/% docs/man/% setup.cfg pyproject.toml README.md, \
                 $(wildcard $(shell git ls-files --cached --others --exclude-standard 2>/dev/null)))
deb: $(DEB_STAMP)

$(DEB_STAMP): $(DEB_SOURCES) | sysdeps
	rm -rf $(DEB_BUILD)/vmlend $(DEB_BUILD)/vmlend*_* $@ && mkdir -p $(DEB_BUILD)/vmlend
	git ls-files -z --cached --others --exclude-standard | \
	  tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -x -C $(DEB_BUILD)/vmlend
	cd $(DEB_BUILD)/vmlend && dpkg-buildpackage -us -uc -b
	rm -rf $(DEB_BUILD)/vmlend
	@ls $(DEB_BUILD)/vmlend_*.deb
	touch $@

# One man page per command in docs/man, rendered from the click commands.
man: venv
	rm -f docs/man/*.1 && $(PY) docs/man/generate.py docs/man >/dev/null

# Every benchmark, each printing ratios measured side by side in one run (~3 min on 2 cores).
# Not bench/bench_scale.py (fabrics of up to 1,024 nodes: minutes; run it by hand).
bench: venv
	@for b in bench/bench_*.py; do \
	  [ "$$b" = bench/bench_scale.py ] && continue; \
	  echo "== $$b"; start=$$(date +%s); \
	  $(PY) $$b || exit 1; \
	  echo "== $$b took $$(( $$(date +%s) - start )) s"; \
	done

clean:
	rm -rf $(VENV) $(DEMO_DIR) *.egg-info .pytest_cache .ruff_cache .mypy_cache
