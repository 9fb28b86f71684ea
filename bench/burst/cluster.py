"""Many nodes, one store, one shaped link: network namespaces, a bridge, veth pairs, one token bucket.

    link namespace lsbl<tag>: the store (Ceph, radosgw on the bridge's address) and bridge lsbr0
        |-- lsp<tag>x<i>  <veth>  lsv<tag>x<i> in node namespace lsbn<tag>x<i>   (one per node)
        `-- lsbk<tag>     <veth>  lsbh<tag> in the host namespace                 (set-up traffic only)

The store's egress to every node leaves through the bridge device, whose root qdisc is one `tbf` at
the link rate: every node shares it, as the nodes of a cluster share the store's uplink. The request
direction (nodes -> store: small requests) is not shaped. Frames bridged between two ports do not pass
the bridge device's qdisc, but nodes never talk to each other.

Addresses are from 198.18.0.0/15 (RFC 2544, benchmark networks; `netlink.py` uses 198.18/16 for the
one-node link, this module 198.19/16): 198.19.<run>.1 the store, .2 the host, .10+i node i.

Every namespace this module creates is recorded in a state file, so that a run that was killed
outright is cleaned up by the next one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .netlink import LinkCounters, qdisc_summary, tbf_args, teardown_netns

BRIDGE = "lsbr0"
MAX_NODES = 200


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def subnet_octet(tag: int) -> int:
    return tag % 250 + 1


@dataclass(frozen=True)
class NodeNet:
    index: int
    netns: str  # the node's network namespace
    ifname: str  # its end of the veth pair, inside netns
    peer: str  # the bridge's end, in the link namespace
    addr: str


def parse_link_stats(text: str) -> dict[str, tuple[int, int]]:
    """`ip -s -j link show` output -> {ifname: (rx_bytes, tx_bytes)}. Pure, for tests."""
    out: dict[str, tuple[int, int]] = {}
    for d in json.loads(text or "[]"):
        st = d.get("stats64") or d.get("stats") or {}
        with contextlib.suppress(KeyError, TypeError):
            out[d["ifname"]] = (int(st["rx"]["bytes"]), int(st["tx"]["bytes"]))
    return out


class ClusterLink:
    def __init__(self, state_dir: Path, *, rate_mbit: float = 1000, tag: str | None = None) -> None:
        self.state_dir = state_dir
        self.rate_mbit = rate_mbit
        self.tag = tag or f"{os.getpid() % 100000}"
        self.netns = f"lsbl{self.tag}"
        self.host_if = f"lsbh{self.tag}"
        self.host_peer = f"lsbk{self.tag}"
        self._set_subnet(subnet_octet(int(self.tag)))
        self.nodes: list[NodeNet] = []
        self.up = False

    def _set_subnet(self, octet: int) -> None:
        self.prefix = f"198.19.{octet}"
        self.store_addr = f"{self.prefix}.1"
        self.host_addr = f"{self.prefix}.2"

    def _pick_free_subnet(self) -> None:
        """Another run on this machine may hold our /24 on its host port: take the next free one."""
        used = _ip("-4", "-o", "addr", "show", check=False).stdout
        start = int(self.prefix.rsplit(".", 1)[1])
        for k in range(250):
            octet = (start - 1 + k) % 250 + 1
            if f" 198.19.{octet}." not in used:
                self._set_subnet(octet)
                return
        raise RuntimeError("no free /24 in 198.19.0.0/16 for the cluster link")

    # -- lifecycle -----------------------------------------------------------------------
    def setup(self) -> None:
        cleanup_stale(self.state_dir)
        self._pick_free_subnet()
        self._record()
        try:
            _ip("netns", "add", self.netns)
            self.ns("ip", "link", "set", "lo", "up")
            self.ns("ip", "link", "add", BRIDGE, "type", "bridge")
            self.ns("ip", "addr", "add", f"{self.store_addr}/24", "dev", BRIDGE)
            self.ns("ip", "link", "set", BRIDGE, "up")
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.host_peer, "netns", self.netns)
            _ip("addr", "add", f"{self.host_addr}/24", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            self.ns("ip", "link", "set", self.host_peer, "master", BRIDGE, "up")
            self.set_rate(self.rate_mbit)
            self.up = True
        except BaseException:
            self.teardown()
            raise

    def set_rate(self, rate_mbit: float) -> None:
        """One token bucket on the bridge: the store's egress to every node together."""
        self.rate_mbit = rate_mbit
        self.ns("tc", "qdisc", "replace", "dev", BRIDGE, "root", *tbf_args(rate_mbit))

    def set_nodes(self, n: int) -> list[NodeNet]:
        """Exactly `n` node namespaces, fresh (the previous ones, and anything left in them, go)."""
        if not 0 <= n <= MAX_NODES:
            raise ValueError(f"nodes must be 0..{MAX_NODES}, not {n}")
        self._drop_nodes()
        for i in range(n):
            node = NodeNet(i, f"lsbn{self.tag}x{i}", f"lsv{self.tag}x{i}", f"lsp{self.tag}x{i}",
                           f"{self.prefix}.{10 + i}")
            self.nodes.append(node)
            self._record()
            _ip("netns", "add", node.netns)
            _ip("link", "add", node.ifname, "netns", node.netns, "type", "veth", "peer", "name", node.peer,
                "netns", self.netns)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", node.ifname, "up")
            self.ns("ip", "link", "set", node.peer, "master", BRIDGE, "up")
        return list(self.nodes)

    def _drop_nodes(self) -> None:
        for node in self.nodes:
            teardown_netns(node.netns, node.ifname)
        self.nodes = []
        self._record()

    def teardown(self) -> None:
        self._drop_nodes()
        teardown_netns(self.netns, self.host_if)
        self._forget()
        self.up = False

    # -- use -----------------------------------------------------------------------------
    def ns(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], capture_output=True, text=True,
                              check=check)

    def ns_argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside the link (store) namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def node_argv(self, index: int, argv: list[str]) -> list[str]:
        """`argv` run in node `index`'s network namespace only. Not `ip netns exec`: that also makes a
        private mount namespace with a fresh /sys, which hides /sys/fs/cgroup from runc and the node's
        mounts from the orchestrator."""
        return ["nsenter", f"--net=/run/netns/{self.nodes[index].netns}", "--", *argv]

    def counters(self) -> LinkCounters:
        """The host port (set-up traffic: uploads and pushes)."""
        base = Path("/sys/class/net") / self.host_if / "statistics"
        return LinkCounters(int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text()))

    def port_stats(self) -> dict[str, tuple[int, int]]:
        """{ifname: (rx, tx)} of every port in the link namespace, the bridge included. A node
        port's tx is what that node received from the store."""
        return parse_link_stats(self.ns("ip", "-s", "-j", "link", "show", check=False).stdout)

    def qdisc_stats(self) -> dict[str, object]:
        return qdisc_summary(self.ns("tc", "-s", "-j", "qdisc", "show", "dev", BRIDGE, check=False).stdout)

    # -- crash safety --------------------------------------------------------------------
    def _state_file(self) -> Path:
        return self.state_dir / f"cluster-{self.netns}.json"

    def _record(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps({
            "netns": self.netns, "host_if": self.host_if, "owner": os.getpid(),
            "nodes": [[n.netns, n.ifname] for n in self.nodes]}))

    def _forget(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._state_file().unlink()


def cleanup_stale(state_dir: Path) -> None:
    """Namespaces recorded by runs whose process is gone."""
    if not state_dir.is_dir():
        return
    for f in state_dir.glob("cluster-*.json"):
        try:
            st = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        owner = int(st.get("owner", 0))
        if owner and owner != os.getpid() and Path(f"/proc/{owner}").exists():
            continue
        for netns, ifname in st.get("nodes", []):
            teardown_netns(netns, ifname)
        teardown_netns(st["netns"], st["host_if"])
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
