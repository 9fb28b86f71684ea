#!/usr/bin/env bash
# Installs the system packages layerstore needs, idempotently: apt runs only when something is missing.
# The mirror is whatever the machine's apt sources name; nothing here names a host.
set -euo pipefail

PACKAGES=(
    fuse3 libfuse3-dev pkg-config gcc
    erofs-utils
    ceph-mon ceph-mgr ceph-osd radosgw ceph-mds ceph-fuse ceph-common
    tar gzip zstd
    runc crun busybox-static
    e2fsprogs mount
    mmdebstrap
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
