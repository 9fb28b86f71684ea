"""What hostile-sandbox tests plant and look for: a host directory whose content must never reach
a committed layer."""

from __future__ import annotations

import os
from pathlib import Path

SECRET = b"HOST-SECRET-" + os.urandom(8).hex().encode()


def host_dir(tmp_path: Path) -> Path:
    """A host directory: `f` and `big` (2 MiB) hold SECRET."""
    h = tmp_path / "host"
    h.mkdir()
    (h / "f").write_bytes(SECRET)
    (h / "big").write_bytes(SECRET * ((2 << 20) // len(SECRET)))
    return h
