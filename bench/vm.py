"""Full VMs and their sandbox peers, on one environment (Debian bookworm minbase base, Python 3.11's
standard library as a toolkit, this repo's erofs_builder/ as a workspace):

flatten   the VM's root device both ways (erofs_builder.flatten): (a) the multi-device metadata
          image over the layer blobs, (b) a self-contained flattened image. Creation: seconds
          (median of rounds), bytes read from the layers (on a cold node each of those is a
          fetch from the store), bytes written, bytes of file data copied. Boot: QEMU q35 from
          start to the first byte of a command's output (`cat /etc/debian_version`), each image,
          wall time and QEMU's CPU time.
backends  time from asking for a sandbox to the first byte of its command's output, and node
          memory per sandbox (PSS of the sandbox's processes: runc + the container's processes,
          or the VMM) while the command runs, for the container backend (runc), the microVM
          backend (if registered) and the VM backend, with 1 and 8 sandboxes started at once, on
          a cold node (fresh node directory: empty cache, no layer mounts, no VM root) and warm
          (the same node again). Beside the wall time, the CPU seconds the sandbox's own processes
          (runc and the container's, or the VMM) used until that first output: the machine is
          shared, and CPU time is what its load does not inflate.

Under TCG (this node kind: /dev/kvm boots no guest) every guest instruction is translated:
what KVM would change is said in the results' `kvm_note`.

    python bench/vm.py [--size quick|full] [--part flatten|backends|all] [--rounds N] [--counts 1,8]
                       [--caches cold,warm] [--backends runc,microvm,vm] [--out FILE]

`--size` defaults to $BENCH_SIZE (as `make bench` sets it), else full: 3 rounds (creation and two
boots of each root device), 1 and 8 sandboxes at once, cold and warm (bench/results/vm.json).
quick: one round and one sandbox at a time, cold and warm, every backend
(bench/results/vm-quick.json): still the container against the microVM against the VM, and the
multi-device root against the flattened one, in the same run, but every VM boot here is ~10
CPU-seconds of TCG, so even quick is one of the longest benches (~6 boots).

Needs root, qemu-system-x86, the guest kit (.ci/install.d/guest-kit.sh), runc, mmdebstrap (or the
Debian tar the Debian tests cache), busybox-static.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.burst import inputs  # noqa: E402
from erofs_builder.flatten import build_flattened, build_multidevice  # noqa: E402
from runtime_shim.backends.base import Confinement  # noqa: E402
from runtime_shim.node.request import MountRequest  # noqa: E402
from runtime_shim.vm.kit import find_kit  # noqa: E402
from runtime_shim.vm.qemu import start_vm  # noqa: E402
from runtime_shim.vm.roots import layer_tags  # noqa: E402
from runtime_shim.vm.spec import Drive, Stream, VmSpec  # noqa: E402

LAYERCTL = str(Path(sys.executable).parent / "layerctl")
GUEST_MIB = 256  # guest RAM of both VM backends (and the containers' memory limit): the same for all
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "layerstore"
CONFINEMENT = Confinement(memory=GUEST_MIB << 20, cpus=1)
SIZES: dict[str, dict[str, Any]] = {"quick": {"rounds": 1, "counts": "1"}, "full": {"rounds": 3, "counts": "1,8"}}
KVM_NOTE = ("Under KVM the guest runs natively: the VM and microVM times to first output drop from tens of "
            "seconds of TCG translation on this shared 2-core machine (the workload CPU seconds, ~9-10 s of QEMU "
            "CPU per boot here, are what KVM removes) to around a second (guest boot ~1.1 s microvm, ~1.7 s q35 "
            "of guest time when idle, which is itself mostly translated code under TCG), and the 8-at-once "
            "figures stop being CPU-bound. Memory: QEMU's TCG code buffer (56 MiB touched of a 1 GiB mapping, "
            "measured in one VM's smaps beside 140 MiB of touched guest RAM and ~45 MiB of QEMU itself) goes "
            "away; the guest RAM the kernel, initramfs and page cache touch stays. Unchanged: the container "
            "figures, the flattened roots' creation cost (host work) and the lazy fetches.")


def sh(*argv: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])}...: {p.stderr.strip()[-500:]}")
    return p


def environment(work: Path) -> dict[str, Any]:
    """The store, the three layer images as files, and the environment's tag (built once, cached)."""
    d = CACHE / "bench-vm"
    done = d / "env.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    store = str(d / "store")
    sh(LAYERCTL, "store", "init", "--store", store)
    layers = []
    for role, src in (("base", str(inputs.minbase_tar())), ("toolkit", "/usr/lib/python3.11"),
                      ("workspace", str(ROOT / "erofs_builder"))):
        out = d / f"{role}.erofs"
        r = json.loads(sh(LAYERCTL, "build", src, "--push", "--store", store, "--role", role, "--all-root",
                          "--output", str(out), "--json").stdout)
        layers.append({"role": role, "blob": r["blob"], "file": str(out), "size": out.stat().st_size})
    sh(LAYERCTL, "env", "create", "--store", store, "--base", layers[0]["blob"], "--toolkit", layers[1]["blob"],
       "--workspace", layers[2]["blob"], "-t", "vmbench:1")
    env = {"store": store, "tag": "vmbench:1", "layers": layers}
    done.write_text(json.dumps(env, indent=1))
    return env


# -- flatten -------------------------------------------------------------------------------------
def drop_caches() -> None:
    with contextlib.suppress(OSError):
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def flatten(env: dict[str, Any], work: Path, rounds: int) -> dict[str, Any]:
    files = [Path(x["file"]) for x in env["layers"]]
    out: dict[str, Any] = {"layers": env["layers"], "layer_bytes": sum(x["size"] for x in env["layers"])}
    for name, build in (("multidevice", lambda o: build_multidevice(files, o, tags=layer_tags(len(files)))),
                        ("flat", lambda o: build_flattened(files, o))):
        secs, cold = [], []
        res = None
        for i in range(rounds):
            target = work / f"{name}.erofs"
            target.unlink(missing_ok=True)
            if i == 0:
                drop_caches()
            res = build(target)
            (cold if i == 0 else secs).append(res.seconds)
        assert res is not None
        out[name] = {"seconds_cold_page_cache": round(cold[0], 3),
                     "seconds_warm_median": round(statistics.median(secs), 3) if secs else None,
                     "layer_bytes_read": res.layer_bytes_read, "image_bytes": res.size,
                     "copied_file_bytes": res.copied_bytes, "files": res.files}
    kit = find_kit()
    for name in ("multidevice", "flat"):
        image = work / f"{name}.erofs"
        runs = [boot(kit, image, files if name == "multidevice" else [], work) for _ in range(rounds)]
        out[name]["boot_to_first_output_s"] = [round(t, 2) for t, _cpu in runs]
        out[name]["boot_median_s"] = round(statistics.median(t for t, _cpu in runs), 2)
        out[name]["boot_qemu_cpu_s"] = [round(c, 2) for _t, c in runs]
        out[name]["boot_qemu_cpu_median_s"] = round(statistics.median(c for _t, c in runs), 2)
    return out


def boot(kit: Any, image: Path, devices: list[Path], work: Path) -> tuple[float, float]:
    from runtime_shim.vm.config import GuestConfig, write_config

    cfg = write_config(work / "config.tar", GuestConfig(argv=("/bin/cat", "/etc/debian_version"),
                                                        env=("PATH=/usr/bin:/bin",)))
    upper = work / "upper.img"
    upper.unlink(missing_ok=True)
    from runtime_shim.node.overlay import make_upper_image

    make_upper_image(upper, 1 << 30)
    drives = [Drive(str(image), role="root", serial="layer0")]
    drives += [Drive(str(d), role="meta", serial=f"dev{i + 1}") for i, d in enumerate(devices)]
    drives += [Drive(str(upper), read_only=False, role="upper", serial="upper"),
               Drive(str(cfg), role="config", serial="config")]
    socks = Path(tempfile.mkdtemp(prefix="vmb-", dir="/run"))
    spec = VmSpec(kernel=str(kit.kernel), initrd=str(kit.initrd), memory_mib=256, machine="q35",
                  cmdline=f"console=ttyS0 quiet panic=-1 layerstore.mode=run layerstore.drives={len(drives)}",
                  drives=tuple(drives), streams=tuple(Stream(n, str(socks / f"{n}.sock"))
                                                      for n in ("stdout", "stderr", "status")))
    r, w = os.pipe()
    t0 = time.monotonic()
    try:
        vm = start_vm(spec, stdout=w, stderr=subprocess.DEVNULL)  # (pumped by threads of ours: w stays open)
        first = first_byte(r, vm.process)
        t = time.monotonic() - t0
        cpu = cpu_tree(vm.pid)
        vm.wait(300)
        if not first:
            raise SystemExit(f"the VM printed nothing: {vm.result()}")
        return t, cpu
    finally:
        os.close(w)
        os.close(r)
        shutil.rmtree(socks, ignore_errors=True)


# -- backends ------------------------------------------------------------------------------------
def tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{p}/stat").read_bytes()
                ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
                children.setdefault(ppid, []).append(int(p))
    out, stack = [], [pid]
    while stack:
        q = stack.pop()
        out.append(q)
        stack.extend(children.get(q, []))
    return out


def pss_tree(pid: int) -> int:
    """PSS bytes of `pid` and its descendants."""
    total = 0
    for q in tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{q}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    return total


def cpu_tree(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and its live descendants: unlike wall time,
    what other work on a shared machine does not inflate."""
    ticks = 0
    for q in tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{q}/stat").read_bytes()
            f = stat[stat.rindex(b")") + 2:].split()
            ticks += int(f[11]) + int(f[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def first_byte(fd: int, proc: subprocess.Popen[bytes], limit: float = 1200) -> bytes:
    """The first byte on `fd`, or b"" if `proc` ends first or `limit` seconds pass (the write end
    stays open in this process, so a dead writer gives no EOF)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 1.0)[0]:
            return os.read(fd, 1)
        if proc.poll() is not None:
            return b""
    return b""


def one_sandbox(shim: Any, backend_name: str, tag: str, ready: threading.Barrier, rec: dict[str, Any]) -> None:
    try:
        backend = shim.backend(backend_name)
    except BaseException as e:  # noqa: BLE001 - recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"
        ready.abort()
        return
    t0 = time.monotonic()
    if getattr(backend, "guest_root", False):  # a VM whose guest composes the root (as runner.run mounts it)
        sb = shim.mount(MountRequest(tag, guest=backend_name))
    else:
        sb = shim.mount(MountRequest(tag, upper_size=256 << 20))
    r, w = os.pipe()
    try:
        rec["mount_s"] = time.monotonic() - t0
        backend.prepare(sb, ["/bin/sh", "-c", "echo ready; sleep 600"], confinement=CONFINEMENT)
        rec["prepare_s"] = time.monotonic() - t0 - rec["mount_s"]  # (vm: the flattened root, built once per node)
        ex = backend.start(sb.id, stdout=w, stderr=subprocess.DEVNULL)  # w stays open: a VM's pumps use it
        first = first_byte(r, ex.process)
        rec["first_output_s"] = time.monotonic() - t0 if first else None
        rec["cpu_s"] = cpu_tree(ex.process.pid)
        with contextlib.suppress(threading.BrokenBarrierError):
            ready.wait(600)
        rec["pss_bytes"] = pss_tree(ex.process.pid)
        with contextlib.suppress(threading.BrokenBarrierError):
            ready.wait(600)
        backend.delete(sb.id)
        with contextlib.suppress(Exception):
            backend.wait(ex)
    except BaseException as e:  # noqa: BLE001 - recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"
        ready.abort()
    finally:
        with contextlib.suppress(Exception):
            backend.delete(sb.id)
        os.close(w)
        os.close(r)
        with contextlib.suppress(Exception):
            shim.unmount(sb.id)


def backends_run(env: dict[str, Any], work: Path, names: list[str], counts: list[int],
                 caches: list[str]) -> dict[str, Any]:
    from testkit.shim_support import cleanup_node

    from runtime_shim.node.shim import Shim

    out: dict[str, Any] = {}
    for name in names:
        node = work / f"node-{name}"
        try:
            with Shim.for_node(node, env["store"]) as shim:
                for cache in caches:
                    for n in counts:
                        if cache == "cold":  # a fresh node each time: empty cache, nothing mounted
                            shim.stop_daemon()
                            shutil.rmtree(node / "cache", ignore_errors=True)
                            shutil.rmtree(node / "vm" / "roots", ignore_errors=True)
                            drop_caches()
                        recs: list[dict[str, Any]] = [{} for _ in range(n)]
                        barrier = threading.Barrier(n)
                        threads = [threading.Thread(target=one_sandbox, args=(shim, name, env["tag"], barrier, rec))
                                   for rec in recs]
                        for t in threads:
                            t.start()
                        for t in threads:
                            t.join()
                        firsts = [r["first_output_s"] for r in recs if r.get("first_output_s")]
                        pss = [r["pss_bytes"] for r in recs if r.get("pss_bytes")]
                        out.setdefault(name, {})[f"{cache}_{n}"] = {
                            "first_output_median_s": round(statistics.median(firsts), 2) if firsts else None,
                            "first_output_max_s": round(max(firsts), 2) if firsts else None,
                            "pss_per_sandbox_mib": round(statistics.mean(pss) / (1 << 20), 1) if pss else None,
                            "mount_median_s": round(statistics.median([r.get("mount_s", 0) for r in recs]), 2),
                            "prepare_max_s": round(max(r.get("prepare_s", 0) for r in recs), 2),
                            "workload_cpu_s_to_first_output_median": round(statistics.median(
                                [r["cpu_s"] for r in recs if "cpu_s" in r] or [0]), 2),
                            "errors": sorted({r["error"] for r in recs if "error" in r}),
                            "load": os.getloadavg()[0]}
                        print(name, cache, n, out[name][f"{cache}_{n}"], flush=True)
        finally:
            cleanup_node(node, work)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=os.environ.get("BENCH_SIZE") or "full")
    ap.add_argument("--part", choices=["flatten", "backends", "all"], default="all")
    ap.add_argument("--rounds", type=int, default=None, help="flatten rounds (default: the size's)")
    ap.add_argument("--counts", default=None, help="sandboxes at once, comma-separated (default: the size's)")
    ap.add_argument("--caches", default="cold,warm", help="node states, comma-separated: cold, warm")
    ap.add_argument("--backends", default="runc,microvm,vm")
    ap.add_argument("--out", default=None, help="default: bench/results/vm.json (full) or vm-<size>.json")
    a = ap.parse_args()
    size = SIZES[a.size]
    a.rounds = size["rounds"] if a.rounds is None else a.rounds
    try:
        counts = [int(c) for c in (a.counts or size["counts"]).split(",") if c.strip()]
    except ValueError:
        ap.error(f"--counts: {a.counts!r} is not a comma-separated list of whole numbers")
    caches = [c for c in a.caches.split(",") if c]
    if a.rounds < 1 or not counts or min(counts) < 1:
        ap.error("--rounds and every --counts must be at least 1")
    if not caches or set(caches) - {"cold", "warm"}:
        ap.error("--caches: cold, warm or both")
    a.out = a.out or str(ROOT / "bench" / "results" / ("vm.json" if a.size == "full" else f"vm-{a.size}.json"))
    os.environ.setdefault("LAYERSTORE_VM_ACCEL", "tcg")
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from runtime_shim.backends import REGISTRY
    from runtime_shim.backends.vm import VmBackend

    if "vm" not in REGISTRY.names():
        REGISTRY.register("vm", VmBackend)
    result: dict[str, Any] = {"benchmark": "vm", "size": a.size,
                              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "machine": {"cpus": os.cpu_count(), "accel": os.environ["LAYERSTORE_VM_ACCEL"],
                                          "load_at_start": os.getloadavg()},
                              "kvm_note": KVM_NOTE}
    outp = Path(a.out)
    with contextlib.suppress(FileNotFoundError, ValueError):
        old = json.loads(outp.read_text())
        result.update({k: v for k, v in old.items() if k in ("flatten", "backends", "backends_when")})
    with tempfile.TemporaryDirectory(prefix="vmbench-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        env = environment(work)
        result["environment"] = {"tag": env["tag"], "layers": env["layers"]}
        if a.part in ("flatten", "all"):
            result["flatten"] = flatten(env, work, a.rounds)
            print(json.dumps(result["flatten"], indent=1), flush=True)
        if a.part in ("backends", "all"):
            names = [n for n in a.backends.split(",") if n in REGISTRY.names()]
            skipped = [n for n in a.backends.split(",") if n not in REGISTRY.names()]
            result["backends_skipped"] = [n for n in skipped if n not in result.get("backends", {})]
            ran = backends_run(env, work, names, counts, caches)
            failed = [n for n, points in ran.items() if any(p["errors"] or p["first_output_median_s"] is None
                                                            for p in points.values())]
            if failed:  # figures of a run that failed do not replace an earlier run's
                raise SystemExit(f"{', '.join(failed)}: a point failed; results not written: {json.dumps(ran)}")
            result["backends"] = {**result.get("backends", {}), **ran}  # a run of some backends keeps the others'
            result.setdefault("backends_when", {}).update({n: result["when"] for n in ran})
    outp.parent.mkdir(parents=True, exist_ok=True)
    outp.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {outp}")


if __name__ == "__main__":
    main()
