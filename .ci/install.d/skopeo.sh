#!/usr/bin/env bash
# skopeo (Debian 12: 1.9.3), a real OCI image tool: the registry client's interop tests push with
# it and pull with ours, and the other way round (tests/erofs_builder/test_registry_interop.py).
set -euo pipefail
if dpkg-query -W -f='${Status}' skopeo 2>/dev/null | grep -q "install ok installed"; then
    exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends skopeo >/dev/null
