"""Headless Chromium (Debian's `chromium` package) for page tests: a screenshot and the DOM as the
browser built it, each from a fresh profile. Chromium runs in its own process group, which is
ended (by its id) if it overruns its deadline."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = "chromium"
# Without the background-networking flags Chromium keeps trying hosts this closed network refuses.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def chromium() -> str | None:
    """The browser's path, or None when it is not installed."""
    return shutil.which(CHROMIUM)


def _run(args: list[str], deadline: float) -> subprocess.CompletedProcess[bytes]:
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("chromium is not installed")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        p = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = p.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the group we started: the browser and its helpers
            p.communicate()
            raise
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def screenshot(url: str, out: Path, *, width: int = 1280, height: int = 1600, deadline: float = 90.0) -> bytes:
    """A PNG of the page at `url` (also written to `out`)."""
    r = _run([f"--screenshot={out}", f"--window-size={width},{height}", url], deadline)
    if r.returncode != 0 or not out.exists():
        why = r.stderr.decode(errors="replace")[-2000:]
        raise RuntimeError(f"chromium --screenshot failed ({r.returncode}): {why}")
    return out.read_bytes()


def dump_dom(url: str, *, deadline: float = 90.0) -> str:
    """The page's DOM, serialized by the browser after it loaded it."""
    r = _run(["--dump-dom", url], deadline)
    if r.returncode != 0:
        raise RuntimeError(f"chromium --dump-dom failed ({r.returncode}): {r.stderr.decode(errors='replace')[-2000:]}")
    return r.stdout.decode()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; ValueError if `data` is not a PNG."""
    if not data.startswith(PNG_MAGIC) or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
