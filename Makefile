# freepage: `make demo` (the baseline measurements) and `make test` (all tests).
# Both install what they need first and can be run again at any time.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
FREEPAGE := $(VENV)/bin/freepage
PY := $(VENV)/bin/python
export PATH := $(HOME)/.cargo/bin:$(PATH)

# Debian packages of the guest kernel, the patched QEMU and vhost-user-balloon
# (docs/operators.md), from the cached builds, lintian-checked, into packages/
.PHONY: all deps host demo packages test-packages test-rt test-debian test test-lab test-guest test-kernel test-qemu test-backend test-boot lint clean

all: test

deps:
	@bash scripts/install-deps.sh

# what the host offers the guests, and why one cannot run, before anything builds
host: deps
	$(FREEPAGE) host

# the demo goes on where the host cannot run a platform: its steps say why
demo: deps
	-$(FREEPAGE) host
	$(FREEPAGE) demo

packages: deps
	$(FREEPAGE) package --out $(CURDIR)/packages

# the packages in a fresh Debian 12 root, booted; libvirt runs the documented
# domain and migrates it between two daemons (both also part of test-boot)
test-packages: deps
	$(VENV)/bin/pytest -q -m slow lab/tests/test_packages_install.py lab/tests/test_libvirt.py

# the series on PREEMPT_RT with lockdep (its own x86_64 kernel build): the
# KUnit suites, reporting and populate without a splat; pre-zeroing is
# compiled out there, so the series builds with it off too
test-rt: deps
	$(VENV)/bin/pytest -q -m gate -k rt_kernel lab/tests/test_never_zero_twice.py

# the Debian 12 guest (cached image, its own kernel build): reporting under file I/O
test-debian: deps
	$(VENV)/bin/pytest -q -m "slow or gate" -k debian lab/tests/test_reporting.py

test: deps host lint test-lab test-guest test-kernel test-qemu test-backend test-boot
	@echo "make test: all passed"

lint: deps
	$(VENV)/bin/ruff check lab
	$(VENV)/bin/mypy lab/freepage_lab
	bash scripts/check-wording.sh

test-lab: deps
	$(VENV)/bin/pytest -q -m "not slow and not gate" lab/tests

test-guest:
	$(MAKE) -s -C guest OUT=$(CURDIR)/guest/build
	sh guest/check-args.sh $(CURDIR)/guest/build

test-kernel: deps
	$(FREEPAGE) series check
	# stock: only UML's, which the boot tests run beside the series; the
	# demo and the gate tests build the other stock kernels they compare
	$(FREEPAGE) build --arch um --vanilla
	$(FREEPAGE) build --arch all

# the QEMU series: each applies on what it requires and is checkpatch.pl
# clean; all of them build (cached); the boot tests run the build
# (migration with bit 6, vhost-user-balloon); QEMU's migration-test passes
# on the build every case it passes on pristine QEMU (also built, cached)
test-qemu: deps
	$(FREEPAGE) qemu check
	$(FREEPAGE) qemu build
	$(FREEPAGE) qemu qtest
	$(FREEPAGE) qemu migration-test

test-backend:
	@if [ -f vhost-user-balloon/Cargo.toml ]; then $(MAKE) -C vhost-user-balloon test; \
	else echo "vhost-user-balloon: not present yet"; fi

test-boot: deps
	$(VENV)/bin/pytest -q -m "slow and not gate" --durations=25 lab/tests

clean:
	rm -rf runs guest/build
