"""Hostile sandboxes, through real runc: each probe an agent might try from inside (a fork bomb, a
disk filler, refused syscalls, looking for the node's socket, cache, other sandboxes' uppers and
host paths, masked /proc paths) and a hostile root filesystem (a FIFO, /dev/zero or a link out of
the root as its etc/passwd). Every wait has a deadline; every container and mount is removed by
the fixtures, also when a test fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.fuse_helpers import wait_until
from testkit.shim_support import (
    CONFIG,
    add_blob,
    busybox_rootfs,
    dir_shim,
    in_background,
    mkfs,
    needs_busybox,
    needs_root,
    needs_runc,
    spec,
)

from layerstore import linux
from layerstore.errors import BadInput
from runtime_shim.backends.base import Confinement
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.sandbox import runner

pytestmark = [needs_root, needs_busybox, needs_runc]
PROBE_SOURCE = Path(__file__).parent / "data" / "syscall_probe.c"
DEADLINE = 120.0  # seconds: only to turn a hang into a failure
TMPFS_MAGIC = 0x01021994
MiB = 1 << 20


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A busybox base with a static syscall probe at /bin/probe."""
    root = tmp_path_factory.mktemp("hostile")
    base = busybox_rootfs(root / "base")
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc and a static libc (libc6-dev) for the syscall probe")
    subprocess.run(["gcc", "-static", "-O1", "-o", str(base / "bin" / "probe"), str(PROBE_SOURCE)], check=True,
                   capture_output=True)
    blobs = root / "blobs"
    return blobs, add_blob(blobs, mkfs(base, root / "base.img"))


@pytest.fixture
def shim(tmp_path: Path, image: tuple[Path, str]) -> Iterator[Shim]:
    with dir_shim(tmp_path, image[0]) as s:
        yield s


def run(shim: Shim, blob: str, script: str, **kw: object) -> tuple[int, str, str]:
    tag = kw.get("sandbox") or "run"
    out, err = shim.paths.root / f"{tag}.out", shim.paths.root / f"{tag}.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        res = runner.run(shim, spec((blob, "base")), ["/bin/sh", "-c", script], stdin=subprocess.DEVNULL,
                         stdout=o, stderr=e, **kw)  # type: ignore[arg-type]
    return res.exit_code, out.read_text(), err.read_text()


def probe(shim: Shim, blob: str, **kw: object) -> dict[str, int]:
    code, out, err = run(shim, blob, "/bin/probe", **kw)
    assert code == 0, err
    return {name: int(e) for name, e in (line.split() for line in out.splitlines())}


def runc_kill(shim: Shim, sandbox: str) -> None:
    subprocess.run(["runc", "--root", str(shim.paths.root / "oci" / "runc"), "kill", sandbox, "KILL"],
                   capture_output=True)


# -- syscalls ---------------------------------------------------------------------------------------
EPERM, ENOSYS = 1, 38


def test_the_default_profile_refuses_what_a_container_runtime_refuses(shim: Shim, image: tuple[Path, str]) -> None:
    got = probe(shim, image[1])
    refused = ["keyctl", "add_key", "bpf", "clone_user", "unshare_user", "mount", "personality_no_aslr", "setns",
               "io_uring_setup", "userfaultfd", "perf_event_open", "ptrace"]
    assert {k: got[k] for k in refused} == dict.fromkeys(refused, EPERM), got
    assert got["clone3"] == ENOSYS  # glibc then falls back to clone, whose flags seccomp can read
    assert got["personality_query"] == 0  # the query and the default persona stay allowed
    code, _, err = run(shim, image[1], "unshare -U true")  # the shell way to a user namespace
    assert code != 0, err


def test_each_relaxation_is_explicit(shim: Shim, image: tuple[Path, str]) -> None:
    got = probe(shim, image[1], confinement=Confinement(ptrace=True))
    assert got["ptrace"] == 0 and got["keyctl"] == EPERM
    got = probe(shim, image[1], confinement=Confinement(seccomp=False))
    assert got["keyctl"] == 0 and got["add_key"] == 0 and got["personality_no_aslr"] == 0


# -- limits -----------------------------------------------------------------------------------------
def pids_file(sandbox: str, name: str) -> Path:
    return Path("/sys/fs/cgroup/pids/layerstore", sandbox, name)


def test_a_fork_bomb_stays_inside_and_the_node_runs_other_sandboxes(shim: Shim, image: tuple[Path, str]) -> None:
    limit = Confinement(pids=64)
    # bounded first: 200 sleepers cannot all start under a limit of 64 tasks
    # (the subshell dies at its first failed fork; the count uses builtins only: no fork is left)
    code, out, _ = run(shim, image[1], "(i=0; while [ $i -lt 200 ]; do sleep 1000 & i=$((i+1)); done) 2>/dev/null;"
                                       " set -- /proc/[0-9]*; echo $#", confinement=limit)
    assert code == 0 and int(out) <= 64, out
    # the real one, started in a subshell (pid 1 forks once, before the bomb, then sleeps, so the
    # sandbox and its cgroup stay until the host kills it; had pid 1 itself forked the bomb's
    # pipeline, its second fork could fail at the limit and end the sandbox early)
    th, result = in_background(run, shim, image[1], "b() { b | b & }; (b); exec sleep 1000", sandbox="bomb",
                               confinement=limit)
    try:
        wait_until(lambda: pids_file("bomb", "pids.events").exists()
                   and int(pids_file("bomb", "pids.events").read_text().split()[1]) > 0, DEADLINE,
                   "the fork bomb to reach its limit")
        assert pids_file("bomb", "pids.max").read_text().strip() == "64"
        assert int(pids_file("bomb", "pids.current").read_text()) <= 64
        assert run(shim, image[1], "echo alive", sandbox="bystander") == (0, "alive\n", "")
    finally:
        wait_until(lambda: (runc_kill(shim, "bomb"), not th.is_alive())[1], DEADLINE, "the bomb's sandbox to end")
        th.join()
    assert isinstance(result[0], tuple) and result[0][0] == 137, result
    assert shim.sandboxes() == []


def test_a_disk_filler_gets_enospc_in_its_own_upper(shim: Shim, image: tuple[Path, str]) -> None:
    size = 16 * MiB
    script = ("dd if=/dev/zero of=/fill bs=1M count=64; echo rc=$?; stat -c %s /fill;"
              " head -c 1024 /dev/zero > /tmp/small && echo tmp-ok")
    th, result = in_background(run, shim, image[1], script + "; sleep 1000", sandbox="filler", upper_size=size)
    try:
        wait_until(lambda: "tmp-ok" in _read(shim.paths.root / "filler.out") or not th.is_alive(), DEADLINE,
                   "the filler to hit its quota")
        scratch = shim.paths.scratch("filler")
        assert (os.statvfs(scratch).f_bavail == 0 and os.stat(scratch).st_dev != os.stat(shim.paths.root).st_dev)
        assert linux.fs_type(scratch) == TMPFS_MAGIC  # the writes are in its tmpfs, not on the node disk
        # another sandbox, at the same time, writes as usual
        assert run(shim, image[1], "head -c 4194304 /dev/zero > /f && stat -c %s /f", sandbox="other",
                   upper_size=size) == (0, "4194304\n", "")
    finally:
        wait_until(lambda: (runc_kill(shim, "filler"), not th.is_alive())[1], DEADLINE, "the filler to end")
        th.join()
    code, out, err = result[0]  # type: ignore[misc]
    lines = out.splitlines()
    assert lines[0] != "rc=0" and int(lines[1]) <= size, out
    assert "No space left on device" in err
    assert shim.sandboxes() == [] and not shim.paths.scratch("filler").exists()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


# -- what the sandbox can see -----------------------------------------------------------------------
def test_nothing_of_the_node_is_visible_and_system_paths_are_masked(shim: Shim, image: tuple[Path, str],
                                                                       tmp_path: Path) -> None:
    other = shim.mount(MountRequest(spec((image[1], "base")), upper_size=MiB))
    node = str(shim.paths.root)
    probes = [node, f"{node}/cache", f"{node}/fuse", f"{node}/state", f"{node}/sandboxes", other.upper,
              other.target, str(tmp_path), "/var/lib/layerstore", "/work", "/root/.cache", "/run/containerd"]
    script = "; ".join(f"test -e {p} && echo REACHABLE {p}" for p in probes) + """
        for s in $(find / -type s 2>/dev/null); do echo SOCKET $s; done
        for f in /proc/kcore /proc/keys /proc/timer_list /proc/sched_debug /proc/interrupts; do
            [ "$(head -c 16 $f 2>/dev/null | wc -c)" -gt 0 ] && echo UNMASKED $f; done  # (/proc sizes are 0)
        test -n "$(ls /sys/firmware 2>/dev/null)" && echo UNMASKED /sys/firmware
        echo x > /proc/sys/kernel/hostname 2>/dev/null && echo WRITABLE /proc/sys
        grep ' / / ' /proc/self/mountinfo
        exit 0"""
    code, out, err = run(shim, image[1], script)
    assert code == 0, err
    assert not [line for line in out.splitlines() if line.split()[0] in ("REACHABLE", "SOCKET", "UNMASKED",
                                                                        "WRITABLE")], out
    root_line = [line for line in out.splitlines() if " / / " in line][0]
    assert {"nosuid", "nodev"} <= set(root_line.split()[5].split(",")), root_line  # the root's mount flags
    shim.unmount(other.id)


def test_mounts_are_nosuid_nodev_unless_relaxed(shim: Shim, image: tuple[Path, str]) -> None:
    sb = shim.mount(MountRequest(spec((image[1], "base"))))
    relaxed = shim.mount(MountRequest(spec((image[1], "base")), nosuid=False, nodev=False))
    try:
        for path in (sb.target, str(shim.paths.layer_mount(image[1]))):
            st = os.statvfs(path)
            assert st.f_flag & os.ST_NOSUID and st.f_flag & os.ST_NODEV, path
        st = os.statvfs(relaxed.target)
        assert not st.f_flag & os.ST_NOSUID and not st.f_flag & os.ST_NODEV
    finally:
        shim.unmount(sb.id)
        shim.unmount(relaxed.id)


# -- a hostile root filesystem ----------------------------------------------------------------------
def write_bundle_in_a_child(rootfs: Path, user: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`write_bundle` in a child process with 512 MiB of address space and a deadline: a hang or a
    read without end fails the test instead of the machine."""
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
from pathlib import Path
from layerstore import linux
from layerstore.errors import BadInput
from runtime_shim.backends.bundle import write_bundle
try:
    write_bundle(Path({str(tmp_path / 'bundle')!r}), {str(rootfs)!r}, {{"cmd": ["/bin/sh"], "user": {user!r}}},
                 None, sandbox="sb-x")
except BadInput as e:
    print("refused:", e)
else:
    print("written")
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE)


@pytest.mark.parametrize("user", ["", "nobody"])
def test_a_fifo_as_etc_passwd_does_not_hang_the_bundle(tmp_path: Path, user: str) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    os.mkfifo(rootfs / "etc" / "passwd")
    os.mkfifo(rootfs / "etc" / "group")
    p = write_bundle_in_a_child(rootfs, user, tmp_path)
    assert p.returncode == 0, p.stderr
    # refused for root too, naming the file: the runtime itself opens etc/passwd for every user
    assert p.stdout.startswith("refused: the environment's etc/passwd: a FIFO"), p.stdout


@pytest.mark.hostile
@pytest.mark.parametrize("how", ["group FIFO", "passwd link", "group too big", "passwd directory"])
def test_what_the_runtime_reads_is_checked_for_root_too(tmp_path: Path, how: str) -> None:
    rootfs = busybox_rootfs(tmp_path / "rootfs")
    etc = rootfs / "etc"
    name = how.split()[0]
    (etc / name).unlink()
    if how == "group FIFO":
        os.mkfifo(etc / "group")
    elif how == "passwd link":  # inside the container a link leads onto its /dev or /proc
        os.symlink("/dev/zero", etc / "passwd")
    elif how == "group too big":
        with open(etc / "group", "wb") as f:
            f.truncate(5 << 20)
    else:
        (etc / "passwd").mkdir()
    p = write_bundle_in_a_child(rootfs, "", tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"refused: the environment's etc/{name}"), p.stdout
    assert not (tmp_path / "bundle" / "config.json").exists()


@pytest.mark.parametrize("how", ["device", "device beyond a link", "host file beyond a link"])
def test_dev_zero_or_a_host_file_as_etc_passwd_is_refused(tmp_path: Path, how: str) -> None:
    rootfs, host = tmp_path / "rootfs", tmp_path / "host"
    rootfs.mkdir()
    host.mkdir()
    if how == "device":
        (rootfs / "etc").mkdir()
        os.mknod(rootfs / "etc" / "passwd", 0o644 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers
    elif how == "device beyond a link":
        os.mknod(host / "passwd", 0o644 | 0o020000, os.makedev(1, 5))
        os.symlink(str(host), rootfs / "etc")  # an absolute link: on the node it leads out of the root
    else:
        (host / "passwd").write_text("agent:x:4242:4242::/:/bin/sh\n")
        os.symlink(str(host), rootfs / "etc")
    p = write_bundle_in_a_child(rootfs, "agent", tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("refused: the environment's etc/passwd"), p.stdout


def test_a_hostile_layer_fails_the_run_cleanly(shim: Shim, tmp_path: Path) -> None:
    root = busybox_rootfs(tmp_path / "fifo-base")
    (root / "etc" / "passwd").unlink()
    os.mkfifo(root / "etc" / "passwd")
    blob = add_blob(shim.paths.root / "blobs2", mkfs(root, tmp_path / "fifo.img"))
    with Shim(NodePaths(shim.paths.root), DirBlobs(shim.paths.root / "blobs2")) as s2:
        th, result = in_background(runner.run, s2, spec((blob, "base"), config={**CONFIG, "user": "nobody"}),
                                   ["true"], stdin=subprocess.DEVNULL)
        th.join(DEADLINE)
        assert not th.is_alive(), "the bundle hung on a FIFO"
        assert isinstance(result[0], BadInput) and "FIFO" in str(result[0])
        assert s2.sandboxes() == []
