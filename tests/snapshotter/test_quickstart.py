"""The quick start of docs/snapshotter.md, run as written, so the doc cannot drift from the commands.

The test takes the one ```sh block under the "## Quick start" heading, replaces the values of the
variables the block declares at its top (and nothing else) with its own: an ordinary image it
pushed first to a local registry (Debian's docker-registry, plain HTTP on loopback), that registry,
a store, a node directory and a snapshotter socket under its temporary directory, and a
containerd config file. It runs the block with `bash -euo pipefail` (every command must succeed)
and stands in for systemd at the block's `systemctl restart containerd` line: there the block has
written the proxy plugin into the config file, and the test starts a containerd of its own
(testkit.containerd) with the proxy plugins that file declares, then lets the block go on. The
containerd's address and namespace reach `ctr` and `layerctl ctr pull` as `$CONTAINERD_ADDRESS`
and `$CONTAINERD_NAMESPACE`, which the doc names for both.

Then: the container printed what the image's own command prints; the pull mounted every layer
lazily (containerd's content store holds the manifest and the config only); and containerd's own
`ctr images pull` of the pointer image fails, as the doc says.

Processes: bash runs in a session of its own; the snapshotter the block starts in the background
is bash's child, and bash (by an epilogue the test appends) waits for it after the block, so the
test stops it by PID and bash reaps it. If the block fails, the test signals bash's process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from testkit.containerd import Containerd, containerd, needs_containerd
from testkit.oci_registry import needs_registry, oci_registry
from testkit.registry_images import EXPECTED_OUTPUT, push_busybox
from testkit.shim_support import cleanup_node, needs_busybox, needs_runc

DOC = Path(__file__).resolve().parents[2] / "docs" / "snapshotter.md"
HEADING = "## Quick start"
RESTART = "systemctl restart containerd"
VARIABLES = {"IMAGE", "REGISTRY", "STORE", "NODE", "SNAPSHOTTER", "CONTAINERD_CONFIG"}
_DECLARATION = re.compile(r"([A-Z][A-Z0-9_]*)=(\S*)(\s+#.*)?")
BLOCK_TIMEOUT = 900.0  # env create, push, pull and run on a loaded 2-core machine


def quickstart_block(text: str) -> str:
    """The one ```sh block of the quick start section."""
    start = text.index(f"\n{HEADING}")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, f"want one ```sh block under {HEADING!r}, found {len(blocks)}"
    return str(blocks[0])


def declared(block: str) -> dict[str, str]:
    """The variables the block declares at its top (the lines before the first blank one)."""
    out: dict[str, str] = {}
    for line in block.splitlines():
        if not line.strip():
            break
        m = _DECLARATION.fullmatch(line)
        assert m, f"the block's top holds only NAME=value lines, not {line!r}"
        out[m.group(1)] = m.group(2)
    return out


def runnable(block: str, values: dict[str, str], at_restart: str, epilogue: str) -> str:
    """The block with the declared variables' values replaced and the restart line stood in for."""
    assert set(declared(block)) == set(values), (declared(block), values)
    lines = block.splitlines()
    for i, line in enumerate(lines[:len(values)]):
        name = line.split("=", 1)[0]
        lines[i] = f"{name}={shlex.quote(values[name])}"
    restarts = [i for i, line in enumerate(lines) if line.strip() == RESTART]
    assert len(restarts) == 1, f"want one {RESTART!r} line in the quick start"
    lines[restarts[0]] = at_restart
    return "\n".join([*lines, epilogue, ""])


def test_the_block_declares_what_the_test_replaces() -> None:
    block = quickstart_block(DOC.read_text())
    names = declared(block)
    assert set(names) == VARIABLES
    body = block.split("\n\n", 1)[1]
    assert all(f'"${name}' in body for name in names), "a declared variable the commands do not use"
    assert [line for line in block.splitlines() if line.strip() == RESTART] == [RESTART]
    assert "layerctl ctr pull" in body and "ctr run --rm --snapshotter layerstore" in body


# -- the block, run ------------------------------------------------------------------------------
def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


@dataclass
class Block:
    """The quick start running in bash, and the files it signals through: `at_restart` (bash
    reached the restart line; it holds the snapshotter's PID), `go` (the test's: containerd
    runs), `done` (every command of the block succeeded)."""

    run: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def at_restart(self) -> Path:
        return self.run / "at-restart"

    @property
    def go(self) -> Path:
        return self.run / "go"

    @property
    def done(self) -> Path:
        return self.run / "done"

    def output(self) -> str:
        return (self.run / "stdout").read_text(errors="replace")

    def why(self) -> str:
        code = self.proc.poll() if self.proc else None
        return (f"bash exit {code}\nstdout:\n{self.output()[-3000:]}\nstderr (the snapshotter's too):\n"
                f"{(self.run / 'stderr').read_text(errors='replace')[-5000:]}")

    def wait_for(self, path: Path, timeout: float = BLOCK_TIMEOUT) -> None:
        """Until `path` exists; fails the test if bash exits first."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert self.proc.poll() is None or path.exists(), f"the block failed:\n{self.why()}"
            assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout:.0f} s\n{self.why()}"
            time.sleep(0.1)

    def start(self, script: str, env: dict[str, str]) -> None:
        (self.run / "quickstart.sh").write_text(script)
        with open(self.run / "stdout", "wb") as out, open(self.run / "stderr", "wb") as err:
            self.proc = subprocess.Popen(["bash", "-euo", "pipefail", str(self.run / "quickstart.sh")],
                                         stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def stop(self) -> None:
        """Stop the snapshotter (bash's child) by PID, so bash reaps it and exits; what a failed
        block left running gets a signal to bash's process group."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.at_restart.read_text())
            if self.proc.poll() is None and b"snapshotter" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + 30
            while _group(self.proc.pid) and time.monotonic() < deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@contextlib.contextmanager
def started(block: str, values: dict[str, str], run: Path, env: dict[str, str]) -> Iterator[Block]:
    run.mkdir()
    b = Block(run)
    at_restart = (f'echo "$!" > {shlex.quote(str(b.at_restart))}; '
                  f"while [ ! -e {shlex.quote(str(b.go))} ]; do sleep 0.1; done  # the test starts containerd")
    epilogue = f"touch {shlex.quote(str(b.done))}; wait  # (the test's: the snapshotter stays bash's child)"
    try:
        b.start(runnable(block, values, at_restart, epilogue), env)
        yield b
    finally:
        b.stop()


def _environment(containerd_address: str, namespace: str) -> dict[str, str]:
    """This process's environment without what would choose another store, node, containerd or
    metrics port; containerd's address and namespace as `ctr` reads them."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CONTAINERD_") and k not in ("LAYERSTORE_STORE", "LAYERSTORE_NODE_DIR")
           and not k.endswith("_METRICS_LISTEN")}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
               CONTAINERD_ADDRESS=containerd_address, CONTAINERD_NAMESPACE=namespace)
    return env


@pytest.mark.root
@needs_containerd
@needs_registry
@needs_busybox
@needs_runc
@pytest.mark.timeout(2 * BLOCK_TIMEOUT)
def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    block = quickstart_block(DOC.read_text())
    node, config = tmp_path / "node", tmp_path / "containerd-config.toml"
    sock = Path(f"/run/ls-qs-{secrets.token_hex(4)}.sock")  # (a unix socket path: short)
    ctd_root = Path(f"/run/ls-ctd-qs-{secrets.token_hex(4)}")
    namespace = f"lstest-qs-{secrets.token_hex(3)}"
    config.write_text("version = 2\n")
    env = _environment(str(ctd_root / "containerd.sock"), namespace)
    try:
        with oci_registry(tmp_path / "registry") as reg:
            push_busybox(tmp_path / "image", reg.host, "library/busybox", "1")
            values = {"IMAGE": f"docker://{reg.ref('library/busybox', '1')}", "REGISTRY": reg.host,
                      "STORE": str(tmp_path / "store"), "NODE": str(node), "SNAPSHOTTER": str(sock),
                      "CONTAINERD_CONFIG": str(config)}
            with started(block, values, tmp_path / "run", env) as b:
                b.wait_for(b.at_restart)
                plugins = tomllib.loads(config.read_text()).get("proxy_plugins", {})
                snapshotters = {name: p["address"] for name, p in plugins.items() if p.get("type") == "snapshot"}
                assert snapshotters == {"layerstore": str(sock)}, config.read_text()
                with containerd(ctd_root, snapshotters=snapshotters, namespace=namespace) as ctd:
                    b.go.touch()
                    b.wait_for(b.done)
                    _check(b.output(), ctd, pulled_ref(block, values))
    finally:
        cleanup_node(node, tmp_path)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        shutil.rmtree(ctd_root, ignore_errors=True)


def pulled_ref(block: str, values: dict[str, str]) -> str:
    """The reference the block's `layerctl ctr pull` names, with the test's values."""
    m = re.search(r'^layerctl ctr pull "([^"]+)"$', block, flags=re.MULTILINE)
    assert m, "the quick start has no `layerctl ctr pull \"REF\"` line"
    return re.sub(r"\$(\w+)", lambda v: values[v.group(1)], m.group(1))


def _check(out: str, ctd: Containerd, ref: str) -> None:
    assert out.endswith(EXPECTED_OUTPUT), out  # the image's entrypoint, cmd, env, workdir and user
    pulled = [line for line in out.splitlines() if "mounted lazily" in line]
    assert len(pulled) == 1 and "3 layerstore layer(s) mounted lazily, 0 unpacked" in pulled[0], out
    assert len(ctd.ctr("content", "ls", "-q").stdout.split()) == 2  # the manifest and the config only
    # containerd's own pull cannot take a pointer image (the doc's "which pulls are lazy")
    r = ctd.ctr("images", "pull", "--plain-http", "--snapshotter", "layerstore", ref, check=False,
                namespace=f"{ctd.namespace}-ctr")
    assert r.returncode != 0 and "no processor for media-type" in r.stderr, (r.stdout, r.stderr)
