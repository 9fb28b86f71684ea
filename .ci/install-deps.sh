#!/usr/bin/env bash
# Installs the system packages layerstore needs, idempotently: apt runs only when something is missing.
# The mirror is whatever the machine's apt sources name; nothing here names a host.
set -euo pipefail

PACKAGES=(
    fuse3 libfuse3-dev pkg-config gcc
    erofs-utils
    ceph-mon ceph-mgr ceph-osd radosgw ceph-mds ceph-fuse ceph-common
    tar gzip zstd
    runc crun busybox-static tini
    e2fsprogs mount
    mmdebstrap
    containerd docker-registry
    qemu-system-x86 qemu-utils cpio kmod
    chromium
    prometheus
)

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if ((${#missing[@]})); then
    echo "install-deps: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Each capability that needs more than packages (a guest kernel kit, generated stubs) adds a script
# here; each is idempotent and runs on every `make demo` / `make test`.
for step in "$(dirname "$0")"/install.d/*.sh; do
    [ -e "$step" ] || continue
    bash "$step"
done
