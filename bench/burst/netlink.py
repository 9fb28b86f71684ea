"""The shared link between the node and the store: a network namespace, a veth pair, tc token buckets.

The store side (radosgw and the Ceph daemons) lives in a network namespace of its own; the node side is
the host namespace. Every byte between them crosses one veth pair shaped by a `tbf` qdisc in each
direction, so every contender shares one link of limited bandwidth, and the veth counters on the node
side count what crossed it (frames, so HTTP and TCP overhead included). Counting rules in the store's
namespace split the download by server (`count_sources`: the registry's bytes and the store's).

The addresses are from 198.18.0.0/15, the block reserved for network benchmarks (RFC 2544), and exist only
on the veth pair: nothing routes them anywhere else.

Teardown deletes the namespace (which deletes both ends of the veth). Every link this module creates is
recorded in a state file so that a run that was killed outright is cleaned up by the next one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = 30
SOURCE_TAG = "lsburst-src:"  # the comment of the iptables rules that count bytes per source


def link_addresses(tag: int) -> tuple[str, str]:
    """(node, store) addresses of the /30 that run `tag` uses inside 198.18.0.0/15, so that two runs
    on one machine (a developer's and CI's) never share a subnet."""
    base = (198 << 24) | (18 << 16) | ((tag % (1 << 15)) << 2)
    def dotted(n: int) -> str:
        return ".".join(str((n >> s) & 255) for s in (24, 16, 8, 0))
    return dotted(base + 1), dotted(base + 2)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def qdisc_summary(tc_json: str) -> dict[str, object]:
    """Bytes, packets, drops and overlimits of the first qdisc in `tc -s -j qdisc show` output ({}
    when there is none)."""
    try:
        q = json.loads(tc_json)[0]
        return {"bytes": q.get("bytes"), "packets": q.get("packets"), "drops": q.get("drops"),
                "overlimits": q.get("overlimits")}
    except (ValueError, IndexError, KeyError):
        return {}


def tbf_args(rate_mbit: float) -> list[str]:
    """tc arguments for a token bucket at `rate_mbit`. The bucket must hold what the rate sends in a
    few timer ticks (and at least a few full GSO frames), or the shaper falls short of its rate."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(256 * 1024, int(rate_bytes * 0.004))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "20ms"]


def source_counters(iptables_save: str) -> dict[str, int]:
    """Bytes per source from `iptables-save -c` output: the counting rules `count_sources` added."""
    out: dict[str, int] = {}
    for m in re.finditer(r"^\[(\d+):(\d+)\] -A OUTPUT .*--comment \"?" + re.escape(SOURCE_TAG) + r"([\w-]+)",
                         iptables_save, flags=re.M):
        out[m.group(3)] = out.get(m.group(3), 0) + int(m.group(2))
    return out


@dataclass
class LinkCounters:
    rx_bytes: int  # store -> node, as received on the node side
    tx_bytes: int  # node -> store

    def minus(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.rx_bytes - other.rx_bytes, self.tx_bytes - other.tx_bytes)


class Link:
    """`with Link(state_dir, rate_mbit=1000) as link:` -> namespace `link.netns`, store at `link.store_addr`."""

    def __init__(self, state_dir: Path, *, rate_mbit: float = 1000, tag: str | None = None) -> None:
        self.state_dir = state_dir
        self.rate_mbit = rate_mbit
        tag = tag or f"{os.getpid() % 100000}"
        self.netns = f"lsburst{tag}"
        self.node_if = f"lsbn{tag}"
        self.store_if = f"lsbs{tag}"
        self.node_addr, self.store_addr = link_addresses(int(tag))
        self.up = False

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Link:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        cleanup_stale(self.state_dir)
        self._record()
        try:
            _ip("netns", "add", self.netns)
            _ip("link", "add", self.node_if, "type", "veth", "peer", "name", self.store_if)
            _ip("link", "set", self.store_if, "netns", self.netns)
            _ip("addr", "add", f"{self.node_addr}/{PREFIX}", "dev", self.node_if)
            _ip("link", "set", self.node_if, "up")
            self.ns("ip", "link", "set", "lo", "up")
            self.ns("ip", "addr", "add", f"{self.store_addr}/{PREFIX}", "dev", self.store_if)
            self.ns("ip", "link", "set", self.store_if, "up")
            self.set_rate(self.rate_mbit)
            self.up = True
        except BaseException:
            self.teardown()
            raise

    def set_rate(self, rate_mbit: float) -> None:
        """Shape both directions (the store's egress is the node's download)."""
        self.rate_mbit = rate_mbit
        subprocess.run(["tc", "qdisc", "replace", "dev", self.node_if, "root", *tbf_args(rate_mbit)], check=True)
        self.ns("tc", "qdisc", "replace", "dev", self.store_if, "root", *tbf_args(rate_mbit))

    def teardown(self) -> None:
        teardown_netns(self.netns, self.node_if)
        self._forget()
        self.up = False

    # -- use -----------------------------------------------------------------------------
    def ns(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], capture_output=True, text=True,
                              check=check)

    def ns_argv(self, argv: list[str]) -> list[str]:
        """`argv` to be run inside the store's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def counters(self) -> LinkCounters:
        base = Path("/sys/class/net") / self.node_if / "statistics"
        return LinkCounters(int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text()))

    def count_sources(self, ports: dict[str, int]) -> None:
        """Count the bytes each server (by its TCP port on the store side) sends across the link: one
        iptables rule per source in the store's namespace (gone with it). IP bytes, without the
        Ethernet framing the veth counters include."""
        for name, port in ports.items():
            self.ns("iptables", "-w", "-A", "OUTPUT", "-o", self.store_if, "-p", "tcp", "--sport", str(port),
                    "-m", "comment", "--comment", f"{SOURCE_TAG}{name}")

    def source_bytes(self) -> dict[str, int]:
        """Bytes sent so far per source named to `count_sources` ({} if none)."""
        return source_counters(self.ns("iptables-save", "-c", check=False).stdout)

    def qdisc_stats(self) -> dict[str, object]:
        """Bytes and drops the store-side shaper saw (the download direction)."""
        return qdisc_summary(self.ns("tc", "-s", "-j", "qdisc", "show", "dev", self.store_if, check=False).stdout)

    # -- crash safety --------------------------------------------------------------------
    def _state_file(self) -> Path:
        return self.state_dir / f"link-{self.netns}.json"

    def _record(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps({"netns": self.netns, "node_if": self.node_if, "owner": os.getpid()}))

    def _forget(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._state_file().unlink()


def teardown_netns(netns: str, node_if: str) -> None:
    """Stop what still runs in the namespace (started by us: it is ours by construction), delete it."""
    if _ip("netns", "pids", netns, check=False).returncode == 0:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            end = time.monotonic() + 5
            while pids and time.monotonic() < end:
                pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
                time.sleep(0.05)
            if not pids:
                break
        _ip("netns", "delete", netns, check=False)
    _ip("link", "delete", node_if, check=False)  # normally gone with the namespace


def cleanup_stale(state_dir: Path) -> None:
    """Remove links recorded by runs whose process is gone."""
    if not state_dir.is_dir():
        return
    for f in state_dir.glob("link-*.json"):
        try:
            st = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        owner = int(st.get("owner", 0))
        if owner and owner != os.getpid() and Path(f"/proc/{owner}").exists():
            continue
        teardown_netns(st["netns"], st["node_if"])
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
