"""The environment every sandbox is composed of: three small layers built with `layerctl build --push`
into a local store and named with `layerctl env create`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .spec import APPLETS, ENV_TAG, LAYERCTL


def make_trees(work: Path) -> dict[str, Path]:
    """base: static busybox + /etc; toolkit: 400 small files under /opt/toolkit; workspace: a 200-file
    repository under /workspace. Small on purpose: composition cost does not depend on layer size."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SystemExit("compose: needs busybox-static (.ci/install-deps.sh)")
    base = work / "trees" / "base"
    (base / "bin").mkdir(parents=True)
    shutil.copy(busybox, base / "bin" / "busybox")
    for a in APPLETS:
        os.symlink("busybox", base / "bin" / a)
    for d in ("etc", "tmp", "proc", "sys", "dev", "root"):
        (base / d).mkdir()
    (base / "etc" / "motd").write_text("base\n")
    (base / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    tk = work / "trees" / "toolkit" / "opt" / "toolkit"
    for i in range(20):
        d = tk / "lib" / f"pkg{i:02d}"
        d.mkdir(parents=True)
        for j in range(20):
            (d / f"mod{j:02d}.py").write_text(f"# toolkit module {i}.{j}\n" * 40)
    (tk / "VERSION").write_text("toolkit 1\n")
    ws = work / "trees" / "workspace" / "workspace"
    for i in range(10):
        d = ws / "src" / f"m{i}"
        d.mkdir(parents=True)
        for j in range(20):
            (d / f"f{j:02d}.py").write_text(f"def f{j}():\n    return {i * 100 + j}\n" * 10)
    (ws / "README.md").write_text("workspace\n")
    return {"base": base, "toolkit": work / "trees" / "toolkit", "workspace": work / "trees" / "workspace"}


def layerctl(*args: str) -> dict[str, Any]:
    p = subprocess.run([LAYERCTL, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"layerctl {' '.join(args[:2])}: {p.stderr.strip()}")
    return json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}


def make_environment(work: Path, trees: dict[str, Path]) -> tuple[str, dict[str, str]]:
    store = str(work / "store")
    layerctl("store", "init", "--store", store)
    blobs = {role: str(layerctl("build", str(t), "--push", "--store", store, "--all-root", "--json")["blob"])
             for role, t in trees.items()}
    layerctl("env", "create", "--store", store, "--base", blobs["base"], "--toolkit", blobs["toolkit"],
             "--workspace", blobs["workspace"], "-t", ENV_TAG, "--json")
    return store, blobs
