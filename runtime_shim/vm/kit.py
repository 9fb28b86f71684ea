"""The guest kit: the kernel and initramfs every microVM and VM sandbox boots.

Built by runtime_shim/vm/guest/build-kit.sh (run by .ci/install.d/guest-kit.sh) into
KIT_DIR/<key>/{vmlinuz, initrd, kit.json}, where KIT_DIR is $LAYERSTORE_GUEST_KIT_DIR, else
/var/cache/layerstore/guest-kit, and <key> is the first 16 hex digits of the sha256 of the lock
file, the guest init, lsguest.c and the build script, concatenated in that order: this module
computes the same key from the same files, so it finds exactly the kit the repo's current
sources build, and reports a missing one instead of booting a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import RuntimeNotAvailable

KIT_DIR_ENV = "LAYERSTORE_GUEST_KIT_DIR"
DEFAULT_KIT_DIR = "/var/cache/layerstore/guest-kit"
HERE = Path(__file__).resolve().parent
LOCK = HERE / "guest-kit.lock"
GUEST = HERE / "guest"
KEYED = (LOCK, GUEST / "init", GUEST / "lsguest.c", GUEST / "build-kit.sh")
BUILD = GUEST / "build-kit.sh"


@dataclass(frozen=True)
class GuestKit:
    kernel: Path
    initrd: Path
    key: str
    info: dict[str, str]

    @property
    def release(self) -> str:
        return self.info.get("release", "")


def kit_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    return Path(os.fspath(explicit) if explicit else os.environ.get(KIT_DIR_ENV) or DEFAULT_KIT_DIR)


def kit_key() -> str:
    """The key of the kit the current sources build (see the module docstring)."""
    h = hashlib.sha256()
    for path in KEYED:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def lock_values() -> dict[str, str]:
    """guest-kit.lock as key -> value (comments and blank lines skipped)."""
    out = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def find_kit(directory: str | os.PathLike[str] | None = None) -> GuestKit:
    """The kit for the current sources, or `RuntimeNotAvailable` saying how to build it."""
    key = kit_key()
    d = kit_dir(directory) / key
    try:
        info = json.loads((d / "kit.json").read_text())
    except (OSError, ValueError):
        raise RuntimeNotAvailable(f"no guest kit {key} in {d.parent}: build it with {BUILD} "
                                  f"(run by .ci/install-deps.sh; ${KIT_DIR_ENV} picks the directory)") from None
    kit = GuestKit(d / "vmlinuz", d / "initrd", key, {str(k): str(v) for k, v in info.items()})
    if not (kit.kernel.is_file() and kit.initrd.is_file()):
        raise RuntimeNotAvailable(f"guest kit {d} is incomplete; remove it and run {BUILD}")
    return kit
