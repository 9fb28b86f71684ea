"""The microVM backend ("microvm"): QEMU microvm booted for real (TCG on this node kind), the
guest kit's kernel and init composing the root from one read-only drive per layer.

Pure parts first (the config drive, the status grammar, the command line).
Then one environment on a real store and node daemon, and three boots shared by the cases, in
order (module-scoped state; each case needs the one before):

1. a cold node, `run --keep`: output on stdout and stderr apart, the exit code, the environment's
   env/workdir/user and the caller's variables, a layer's whiteout and the workload's own delete,
   isolation seen from inside (only its drives, each read-only but its upper; no network), and
   laziness (the node daemon fetched well under the layers' size);
2. `layerctl commit` of the kept sandbox: a helper VM reads its upper drive; the new environment's
   layer has the workload's file and its delete; the layer blobs are untouched;
3. kill -9 of the node daemon, recovery, then `layerctl run --backend microvm` of the committed
   environment (resume: its drives read through the new daemon; not kept: its upper is a tmpfs
   in the guest) killed with kill -9 of the VMM (the run fails and is torn down), then
   `layerctl sandbox ls`, `recover` and `sandbox rm` of the kept one.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pwd
import signal
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.shim_support import busybox_image, busybox_rootfs, cleanup_node, dir_shim, loops_under, needs_busybox, spec
from testkit.vm_support import kill9_daemon, needs_vm, tcg

from runtime_shim.backends.base import Confinement
from runtime_shim.backends.microvm import MicrovmBackend
from runtime_shim.errors import ShimError
from runtime_shim.node.request import MountRequest
from runtime_shim.sandbox import runner
from runtime_shim.vm.config import GuestConfig, config_tar
from runtime_shim.vm.qemu import parse_status, qemu_argv
from runtime_shim.vm.spec import Drive, Stream, VmSpec, VmSpecError

CONF = Confinement(memory=256 << 20, cpus=1)


# -- pure parts -------------------------------------------------------------------------------------
def test_the_config_drive_carries_every_field_and_no_command_line() -> None:
    cfg = GuestConfig(("/bin/sh", "-c", "echo 'a b'\n"), ("PATH=/bin", "SECRET=s3cr3t"), workdir="/w", user="app:grp",
                      upper="drive", upper_size=123, nosuid=False, hostname="sb-1")
    raw = config_tar(cfg)
    assert len(raw) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert got["argv"] == b"/bin/sh\0-c\0echo 'a b'\n" and got["env"] == b"PATH=/bin\0SECRET=s3cr3t"
    assert (got["workdir"], got["user"], got["upper"], got["upper_size"], got["flags"]) == \
        (b"/w", b"app:grp", b"drive", b"123", b"nodev")
    with pytest.raises(ValueError):
        config_tar(GuestConfig(("a\0b",), ()))


def test_the_status_line_is_all_the_host_takes_from_the_guest() -> None:
    assert parse_status(b"exit 0\n") == (0, "")
    assert parse_status(b"exit 137\nexit 0\n") == (137, "")
    assert parse_status(b"error cannot mount layer 1\n") == (None, "cannot mount layer 1")
    for hostile in (b"", b"exit 256\n", b"exit -1\n", b"exit 1", b"exit 0000\n", b"\x1b[2Jexit 0\n",
                    b"error \x1b]0;pwned\x07\n", b"error " + b"x" * 5000 + b"\n", b"exit 1\x00\n"):
        code, why = parse_status(hostile)
        assert code is None and why.isprintable() and len(why) <= 300, hostile


def test_every_drive_but_the_upper_is_read_only(tmp_path: Path) -> None:
    spec = VmSpec("/k", "/i", "console=ttyS0", drives=(
        Drive("/n/fuse/blobs/b3:aa", serial="layer0"), Drive("/n/sb/upper.img", read_only=False, role="upper",
                                                               serial="upper"),
        Drive("/n/cfg.tar", role="config", serial="config")), streams=(Stream("stdout", "/run/x/o.sock"),))
    argv = qemu_argv(spec, tsc_khz=2_000_000)
    drives = [argv[i + 1] for i, a in enumerate(argv) if a == "-drive"]
    assert [("readonly=on" in d) for d in drives] == [True, False, True]
    assert "-net" in argv and argv[argv.index("-net") + 1] == "none"
    assert "tsc_early_khz=2000000" in argv[argv.index("-append") + 1]
    assert argv[argv.index("-machine") + 1] == "microvm,acpi=on"
    assert argv[argv.index("-serial") + 1] == "null" and "-runas" not in argv
    assert "elevateprivileges=deny" in argv[argv.index("-sandbox") + 1]
    dropped = qemu_argv(spec, runas="nobody")  # QEMU drops to nobody once its files are open
    assert dropped[dropped.index("-runas") + 1] == "nobody" and "spawn=deny" in dropped[dropped.index("-sandbox") + 1]
    logged = qemu_argv(VmSpec(**{**spec.__dict__, "console_log": "/n/console.log"}))
    assert logged[logged.index("-serial") + 1] == "chardev:console"  # a socket: the host keeps a bounded log
    assert "socket,id=console,path=/run/x/console.sock,server=off" in logged
    with pytest.raises(VmSpecError):
        VmSpec("/k", None, "", drives=(Drive("/a", read_only=False, serial="layer0"),)).check()
    with pytest.raises(VmSpecError):
        VmSpec("/k", None, "", drives=(Drive("/a,b", serial="layer0"),)).check()
    with pytest.raises(VmSpecError):
        VmSpec("/k", None, "", drives=(Drive("/a", serial="x" * 21),)).check()


@pytest.mark.root
@needs_busybox
def test_a_guest_composed_sandbox_has_its_layers_mounted_and_no_root_on_the_host(tmp_path: Path) -> None:
    from layerstore.linux import detach

    blobs, blob = busybox_image(tmp_path)
    with dir_shim(tmp_path, blobs) as shim:
        sb = shim.mount(MountRequest(spec((blob, "base")), guest="microvm", upper_image=64 << 20))
        assert sb.backend == "microvm" and not os.path.exists(sb.target)
        assert os.path.ismount(shim.paths.layer_mount(blob)) and shim.layer_refs() == {blob: 1}
        assert Path(sb.upper) == shim.paths.upper_image(sb.id) and Path(sb.upper).stat().st_size == 64 << 20
        assert not loops_under(shim.paths.root)  # the host never mounts the upper drive
        assert shim.check(sb.id).ok
        # a lost layer mount (a daemon restart) is mounted again; the sandbox gets no overlay
        detach(shim.paths.layer_mount(blob))
        rep = shim.recover()
        assert blob in rep.remounted_layers and not rep.remounted_sandboxes and not rep.broken
        assert os.path.ismount(shim.paths.layer_mount(blob)) and not os.path.exists(sb.target)
        with pytest.raises(ShimError):
            shim.mount(MountRequest(spec((blob, "base")), guest="microvm", upper_size=1 << 20))
        shim.unmount(sb.id)
        assert shim.sandboxes() == [] and shim.layer_refs() == {}
        assert not shim.paths.sandbox_dir(sb.id).exists() and not os.path.ismount(shim.paths.layer_mount(blob))


# -- booted for real --------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _tcg(monkeypatch: pytest.MonkeyPatch) -> None:
    tcg(monkeypatch)  # this node kind's /dev/kvm boots no guest


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A store with "mv:1": a busybox base (a user "app", /data/{keep,drop} owned by it, a 16 MiB
    file nobody reads) under a workspace that deletes /data/drop; a node (real daemon) on it."""
    from testkit.cli_helpers import layerctl

    from runtime_shim.node.shim import Shim

    root = tmp_path_factory.mktemp("microvm")
    url = str(root / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    base = busybox_rootfs(root / "base")
    (base / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n")
    (base / "etc" / "group").write_text("root:x:0:\napp:x:1000:\n")
    (base / "data").mkdir()
    for name in ("keep", "drop"):
        (base / "data" / name).write_text(f"{name}\n")
    (base / "opt").mkdir()
    (base / "opt" / "big").write_bytes(os.urandom(16 << 20))
    for p in (base / "data", base / "data" / "keep", base / "data" / "drop"):
        os.chown(p, 1000, 1000)
    ws = root / "ws"
    (ws / "data").mkdir(parents=True)
    os.mknod(ws / "data" / "drop", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout
    (ws / "data" / "new").write_text("new\n")
    os.chown(ws / "data", 1000, 1000)
    blobs = []
    for src, role in ((base, "base"), (ws, "workspace")):
        r = layerctl("build", str(src), "--push", "--store", url, "--role", role, "--json")
        assert r.code == 0, r.err
        blobs.append(r.json()["blob"])
    config = root / "config.json"
    config.write_text(json.dumps({"entrypoint": [], "cmd": ["/bin/sh"], "env": ["PATH=/bin", "FOO=from-env"],
                                  "workdir": "/work/dir", "user": "app"}))
    assert layerctl("env", "create", "--store", url, "--base", blobs[0], "--workspace", blobs[1],
                    "--config", str(config), "-t", "mv:1").code == 0
    node = root / "node"
    try:
        with Shim.for_node(node, url) as shim:
            yield {"root": root, "url": url, "blobs": blobs, "shim": shim, "boots": []}
    finally:
        cleanup_node(node, root)
        for rec in (node / "microvm" / "run").glob("*.json") if (node / "microvm" / "run").exists() else []:
            with contextlib.suppress(OSError, ValueError, ProcessLookupError):
                os.kill(json.loads(rec.read_text())["pid"], signal.SIGKILL)


def _run(world: dict[str, Any], env: str, script: str, **kw: Any) -> tuple[int, str, str]:
    out, err = world["root"] / "out", world["root"] / "err"
    t = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        res = runner.run(world["shim"], env, ["/bin/sh", "-c", script], runtime="microvm", confinement=CONF,
                         stdout=o, stderr=e, **kw)
    world["boots"].append(round(time.monotonic() - t, 1))  # (reported, never asserted on)
    world["last"] = res.sandbox
    return res.exit_code, out.read_text(), err.read_text()


def _blob_sha(world: dict[str, Any]) -> dict[str, str]:
    shim = world["shim"]
    out = {}
    for blob in world["blobs"]:
        with open(shim.paths.fuse / "blobs" / blob, "rb") as f:
            out[blob] = hashlib.sha256(f.read(1 << 20)).hexdigest()
    return out


@pytest.mark.root
@needs_busybox
@needs_vm
def test_1_run_on_a_cold_node(world: dict[str, Any]) -> None:
    from testkit.cli_helpers import layerctl

    script = r"""
        echo "out: $FOO $EXTRA $(pwd) $(id -u):$(id -g)"; echo "to-stderr" >&2
        cat /data/keep; test -e /data/drop || echo "drop: gone"; cat /data/new
        rm /data/keep && echo "deleted keep"; echo "written" > /data/out
        echo "devices: $(ls /sys/block | tr '\n' ' ')"
        for b in /sys/block/vd*; do echo "ro $(cat $b/serial) $(cat $b/ro)"; done
        echo "nets: $(ls /sys/class/net | tr '\n' ' ')"
        grep -q from-caller /proc/cmdline && echo "SECRET ON THE KERNEL COMMAND LINE"
        exit 7"""
    code, out, err = _run(world, "mv:1", script, keep=True, extra_env=["EXTRA=from-caller"])
    assert code == 7, (out, err)
    assert "out: from-env from-caller /work/dir 1000:1000\n" in out
    assert err == "to-stderr\n"
    assert "keep\n" in out and "drop: gone\n" in out and "new\n" in out and "deleted keep\n" in out
    ro = dict(line.split()[1:] for line in out.splitlines() if line.startswith("ro "))
    assert ro == {"layer0": "1", "layer1": "1", "upper": "0", "config": "1"}, out  # nothing else, all ro but upper
    assert "nets: lo \n" in out  # no network at all
    assert "SECRET" not in out  # the caller's variables travel on the config drive
    # laziness: the guest read busybox and a few files; the 16 MiB nobody read was never fetched
    shim = world["shim"]
    r = layerctl("stats", "--cache", str(shim.paths.cache), "--json")
    assert r.code == 0, r.err
    st = r.json()["blobs"]
    assert st[world["blobs"][0]]["fetched_bytes"] < st[world["blobs"][0]]["size"] // 4
    assert sum(s["fetched_bytes"] for s in st.values()) < sum(s["size"] for s in st.values()) // 4
    sbs = shim.sandboxes()
    assert [(s.id, s.backend) for s in sbs] == [(world["last"], "microvm")]
    assert MicrovmBackend.kept(sbs[0]) and not os.path.ismount(sbs[0].target)
    world["kept"] = sbs[0]


@pytest.mark.root
@needs_busybox
@needs_vm
def test_2_commit_reads_the_upper_drive_in_a_helper_vm(world: dict[str, Any]) -> None:
    from testkit.cli_helpers import layerctl

    sb = world.get("kept")
    if sb is None:
        pytest.skip("needs test_1's kept sandbox")
    shim = world["shim"]
    before = _blob_sha(world)
    t = time.monotonic()
    r = layerctl("commit", sb.id, "-t", "mv:2", "--store", world["url"], "--node-dir", str(shim.paths.root), "--json")
    world["boots"].append(round(time.monotonic() - t, 1))
    assert r.code == 0, r.err
    res = r.json()
    assert res["layer"] not in world["blobs"] and res["frozen"] == []
    assert _blob_sha(world) == before  # the layers' blobs are as they were
    # the new environment on the host (a container-style mount is enough to look)
    look = shim.mount(MountRequest("mv:2"))
    try:
        data = Path(look.target) / "data"
        assert sorted(os.listdir(data)) == ["new", "out"]
        assert (data / "out").read_text() == "written\n"
    finally:
        shim.unmount(look.id)
    with pytest.raises(ShimError):  # nothing of a sandbox that was not kept to commit
        MicrovmBackend(shim.paths).upper_source(type(sb)(**{**sb.to_json(), "upper": "/nonexistent.img"}))


@pytest.mark.root
@needs_busybox
@needs_vm
def test_3_daemon_and_vmm_killed_then_recovered(world: dict[str, Any]) -> None:
    shim = world["shim"]
    if "kept" not in world:
        pytest.skip("needs test_1's kept sandbox")
    rec = kill9_daemon(shim)
    rep = shim.recover()
    assert rep.daemon_generation and rep.daemon_generation != f"daemon:{rec.pid}:{rec.start_time}"
    # resume through the CLI: the committed environment boots (its drives read through the new
    # daemon); the VMM is killed once the workload runs
    from testkit.cli_helpers import LAYERCTL, layerctl

    node = str(shim.paths.root)
    out, err = world["root"] / "out3", world["root"] / "err3"
    script = "cat /data/out; test -e /data/keep || echo keep-gone; echo tmp > /data/t && cat /data/t; sleep 600"
    t = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([LAYERCTL, "run", "--backend", "microvm", "--memory", "256M", "--cpus", "1",
                                 "--store", world["url"], "--node-dir", node, "mv:2", "--", "/bin/sh", "-c", script],
                                stdin=subprocess.DEVNULL, stdout=o, stderr=e)
    try:
        runs = shim.paths.root / "microvm" / "run"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "tmp" not in out.read_text() and proc.poll() is None:
            time.sleep(0.2)
        world["boots"].append(round(time.monotonic() - t, 1))
        assert out.read_text() == "written\nkeep-gone\ntmp\n", err.read_text()  # (its upper: a tmpfs)
        (rec_file,) = runs.glob("*.json")
        pid = json.loads(rec_file.read_text())["pid"]
        uids = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
        assert set(uids.split()[1:]) == {str(pwd.getpwnam("nobody").pw_uid)}  # QEMU runs unprivileged
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(60) == 1  # no exit status: the VM died (ShimError)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "layerctl: error:" in err.read_text() and "no exit status" in err.read_text()
    r = layerctl("sandbox", "ls", "--node-dir", node, "--json")
    assert r.code == 0, r.err
    listed = {s["sandbox"]: s["backend"] for s in r.json()["sandboxes"]}
    assert listed == {world["kept"].id: "microvm"}  # the resumed run was not kept: torn down after the kill
    r = layerctl("recover", "--node-dir", node, "--json")
    assert r.code == 0, r.err
    assert not list(runs.glob("*.json"))  # no VMM left on record
    for sid in listed:
        assert layerctl("sandbox", "rm", "--node-dir", node, sid).code == 0
    assert shim.sandboxes() == [] and shim.layer_refs() == {}
    print("boot wall times (s):", world["boots"])
