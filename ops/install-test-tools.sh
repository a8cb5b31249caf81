#!/usr/bin/env bash
# Installs what tests/ops needs when it is missing: promtool (Debian package prometheus) and
# systemd-analyze (package systemd). Quiet; does nothing when both are there. Without apt-get
# or root, or when the install fails, it says so on stderr and exits 0: tests/ops then skips
# the checks whose tool is absent, with the reason.
set -u

packages=()
command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || packages+=(systemd)
[ ${#packages[@]} -eq 0 ] && exit 0

sudo=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "install-test-tools: not root, cannot install ${packages[*]}; ops checks will skip" >&2
        exit 0
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-tools: no apt-get, cannot install ${packages[*]}; ops checks will skip" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
install() {
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null 2>&1
}
# The package lists may be missing or stale on a fresh machine: update only when needed.
if ! install && ! { "${sudo[@]}" apt-get update -qq >/dev/null 2>&1 && install; }; then
    echo "install-test-tools: apt-get install ${packages[*]} failed; ops checks will skip" >&2
fi
exit 0
