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
)

missing=()
for p in "${apt_packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
		missing+=("$p")
done
if ((${#missing[@]})); then
	if [ "$(id -u)" != 0 ]; then
		echo "install-deps: missing packages: ${missing[*]} (run as root)" >&2
		exit 1
	fi
	echo "install-deps: apt-get install ${missing[*]}"
	apt-get update -qq || { echo "install-deps: apt-get update failed" >&2; exit 1; }
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		"${missing[@]}" >/dev/null ||
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
