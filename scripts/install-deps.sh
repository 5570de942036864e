#!/usr/bin/env bash
# Install what freepage needs on Debian 12, idempotently: apt packages, the
# lab's Python venv, the Rust toolchain check.  Safe to run again and again.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv="$repo/.venv"

apt_packages=(
	linux-source-6.12 build-essential flex bison bc libelf-dev libssl-dev
	cpio xz-utils kmod rsync busybox-static python3-venv ccache
	python3-pip valgrind gdb
	# building QEMU 10.0 (qemu/): meson comes from bookworm-backports below
	ninja-build pkg-config libglib2.0-dev libpixman-1-dev libfdt-dev zlib1g-dev
	curl bzip2
	# the arm64 platform: cross compiler and libc for the static KVM selftests
	gcc-aarch64-linux-gnu libc6-dev-arm64-cross
	# the static mm selftests (ksm_tests, migration; mlock-random-test,
	# memfd_secret; the io_uring cases of cow and gup_longterm)
	libnuma-dev libcap-dev liburing-dev
	# `freepage package`: the kernel's bindeb-pkg (debhelper), man pages from
	# --help, lintian; the install test's Debian 12 root (mmdebstrap)
	debhelper help2man lintian mmdebstrap
)
# QEMU 10.0 is the x86 platform: Debian's stock build is the baseline (7.2
# crashes the destination of a migrating guest), the meson it needs to build
# from source is newer than bookworm's; python3-pycotap is a QEMU build dep
# qemu-system-arm (qemu-system-aarch64, the arm64 platform) shares
# qemu-system-common with qemu-system-x86, so it comes from backports too
# libvirt-clients: the host's virsh, which drives the libvirt test's two
# daemons (each runs libvirt 11.3 in a Debian root of its own)
# qemu-utils: qemu-img makes the root disk overlay a migrating Debian guest's
# two ends share
backports_packages=(qemu-system-x86 meson python3-pycotap qemu-system-arm libvirt-clients
	qemu-utils)
backports_min=(10.0 1.5 1.3 10.0 11.3 10.0)

apt_lock=(-o DPkg::Lock::Timeout=900)

installed_version() {
	# a package apt has never seen makes dpkg-query fail: under pipefail
	# and set -e that would end the script, so it only means "not installed"
	{ dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null || true; } |
		sed -n 's/^install ok installed //p'
}

# busybox-static:arm64 for the arm64 initramfs is fetched by the lab with
# `apt-get download` (the package is not Multi-Arch: it cannot be installed
# beside the host's); apt needs the foreign architecture to find it.
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
	if [ "$(id -u)" != 0 ]; then
		echo "install-deps: run as root to add the arm64 dpkg architecture" >&2
		exit 1
	fi
	echo "install-deps: dpkg --add-architecture arm64"
	dpkg --add-architecture arm64
	apt-get "${apt_lock[@]}" update -qq || { echo "install-deps: apt-get update failed" >&2; exit 1; }
fi

missing=()
for p in "${apt_packages[@]}"; do
	[ -n "$(installed_version "$p")" ] || missing+=("$p")
done
missing_bpo=()
for i in "${!backports_packages[@]}"; do
	have=$(installed_version "${backports_packages[$i]}")
	# versions look like 1:10.0.2+ds-2...: compare the upstream part
	upstream=${have#*:}
	if [ -z "$have" ] || ! dpkg --compare-versions "${upstream%%[+~-]*}" ge "${backports_min[$i]}"; then
		missing_bpo+=("${backports_packages[$i]}")
	fi
done
if ((${#missing[@]} + ${#missing_bpo[@]})); then
	if [ "$(id -u)" != 0 ]; then
		echo "install-deps: missing packages: ${missing[*]} ${missing_bpo[*]} (run as root)" >&2
		exit 1
	fi
	bpo=/etc/apt/sources.list.d/freepage-bookworm-backports.sources
	if ((${#missing_bpo[@]})) && ! grep -rqs "bookworm-backports" /etc/apt/sources.list \
		/etc/apt/sources.list.d/; then
		echo "install-deps: adding bookworm-backports ($bpo)"
		cat >"$bpo" <<-'SOURCES'
		Types: deb deb-src
		URIs: http://deb.debian.org/debian
		Suites: bookworm-backports
		Components: main
		Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
		SOURCES
	fi
	echo "install-deps: apt-get install ${missing[*]} ${missing_bpo[*]}"
	apt-get "${apt_lock[@]}" update -qq || { echo "install-deps: apt-get update failed" >&2; exit 1; }
	if ((${#missing[@]})); then
		DEBIAN_FRONTEND=noninteractive apt-get "${apt_lock[@]}" install -y -qq \
			--no-install-recommends "${missing[@]}" >/dev/null ||
			{ echo "install-deps: apt-get install ${missing[*]} failed" >&2; exit 1; }
	fi
	if ((${#missing_bpo[@]})); then
		DEBIAN_FRONTEND=noninteractive apt-get "${apt_lock[@]}" install -y -qq \
			--no-install-recommends -t bookworm-backports "${missing_bpo[@]}" >/dev/null ||
			{ echo "install-deps: apt-get install -t bookworm-backports ${missing_bpo[*]} failed" >&2
			  exit 1; }
	fi
fi

stamp="$venv/.freepage-deps"
want=$(sha256sum "$repo/lab/pyproject.toml" | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
	echo "install-deps: python venv $venv"
	python3 -m venv "$venv"
	"$venv/bin/pip" install -q --upgrade pip
	"$venv/bin/pip" install -q -e "$repo/lab[dev]"
	echo "$want" >"$stamp"
fi

if ! command -v cargo >/dev/null 2>&1 && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
	echo "install-deps: no cargo; installing Debian's rustc/cargo"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cargo rustc clippy rustfmt >/dev/null
fi
exit 0
