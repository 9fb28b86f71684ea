"""Run `layerctl` as a user would: a subprocess of the installed entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYERCTL = str(Path(sys.executable).with_name("layerctl"))


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def layerctl(*args: str, env: dict[str, str] | None = None, input: bytes | None = None,
             timeout: float = 120) -> Result:
    full_env = dict(os.environ)
    full_env.pop("LAYERSTORE_STORE", None)
    full_env.update(env or {})
    p = subprocess.run([LAYERCTL, *args], input=input, capture_output=True, env=full_env, timeout=timeout)
    return Result(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))


def assert_clean_failure(r: Result, *needles: str) -> None:
    """An expected failure: non-zero exit, exactly one line on stderr, no traceback."""
    assert r.code != 0, r
    assert "Traceback" not in r.err, r.err
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1, r.err
    for n in needles:
        assert n in lines[0], (n, lines[0])
