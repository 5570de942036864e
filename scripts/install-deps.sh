#!/usr/bin/env bash
# Install what freepage needs on Debian 12, idempotently: apt packages, the
# lab's Python venv, the Rust toolchain check.  Safe to run again and again.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv="$repo/.venv"

apt_packages=(
	linux-source-6.12 build-essential flex bison bc libelf-dev libssl-dev
	cpio xz-utils kmod rsync busybox-static qemu-system-x86 python3-venv ccache
	python3-pip valgrind gdb
	# the arm64 platform: cross compiler, libc for the static KVM selftests,
	# qemu-system-aarch64 (from the same backports as qemu-system-x86 when
	# that one comes from there: the two share qemu-system-common)
	gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-system-arm
)

missing=()
for p in "${apt_packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
		missing+=("$p")
done
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
	apt-get update -qq || { echo "install-deps: apt-get update failed" >&2; exit 1; }
fi

if ((${#missing[@]})); then
	if [ "$(id -u)" != 0 ]; then
		echo "install-deps: missing packages: ${missing[*]} (run as root)" >&2
		exit 1
	fi
	echo "install-deps: apt-get install ${missing[*]}"
	apt-get update -qq || { echo "install-deps: apt-get update failed" >&2; exit 1; }
	backports=()
	# qemu-system-arm must match qemu-system-common, which may be a backport
	if dpkg-query -W -f='${Version}' qemu-system-common 2>/dev/null | grep -q bpo; then
		backports=(-t "$(. /etc/os-release && echo "$VERSION_CODENAME")-backports")
	fi
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		"${backports[@]}" "${missing[@]}" >/dev/null ||
		{ echo "install-deps: apt-get install ${missing[*]} failed" >&2; exit 1; }
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
