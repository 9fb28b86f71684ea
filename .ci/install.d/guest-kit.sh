#!/usr/bin/env bash
# The guest kit for microVM and VM sandboxes (a pinned Debian kernel and our busybox initramfs),
# built into $LAYERSTORE_GUEST_KIT_DIR (default /var/cache/layerstore/guest-kit) unless the kit for
# the repo's current lock and guest scripts is there already. See docs/vm.md.
set -euo pipefail
exec bash "$(dirname "$0")/../../runtime_shim/vm/guest/build-kit.sh"
