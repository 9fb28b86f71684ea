"""Host memory of N full VMs (q35) on one base layer plus a workspace layer each, every guest
reading the same set of files from the base, with the layers as virtio-pmem devices mounted with
DAX (`--layer-device pmem`) against virtio-blk drives (the default), in the same run
(docs/vm-memory.md).

Host memory, sampled every second from the first QEMU's start until every guest has read the
set (plus a few seconds), each page counted once (`runtime_shim.vm.hostmem.host_memory`): the
QEMU processes' PSS (guest RAM the guest touched: kernel, initramfs, its page cache; QEMU; TCG's
code buffer), without their mappings of the layer files, plus the host page cache of every file
the VMs read (layer blobs, the flattened root, pmem images: mincore). Before each side those
files are dropped from the page cache (posix_fadvise DONTNEED on our files only), so both start
cold; the pmem images exist already (a warm node: `vm.pmem` makes them once per node).

The base layer is built as the pmem side wants it (`--layout flat`: pack_tails=False, every
multi-block file flat, which the 6.1 guest's EROFS maps with DAX) or with the builder's default
(`--layout default`: tails of at most half a block packed inline, which the guest reads through
its page cache); the results say how many of the set's bytes each layout leaves to DAX.

    python bench/vm_memory.py [--size quick|full] [--vms N] [--set-mib M] [--layout flat|default] [--out FILE]

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else full: 8 VMs and a 192 MiB set
(bench/results/vm_memory.json); quick (or --quick): 2 VMs and a 64 MiB set, the fewest that still
share (bench/results/vm_memory-quick.json; four TCG boots, the floor of this bench's time). Goal:
pmem's peak at most 0.6x of blk's. Needs root, qemu-system-x86, the guest kit, busybox-static. TCG
here: every boot is ~10 CPU-seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests" / "support"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from erofs_builder.build import build_layer  # noqa: E402
from erofs_builder.erofs.read import read_layer  # noqa: E402
from erofs_builder.sources.source_dir import dir_entries  # noqa: E402
from erofs_builder.tree import Entry, Kind  # noqa: E402
from layerstore import digest as digestmod  # noqa: E402
from runtime_shim.backends.base import Confinement  # noqa: E402
from runtime_shim.backends.vm import VmBackend  # noqa: E402
from runtime_shim.node.blobs import DirBlobs  # noqa: E402
from runtime_shim.node.shim import Shim  # noqa: E402
from runtime_shim.nodestate.paths import NodePaths  # noqa: E402
from runtime_shim.sandbox import runner  # noqa: E402
from runtime_shim.vm import hostmem  # noqa: E402
from runtime_shim.vm.pmem import pmem_image  # noqa: E402

GUEST_MIB = 512
READY_TIMEOUT = 1500.0
CACHED = "awk '/^Cached:/ { print $2 }' /proc/meminfo"


def build_layers(work: Path, vms: int, set_mib: int, layout: str) -> dict[str, Any]:
    from testkit.shim_support import busybox_rootfs

    rng = random.Random(16)
    base = busybox_rootfs(work / "base")
    (base / "set").mkdir()
    left, sizes = set_mib << 20, []
    while left > 0:
        n = min(left, rng.randint(256 << 10, 8 << 20))  # sizes of no particular alignment
        sizes.append(n)
        left -= n
    for i, n in enumerate(sizes):
        (base / "set" / f"f{i:03d}").write_bytes(rng.randbytes(n))
    blobs = work / "blobs"
    blobs.mkdir()

    def add(entries: list[Any], name: str, **kw: Any) -> str:
        img = work / f"{name}.erofs"
        build_layer(entries, img, **kw)
        digest = digestmod.of(img.read_bytes())
        shutil.copy(img, blobs / digest)
        return digest

    coverage = {}
    for lay, kw in (("flat", {"pack_tails": False}), ("default", {})):
        img = work / f"probe-{lay}.erofs"
        build_layer(dir_entries(base, all_root=True), img, **kw)
        coverage[lay] = dax_coverage(img)
        img.unlink()
    flat = {"pack_tails": False} if layout == "flat" else {}
    base_blob = add(list(dir_entries(base, all_root=True)), "base", **flat)
    workspaces = [add([(Entry(b"ws", Kind.DIR), None), (Entry(b"ws/id", Kind.REG, size=4), (f"{i:03d}\n".encode(),))],
                      f"ws{i}") for i in range(vms)]
    return {"blobs": blobs, "base": base_blob, "workspaces": workspaces, "files": len(sizes),
            "set_bytes": sum(sizes), "dax_coverage": coverage}


def dax_coverage(image: Path) -> dict[str, int]:
    """Bytes of /set's files by EROFS layout: flat files are what a 6.1 guest maps with DAX."""
    from erofs_builder.erofs import format as fmt

    with open(image, "rb") as f:
        def read(off: int, n: int) -> bytes:
            f.seek(off)
            return f.read(n)

        layer = read_layer(read, os.path.getsize(image))
    out = {"flat_bytes": 0, "inline_tail_bytes": 0, "chunked_bytes": 0}
    for path, node in layer.nodes.items():
        if not path.startswith(b"set/") or node.kind is not Kind.REG:
            continue
        key = {fmt.LAYOUT_FLAT_PLAIN: "flat_bytes", fmt.LAYOUT_FLAT_INLINE: "inline_tail_bytes"}.get(
            node.layout, "chunked_bytes")
        out[key] += node.size
    return out


def evict(files: list[str]) -> None:
    for f in files:
        with contextlib.suppress(OSError):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def first_line(fd: int, deadline: float) -> bytes:
    got = b""
    while b"\n" not in got and (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], min(left, 1.0))[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            got += chunk
    return got.split(b"\n", 1)[0].strip()


def side(work: Path, layers: dict[str, Any], device: str, vms: int) -> dict[str, Any]:
    from testkit.shim_support import cleanup_node, spec

    node = work / f"node-{device}"
    paths = NodePaths(node)
    backend = VmBackend(paths, layer_device=device)
    blobs: Path = layers["blobs"]
    blob_files = [str(blobs / b) for b in [layers["base"], *layers["workspaces"]]]
    if device == "pmem":  # a warm node: the images exist (made once per node, from complete blobs)
        for b in [layers["base"], *layers["workspaces"]]:
            pmem_image(node / "vm" / "pmem", b, blobs / b)
    script = f"a=$({CACHED}); cat /set/* > /dev/null; b=$({CACHED}); echo $((b - a)); sleep 3000"
    conf = Confinement(memory=GUEST_MIB << 20, cpus=1)
    names = [f"m{i}" for i in range(vms)]
    pipes = {n: os.pipe() for n in names}
    errors: list[str] = []
    samples: list[dict[str, Any]] = []
    ready: dict[str, float] = {}
    grew: dict[str, int] = {}
    try:
        with Shim(paths, DirBlobs(blobs), backends={"vm": backend}) as shim:
            def run(i: int, name: str) -> None:
                env = spec((layers["base"], "base"), (layers["workspaces"][i], "workspace"),
                           config={"entrypoint": [], "cmd": ["/bin/sh"], "env": ["PATH=/bin"], "workdir": "/",
                                   "user": ""})
                try:
                    runner.run(shim, env, ["/bin/sh", "-c", script], runtime="vm", sandbox=name, confinement=conf,
                               stdout=pipes[name][1], stderr=pipes[name][1])
                except Exception as e:  # noqa: BLE001 - the kill at the end ends every run so
                    errors.append(f"{name}: {e}")

            def files() -> list[str]:
                out = set(blob_files)
                for n in names:
                    with contextlib.suppress(Exception):
                        plan = backend.plan(n)
                        out.update([plan["root"], *plan["devices"]] if "root" in plan else [p for p, _ in plan["pmem"]])
                out.update(str(p) for p in (node / "vm").glob("*/*") if p.suffix in (".img", ".erofs"))
                return sorted(out)

            evict(files())
            t0 = time.monotonic()
            load0 = os.getloadavg()
            threads = [threading.Thread(target=run, args=(i, n), daemon=True) for i, n in enumerate(names)]
            for t in threads:
                t.start()
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    pids = [p for n in names if (p := backend.live_pid(n)) is not None]
                    m = hostmem.host_memory(pids, files())
                    samples.append({"t": round(time.monotonic() - t0, 1), "vms": len(pids), **m,
                                    "load1": os.getloadavg()[0]})
                    stop.wait(1.0)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            deadline = time.monotonic() + READY_TIMEOUT
            for n in names:
                line = first_line(pipes[n][0], deadline)
                if line.lstrip(b"-").isdigit():
                    grew[n] = int(line)
                    ready[n] = round(time.monotonic() - t0, 1)
            time.sleep(5)  # a few samples with every guest done
            stop.set()
            sampler.join()
            snapshot = {}
            for n in names:
                pid = backend.live_pid(n)
                if pid is not None:
                    with contextlib.suppress(OSError):
                        snapshot[n] = hostmem.mappings(pid).total().pss
            print_files = files()
            for n in names:
                pid = backend.live_pid(n)
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            for t in threads:
                t.join(120)
    finally:
        for r, w in pipes.values():
            os.close(r)
            os.close(w)
        cleanup_node(node, work)
    peak = max(samples, key=lambda s: s["total"]) if samples else {}
    return {"device": device, "vms": vms, "ready": len(ready), "ready_seconds": ready,
            "guest_cache_growth_kib": grew, "peak": peak, "last": samples[-1] if samples else {},
            "qemu_pss_at_end": snapshot, "files": print_files, "load_at_start": [round(x, 1) for x in load0],
            "load_at_end": [round(x, 1) for x in os.getloadavg()], "errors": errors[:3],
            "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["quick", "full"], default=os.environ.get("BENCH_SIZE") or "full")
    ap.add_argument("--quick", action="store_true", help="= --size quick")
    ap.add_argument("--vms", type=int, default=None)
    ap.add_argument("--set-mib", type=int, default=None)
    ap.add_argument("--layout", choices=["flat", "default"], default="flat")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.quick = a.quick or a.size == "quick"
    vms = (2 if a.quick else 8) if a.vms is None else a.vms
    set_mib = (64 if a.quick else 192) if a.set_mib is None else a.set_mib
    if vms < 1 or set_mib < 1:
        ap.error("--vms and --set-mib must be at least 1")
    suffix = ("-quick" if a.quick else "") + ("" if a.layout == "flat" else "-default-layout")
    out = Path(a.out or ROOT / "bench" / "results" / f"vm_memory{suffix}.json")
    work = Path(tempfile.mkdtemp(prefix="vm-memory-"))
    try:
        layers = build_layers(work, vms, set_mib, a.layout)
        results = {}
        for device in ("blk", "pmem"):
            print(f"vm_memory: {vms} VMs on {device}...", file=sys.stderr, flush=True)
            results[device] = side(work, layers, device, vms)
            r = results[device]
            peak = r["peak"]
            print(f"  ready {r['ready']}/{vms}, peak {peak.get('total', 0) >> 20} MiB (processes "
                  f"{peak.get('processes', 0) >> 20}, page cache {peak.get('page_cache', 0) >> 20}), "
                  f"load {r['load_at_start']} -> {r['load_at_end']}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    blk, pmem = (results[d]["peak"].get("total", 0) for d in ("blk", "pmem"))
    doc = {"bench": "vm_memory", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "git": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
           "accel": os.environ.get("LAYERSTORE_VM_ACCEL", "auto"), "cpus": os.cpu_count(), "vms": vms,
           "guest_mib": GUEST_MIB, "layout": a.layout, "set_files": layers["files"], "set_bytes": layers["set_bytes"],
           "dax_coverage": layers["dax_coverage"],
           "pmem_over_blk_peak": round(pmem / blk, 3) if blk and pmem else None, "goal": 0.6,
           "complete": all(results[d]["ready"] == vms for d in results), **results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"pmem/blk peak host memory: {doc['pmem_over_blk_peak']} (goal <= 0.6); {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
