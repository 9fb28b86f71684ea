"""Does FUSE passthrough carry layerstore's stack on this kernel, and what does it buy?
(issue 28; findings in docs/fuse-passthrough.md). Root only; mounts under a scratch directory and
unmounts everything on every exit path.

For each FUSE mode (passthrough offered with max_stack_depth 1, 2 and 0, and not offered) it
mounts bench/probes/rawfuse.py's server holding one EROFS image built by the project, and asks:

  a. does INIT with FUSE_PASSTHROUGH go through, and does an OPEN answered with a backing id
     read the right bytes (with no READ reaching the server)?
  b. does EROFS mount file-backed on the FUSE file (as the runtime shim mounts it)?
  c. does overlayfs stack that EROFS mount as a lower layer (upper on tmpfs)?
  c'. the same through a loop device on the FUSE file (EROFS on a block device) instead.

Each answer carries its errno and the kernel's log lines (dmesg) and mountinfo line.
With --bench it then times, interleaved, a sequential read of large files and a walk + sha256
of many small files inside EROFS images, the page cache dropped before each run: EROFS on the
local image file, on the FUSE file served by passthrough (file-backed if the kernel allows it,
else through a loop device, then also a loop device on the local file for reference), and on the
FUSE file served by the server's READ (one Python thread, as the daemon's one trio thread).

    python -m bench.probes.fuse_passthrough [--bench [--rounds N] [--big-mib M]] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.probes.rawfuse import PASSTHROUGH, Log, RawFuse, describe_flags  # noqa: E402
from bench.readbench.inputs import make_big_tree, make_small_tree  # noqa: E402
from bench.readbench.project import build_layer, dir_entries, linux  # noqa: E402
from layerstore.errors import LayerstoreError  # noqa: E402

# label, passthrough offered, max_stack_depth, backing file on an overlayfs (its depth 1)
MODES = [("pt1", True, 1, False), ("pt2", True, 2, False), ("pt0", True, 0, False), ("nopt", False, 0, False),
         ("pt1_backing_on_overlay", True, 1, True), ("pt2_backing_on_overlay", True, 2, True)]
IMAGE = "layer.erofs"


# -- evidence: errno, dmesg, mountinfo ------------------------------------------------------------
class Kmsg:
    """The kernel log lines written since `mark()`."""

    def __init__(self) -> None:
        self.seen = 0

    @staticmethod
    def _lines() -> list[str]:
        res = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
        return res.stdout.splitlines()

    def mark(self) -> None:
        self.seen = len(self._lines())

    def since(self) -> list[str]:
        lines = self._lines()
        new, self.seen = lines[self.seen:], len(lines)
        keep = ("erofs", "overlay", "fuse", "loop", "stack")
        return [ln for ln in new if any(k in ln.lower() for k in keep)]


@dataclass
class Step:
    ok: bool
    errno: str | None = None
    error: str | None = None
    dmesg: list[str] = field(default_factory=list)
    mountinfo: str | None = None
    detail: dict[str, object] = field(default_factory=dict)


def mountinfo_of(path: Path) -> str | None:
    m = linux.find_mount(path)
    return f"{m.fstype} {m.source} {m.options} dev={m.device}" if m else None


def attempt_mount(stack: contextlib.ExitStack, kmsg: Kmsg, target: Path, do_mount: Callable[[], None]) -> Step:
    """Run `do_mount()` (mount(2) through ctypes; its errno is kept); on success, unmount `target`
    when `stack` closes."""
    target.mkdir(parents=True, exist_ok=True)
    kmsg.mark()
    try:
        do_mount()
    except (OSError, LayerstoreError) as e:
        err = e.errno if isinstance(e, OSError) else ctypes.get_errno()
        return Step(False, errno.errorcode.get(err, str(err)) if err else None, str(e), kmsg.since())
    stack.callback(linux.detach_how, target)
    return Step(True, dmesg=kmsg.since(), mountinfo=mountinfo_of(target))


def mount_erofs_loop(image: Path, target: Path, *, dio: bool = False) -> None:
    """EROFS on a read-only loop device over `image` (buffered, or direct I/O on the file). The
    device is detached at once: the kernel then frees it when the filesystem is unmounted."""
    argv = ["losetup", "--find", "--show", "--read-only", *(["--direct-io=on"] if dio else []), str(image)]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise linux.MountError(f"losetup {image}: {res.stderr.strip()}")
    dev = res.stdout.strip()
    try:
        linux.mount(dev, target, "erofs", linux.MS_RDONLY | linux.MS_NODEV | linux.MS_NOSUID)
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True, check=False)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def same_tree(src: Path, mnt: Path) -> tuple[int, int]:
    """(files compared, mismatches) between the source tree and a mounted image of it."""
    n = bad = 0
    for dirpath, _dirs, names in os.walk(src):
        for name in names:
            p = Path(dirpath, name)
            if p.is_symlink() or not p.is_file():
                continue
            n += 1
            bad += sha256_file(p) != sha256_file(mnt / p.relative_to(src))
    return n, bad


# -- the questions ----------------------------------------------------------------------------------
def probe_mode(work: Path, image: Path, src: Path, label: str, passthrough: bool, depth: int,
               backing_on_overlay: bool = False) -> dict[str, object]:
    kmsg = Kmsg()
    base = work / label
    out: dict[str, object] = {"mode": label, "passthrough_offered_by_us": passthrough, "max_stack_depth": depth}
    with contextlib.ExitStack() as stack:
        fuse_dir = base / "fuse"
        fuse_dir.mkdir(parents=True)
        backing = image
        if backing_on_overlay:  # the backing file's filesystem is itself stacked (s_stack_depth 1)
            (base / "lower").mkdir()
            shutil.copyfile(image, base / "lower" / IMAGE)
            step = overlay_on(stack, kmsg, base / "backing-ovl", base / "lower", None)
            out["backing_overlay"] = asdict(step)
            backing = base / "backing-ovl" / "merged" / IMAGE
        kmsg.mark()
        fs = stack.enter_context(RawFuse(fuse_dir, {IMAGE: backing}, passthrough=passthrough, max_stack_depth=depth))
        lg = fs.log
        out["init"] = {"kernel_minor": lg.kernel_minor,
                       "kernel_offers_passthrough": bool(lg.kernel_flags & PASSTHROUGH),
                       "reply_flags": describe_flags(lg.reply_flags), "max_pages": lg.max_pages,
                       "dmesg": kmsg.since(), "mountinfo": mountinfo_of(fuse_dir)}
        # a. bytes through the mount
        reads0 = lg.reads
        ok = sha256_file(fuse_dir / IMAGE) == sha256_file(image)
        out["a_read"] = asdict(Step(ok, detail={"bytes_equal": ok, "passthrough_opens": lg.passthrough_opens,
                                                "opens": lg.opens, "server_reads": lg.reads - reads0,
                                                "backing_errors": list(lg.backing_errors)}))
        # b. EROFS file-backed on the FUSE file
        erofs_dir = base / "erofs"
        b = attempt_mount(stack, kmsg, erofs_dir, lambda: linux.mount_erofs(fuse_dir / IMAGE, erofs_dir))
        if b.ok:
            b.detail["files_compared"], b.detail["mismatches"] = same_tree(src, erofs_dir)
        out["b_erofs_file_backed"] = asdict(b)
        # c. overlayfs on that EROFS, upper on tmpfs
        if b.ok:
            out["c_overlay"] = asdict(overlay_on(stack, kmsg, base / "ovl", erofs_dir, src))
        # c'. the same through a loop device on the FUSE file
        loop_dir = base / "loop-erofs"
        lp = attempt_mount(stack, kmsg, loop_dir, lambda: mount_erofs_loop(fuse_dir / IMAGE, loop_dir))
        if lp.ok:
            lp.detail["files_compared"], lp.detail["mismatches"] = same_tree(src, loop_dir)
        out["c2_erofs_on_loop"] = asdict(lp)
        if lp.ok:
            out["c2_overlay_on_loop_erofs"] = asdict(overlay_on(stack, kmsg, base / "loop-ovl", loop_dir, src))
        out["server"] = {"reads": lg.reads, "read_bytes": lg.read_bytes, "unknown_opcodes": lg.unknown,
                         "loop_error": lg.loop_error}
    out["unmounted"] = not linux.mounts_under(linux.read_mounts(), str(base))
    return out


def overlay_on(stack: contextlib.ExitStack, kmsg: Kmsg, base: Path, lower: Path, src: Path | None) -> Step:
    tmp = base / "tmpfs"
    t = attempt_mount(stack, kmsg, tmp, lambda: linux.mount("tmpfs", tmp, "tmpfs", 0, "size=16m,mode=0700"))
    if not t.ok:
        return t
    (tmp / "upper").mkdir()
    (tmp / "work").mkdir()
    merged = base / "merged"
    opts = f"lowerdir={lower},upperdir={tmp / 'upper'},workdir={tmp / 'work'}"
    step = attempt_mount(stack, kmsg, merged, lambda: linux.mount("overlay", merged, "overlay", 0, opts))
    if step.ok and src is not None:
        step.detail["files_compared"], step.detail["mismatches"] = same_tree(src, merged)
        (merged / "written-by-probe").write_text("upper is writable\n")
        step.detail["upper_write"] = (tmp / "upper" / "written-by-probe").exists()
    return step


def make_small_src(root: Path) -> None:
    """A few files: one of 3 MiB of random data, 40 small ones in a subdirectory."""
    (root / "sub").mkdir(parents=True)
    (root / "big.bin").write_bytes(os.urandom(3 << 20))
    for i in range(40):
        (root / "sub" / f"f{i:02}.txt").write_bytes(os.urandom(100 + 97 * i))


def correctness(work: Path, modes: list[tuple[str, bool, int, bool]] = MODES) -> dict[str, object]:
    src = work / "src"
    make_small_src(src)
    image = work / IMAGE
    build_layer(dir_entries(src, all_root=True), image, all_root=True)
    found = {"kernel": os.uname().release, "image_bytes": image.stat().st_size, "modes": []}
    for label, pt, depth, on_overlay in modes:
        found["modes"].append(probe_mode(work, image, src, label, pt, depth, on_overlay))  # type: ignore[union-attr]
    return found


def table(found: dict[str, object]) -> str:
    """One line per mode: what was accepted (ok) or refused (the errno)."""
    def cell(step: object) -> str:
        if not isinstance(step, dict):
            return "-"
        return "ok" if step["ok"] else str(step["errno"])

    rows = ["mode | passthrough opens / server READs | a bytes | b EROFS file-backed | c overlayfs | "
            "loop EROFS, overlayfs"]
    for m in found["modes"]:  # type: ignore[union-attr]
        a = m["a_read"]["detail"]
        rows.append(f"{m['mode']} | {a['passthrough_opens']} / {a['server_reads']} {' '.join(a['backing_errors'])} | "
                    f"{'equal' if a['bytes_equal'] else 'DIFFER'} | {cell(m['b_erofs_file_backed'])} | "
                    f"{cell(m.get('c_overlay'))} | {cell(m['c2_erofs_on_loop'])}, "
                    f"{cell(m.get('c2_overlay_on_loop_erofs'))}")
    return "\n".join(rows)


# -- the timing -------------------------------------------------------------------------------------
WORKLOAD = r"""
import hashlib, os, sys, time
mode, root = sys.argv[1], sys.argv[2]
t0 = time.perf_counter(); n = 0
if mode == "seq":
    for name in sorted(os.listdir(root)):
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
        while b := os.read(fd, 1 << 20):
            n += len(b)
        os.close(fd)
else:
    for d, _ds, names in os.walk(root):
        for name in names:
            p = os.path.join(d, name)
            if os.path.islink(p):
                continue
            with open(p, "rb") as f:
                n += len(hashlib.sha256(f.read()).digest())
print(time.perf_counter() - t0, n)
"""


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_workload(mode: str, root: Path) -> float:
    drop_caches()
    res = subprocess.run([sys.executable, "-c", WORKLOAD, mode, str(root)], capture_output=True, text=True, check=True)
    return float(res.stdout.split()[0])


def bench_mounts(stack: contextlib.ExitStack, work: Path,
                 images: dict[str, Path]) -> tuple[dict[str, dict[str, Path]], dict[str, Log]]:
    """config -> {"big"|"small": mounted EROFS root}; the two servers' logs."""
    kmsg = Kmsg()
    pt = stack.enter_context(RawFuse(work / "pt", images, passthrough=True, max_stack_depth=1))
    plain = stack.enter_context(RawFuse(work / "plain", images, passthrough=False, readahead_kb=4096))
    configs: dict[str, dict[str, Path]] = {}

    def add(config: str, how: str, fuse_dir: Path | None) -> bool:
        """Mount both images for `config` (file-backed, loop, loop_dio): the local files, or the
        files on `fuse_dir`."""
        roots = {}
        for kind in images:
            target = work / "m" / config / kind
            src = images[kind] if fuse_dir is None else fuse_dir / kind
            if how == "file":
                step = attempt_mount(stack, kmsg, target, lambda s=src, t=target: linux.mount_erofs(s, t))
            else:
                step = attempt_mount(stack, kmsg, target,
                                     lambda s=src, t=target: mount_erofs_loop(s, t, dio=how == "loop_dio"))
            if not step.ok:
                print(f"# {config}: {step.errno} {step.error} {step.dmesg}", file=sys.stderr)
                return False
            roots[kind] = target
        configs[config] = roots
        return True

    add("erofs_local", "file", None)
    if not add("passthrough_file", "file", work / "pt"):
        for how in ("loop", "loop_dio"):
            add(f"passthrough_{how}", how, work / "pt")
            add(f"local_{how}", how, None)
    add("fuse_read", "file", work / "plain")
    return configs, {"passthrough": pt.log, "fuse_read": plain.log}


def bench(work: Path, rounds: int, big_mib: int, small_src: Path | None = None) -> dict[str, object]:
    make_big_tree(work / "big-src", big_mib)
    if small_src is None:
        make_small_tree(work / "small-src")  # the read bench's: a copy of the Python standard library
    else:
        shutil.copytree(small_src, work / "small-src", symlinks=True)
    images = {}
    for kind in ("big", "small"):
        images[kind] = work / f"{kind}.erofs"
        build_layer(dir_entries(work / f"{kind}-src", all_root=True), images[kind], all_root=True)
    times: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        configs, logs = bench_mounts(stack, work, images)
        names = list(configs)
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                for mode, kind in (("seq", "big"), ("walk", "small")):
                    t = run_workload(mode, configs[name][kind])
                    times.setdefault(name, {}).setdefault(mode, []).append(t)
        servers = {k: {"reads": lg.reads, "read_bytes": lg.read_bytes, "passthrough_opens": lg.passthrough_opens}
                   for k, lg in logs.items()}
    return {**summarize(times, rounds, big_mib), "servers": servers}


def summarize(times: dict[str, dict[str, list[float]]], rounds: int, big_mib: int) -> dict[str, object]:
    ref = times["erofs_local"]
    out: dict[str, object] = {"rounds": rounds, "big_mib": big_mib, "load_after": os.getloadavg(), "configs": {}}
    for name, by_mode in times.items():
        row = {}
        for mode, ts in by_mode.items():
            paired = [a / b for a, b in zip(ref[mode], ts, strict=True)]
            row[mode] = {"median_s": statistics.median(ts),
                         "ratio_of_medians": statistics.median(ref[mode]) / statistics.median(ts),
                         "paired_ratio_median": statistics.median(paired), "paired_range": [min(paired), max(paired)],
                         "times_s": ts}
        out["configs"][name] = row  # type: ignore[index]
    return out


# -- entry ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def scratch(parent: str | None) -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="fuse-passthrough-", dir=parent))
    try:
        yield work
    finally:
        left = linux.mounts_under(linux.read_mounts(), str(work))
        for m in left:  # deepest first; a step that failed half-way
            linux.detach_how(m.mountpoint)
        if linux.mounts_under(linux.read_mounts(), str(work)):
            print(f"# mounts left under {work}; not removing it", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: mounts and servers go


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", action="store_true", help="also time the read paths (load-sensitive)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big-mib", type=int, default=256)
    ap.add_argument("--small-src", type=Path, default=None, help="tree for the small-file image (default: the stdlib)")
    ap.add_argument("--workdir", default=None, help="parent of the scratch directory (default: the system's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("root only (mount(2), /dev/fuse, FUSE_DEV_IOC_BACKING_OPEN needs CAP_SYS_ADMIN)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    result: dict[str, object] = {"uptime_before": Path("/proc/loadavg").read_text().strip()}
    with scratch(args.workdir) as work:
        result["correctness"] = correctness(work / "c")
        if args.bench:
            (work / "b").mkdir()
            t0 = time.monotonic()
            result["bench"] = bench(work / "b", args.rounds, args.big_mib, args.small_src)
            result["bench_seconds"] = round(time.monotonic() - t0, 1)
    print(table(result["correctness"]), file=sys.stderr)  # type: ignore[arg-type]
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
