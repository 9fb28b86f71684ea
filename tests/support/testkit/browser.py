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


# -- the DevTools protocol, over a pipe ---------------------------------------------------------------
# `--remote-debugging-pipe`: Chromium reads commands from its fd 3 and writes answers and events to
# its fd 4, each a JSON text ended by a NUL byte (no WebSocket, no port, nothing to install). A small
# Python stub puts our pipe ends on fds 3 and 4 and execs the browser (no preexec_fn: the tests that
# use this run a service in a thread of this process).
_EXEC_ON_3_4 = ("import fcntl, os, sys; a, b = (fcntl.fcntl(int(f), fcntl.F_DUPFD, 10) for f in sys.argv[1:3]); "
                "os.dup2(a, 3); os.dup2(b, 4); os.execv(sys.argv[3], sys.argv[3:])")


class DevTools:
    """One headless Chromium driven through the DevTools protocol, with one page (tab):
    `navigate`, `evaluate`, `cookies`. Ended (its process group) on `close` or exit."""

    def __init__(self, deadline: float = 90.0) -> None:
        import json
        import sys
        import time

        self._json, self._time = json, time
        exe = chromium()
        if exe is None:
            raise FileNotFoundError("chromium is not installed")
        self.deadline = time.monotonic() + deadline
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _EXEC_ON_3_4, str(to_browser_r), str(from_browser_w), exe, *FLAGS,
                 f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe", "about:blank"],
                pass_fds=(to_browser_r, from_browser_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            os.close(to_browser_r)
            os.close(from_browser_w)
        self._buf = b""
        self._next = 0
        self.events: list[dict] = []
        try:
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            self.call("Page.enable", session=True)
            self.call("Network.enable", session=True)
        except BaseException:
            self.close()
            raise

    def _send(self, msg: dict) -> None:
        data = self._json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._to_browser, data):]

    def _receive(self) -> dict:
        import select

        while b"\0" not in self._buf:
            left = self.deadline - self._time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("chromium did not answer before the test's deadline")
            part = os.read(self._from_browser, 1 << 16)
            if not part:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buf += part
        msg, _, self._buf = self._buf.partition(b"\0")
        return self._json.loads(msg)

    def call(self, method: str, params: dict | None = None, *, session: bool = False) -> dict:
        """Send one command and wait for its answer (events that come first are kept)."""
        self._next += 1
        msg: dict = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self._send(msg)
        while True:
            got = self._receive()
            if got.get("id") == self._next:
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                return got.get("result", {})
            self.events.append(got)

    def wait_event(self, method: str) -> dict:
        """The first event `method` not yet consumed (waiting for it if needed)."""
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._receive())

    def navigate(self, url: str) -> None:
        """Open `url` in the page and wait until it loaded."""
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        self.call("Page.navigate", {"url": url}, session=True)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str, *, await_load: bool = False) -> object:
        """The value of a JavaScript expression in the page; `await_load`: it navigates the page
        (a form submitted): wait for the next page to load."""
        if await_load:
            self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        got = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        if "exceptionDetails" in got:
            raise RuntimeError(f"{expression[:80]}: {got['exceptionDetails']}")
        if await_load:
            self.wait_event("Page.loadEventFired")
        return got.get("result", {}).get("value")

    def cookies(self, url: str) -> list[dict]:
        """The browser's cookies for `url`, HttpOnly ones included (as DevTools sees them)."""
        return self.call("Network.getCookies", {"urls": [url]}, session=True)["cookies"]

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group we started: browser and helpers
            self.proc.wait()
        finally:
            os.close(self._to_browser)
            os.close(self._from_browser)
            self._profile.cleanup()

    def __enter__(self) -> DevTools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
