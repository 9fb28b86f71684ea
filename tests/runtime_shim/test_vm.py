"""The full-VM backend ("vm") booted for real: QEMU q35 under TCG here, the guest kit's kernel
and init, the environment's root as one multi-device EROFS device over the layer blobs. The same
cases as the container backend: output and exit code, environment variables and workdir, what a
layer deleted stays deleted (and what the workload deletes), recovery after kill -9 of the VMM,
and laziness through the node daemon; the same cases with the layers as virtio-pmem devices
mounted with DAX (`--layer-device pmem`), whose guest page cache stays out of the layers' reads
and whose VMs share the host's pages of a layer. Boots are shared: each test boots once (the
sharing test twice, at once)."""

from __future__ import annotations

import io
import os
import select
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.shim_support import busybox_rootfs, cleanup_node, needs_busybox, spec
from testkit.vm_support import kill9_daemon, needs_vm, tcg

from erofs_builder.build import build_layer
from erofs_builder.tree import Entry, Kind
from layerstore import digest as digestmod
from runtime_shim.backends.vm import VmBackend
from runtime_shim.errors import ShimError
from runtime_shim.node.blobs import DirBlobs
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.paths import NodePaths
from runtime_shim.sandbox import runner
from runtime_shim.vm import hostmem
from runtime_shim.vm.pmem import PMEM_ALIGN, image_path, padded
from runtime_shim.vm.qemu import qemu_argv

pytestmark = [pytest.mark.root, needs_busybox, needs_vm]


@pytest.fixture(autouse=True)
def _tcg(monkeypatch: pytest.MonkeyPatch) -> None:
    tcg(monkeypatch)


@pytest.fixture(scope="module")
def blobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """base: busybox + /data/{keep,drop} + /big/plain (16 MiB, whole blocks: a flat file, which the
    6.1 guest reads through DAX from a pmem layer); top: a whiteout of /data/drop, /data/new, an
    opaque /etc/opt."""
    root = tmp_path_factory.mktemp("vmenv")
    base = busybox_rootfs(root / "base")
    (base / "data").mkdir()
    (base / "data" / "keep").write_text("keep\n")
    (base / "data" / "drop").write_text("drop\n")
    (base / "etc" / "opt").mkdir()
    (base / "etc" / "opt" / "old").write_text("old\n")
    (base / "big").mkdir()
    (base / "big" / "plain").write_bytes(os.urandom(BIG))
    from erofs_builder.sources.source_dir import dir_entries

    d = root / "blobs"
    d.mkdir()
    names = []
    for i, entries in enumerate([
        list(dir_entries(base, all_root=True)),
        [(Entry(b"data/drop", Kind.CHR, rdev=(0, 0)), None), (Entry(b"data/new", Kind.REG, size=4), (b"new\n",)),
         (Entry(b"etc/opt", Kind.DIR, xattrs={b"trusted.overlay.opaque": b"y"}), None),
         (Entry(b"etc/opt/fresh", Kind.REG, size=6), (b"fresh\n",))],
    ]):
        img = root / f"l{i}.erofs"
        build_layer(entries, img)
        name = digestmod.of(img.read_bytes())
        shutil.copy(img, d / name)
        names.append(name)
    return d, names


@pytest.fixture
def vm_shim(tmp_path: Path, blobs: tuple[Path, list[str]]) -> Iterator[Shim]:
    node = tmp_path / "node"
    paths = NodePaths(node)
    try:
        with Shim(paths, DirBlobs(blobs[0]), backends={"vm": VmBackend(paths)}) as s:
            yield s
    finally:
        cleanup_node(node, tmp_path)


def env(blobs: tuple[Path, list[str]]):  # noqa: ANN201 - an EnvSpec
    base, top = blobs[1]
    return spec((base, "base"), (top, "workspace"),
                config={"entrypoint": [], "cmd": ["/bin/sh"], "env": ["FROM_ENV=env-value", "PATH=/bin"],
                        "workdir": "/data", "user": ""})


BIG = 16 << 20
CACHED = "awk '/^Cached:/ { print $2 }' /proc/meminfo"  # the guest's page cache, kB
# the guest's root writes 64 KiB of random bytes at the end of its first pmem device (past the
# EROFS image: the guest's own mount is unharmed); the host's image must not change
WRITE_PMEM = ("if [ -e /sys/block/pmem0 ]; then mknod /dev/p b $(tr : ' ' < /sys/block/pmem0/dev) "
              "&& head -c 65536 /dev/urandom > /r && dd if=/r of=/dev/p bs=4096 conv=fsync "
              "seek=$(($(cat /sys/block/pmem0/size) / 8 - 16)) 2>/dev/null && echo wrote; rm -f /dev/p /r; fi")


@pytest.mark.parametrize("device", ["blk", "pmem"])
def test_output_exit_code_env_workdir_and_deletions(vm_shim: Shim, blobs: tuple[Path, list[str]], device: str) -> None:
    backend: VmBackend = vm_shim.backends["vm"]  # type: ignore[assignment]
    backend.use_layer_device(device)
    script = ("echo out; echo err >&2; pwd; echo $FROM_ENV $EXTRA; ls /data; ls /etc/opt; "
              "rm /data/keep; ls /data; cat /data/keep 2>/dev/null || echo gone; "
              "ls /dev | grep -c '^vd\\|^pmem'; "
              f"a=$({CACHED}); cat /big/plain > /dev/null; b=$({CACHED}); echo $((b - a)); {WRITE_PMEM}; exit 7")
    out, err = io.BytesIO(), io.BytesIO()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    got: dict[int, bytes] = {}

    def drain(fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            got[fd] = f.read()

    readers = [threading.Thread(target=drain, args=(fd,)) for fd in (r_out, r_err)]
    for t in readers:
        t.start()
    try:
        res = runner.run(vm_shim, env(blobs), ["/bin/sh", "-c", script], runtime="vm", extra_env=["EXTRA=x1"],
                         stdout=w_out, stderr=w_err)
    finally:
        os.close(w_out)
        os.close(w_err)
        for t in readers:
            t.join()
    out.write(got[r_out])
    err.write(got[r_err])
    assert res.exit_code == 7
    lines = out.getvalue().decode().splitlines()
    if device == "pmem":
        assert lines.pop() == "wrote"  # (the guest's root wrote to its pmem device: see below)
    grew_kib = int(lines.pop())  # the guest's page cache after reading /big/plain
    assert lines == [
        "out", "/data", "env-value x1",
        "keep", "new",  # the top layer's whiteout hides /data/drop
        "fresh",  # an opaque directory hides the base's /etc/opt/old
        "new", "gone",  # what the workload deleted stays deleted
        "0",  # no block device of the VM (its layer blobs, its disks) inside the sandbox's /dev
    ]
    assert err.getvalue() == b"err\n"
    # nothing of the run is left: the VMM is gone, its record and sockets too; the root image stays
    assert backend.leftovers() == [] and not vm_shim.sandboxes()
    (mounts,) = backend.layer_mounts.values()  # what the guest's init reported
    roots = list((vm_shim.paths.root / "vm" / "roots").glob("*.erofs"))
    if device == "blk":
        assert len(roots) == 1
        assert [(m[0], m[2], "dax=always" in m[3]) for m in mounts] == [("/dev/vda", "erofs", False)]
        assert grew_kib >= (BIG >> 10) * 9 // 10  # the guest cached the file
        return
    # pmem: no root image; one DAX mount per layer, each on its pmem device
    assert roots == []
    assert [(m[1], m[2], "dax=always" in m[3]) for m in mounts] == [("/layers/0", "erofs", True),
                                                                     ("/layers/1", "erofs", True)]
    assert sorted(m[0] for m in mounts) == ["/dev/pmem0", "/dev/pmem1"]  # (the init picks each by PCI slot)
    assert grew_kib < 2048  # read through DAX: the guest's page cache holds none of it
    # each layer's pmem image: the blob, then zeros to a multiple of 2 MiB, named by its digest;
    # the guest's write to its device reached neither (read-only at the VMM)
    for name in blobs[1]:
        img = image_path(vm_shim.paths.root / "vm" / "pmem", name)
        data, blob = img.read_bytes(), (blobs[0] / name).read_bytes()
        assert len(data) % PMEM_ALIGN == 0 and len(data) - len(blob) < PMEM_ALIGN
        assert data[:len(blob)] == blob and not data[len(blob):].strip(b"\0")


def test_two_pmem_vms_share_the_host_pages_of_a_layer(vm_shim: Shim, blobs: tuple[Path, list[str]]) -> None:
    """Two VMs at once read the same 16 MiB file of a pmem layer: both map the same host pages
    (each QEMU's mapping of the layer's image holds them shared: Pss about half its Rss), so the
    host holds the file once (the two mappings' Pss sum to one copy), and neither guest caches it."""
    backend: VmBackend = vm_shim.backends["vm"]  # type: ignore[assignment]
    backend.use_layer_device("pmem")
    image = os.path.realpath(image_path(vm_shim.paths.root / "vm" / "pmem", blobs[1][0]))
    script = f"a=$({CACHED}); cat /big/plain > /dev/null; b=$({CACHED}); echo $((b - a)); sleep 600"
    pipes = {name: os.pipe() for name in ("p1", "p2")}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            runner.run(vm_shim, env(blobs), ["/bin/sh", "-c", script], runtime="vm", sandbox=name,
                       stdout=pipes[name][1], stderr=pipes[name][1])
        except BaseException as e:  # noqa: BLE001 - the kill below ends each run with a ShimError
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in pipes]
    for t in threads:
        t.start()
    try:
        grew = {name: first_line(r, 240) for name, (r, _w) in pipes.items()}  # after the guest read the file
        pids = {n: backend.live_pid(n) for n in pipes}
        maps = {n: hostmem.mappings(pid).by_path[image] for n, pid in pids.items() if pid is not None}
    finally:
        for name in pipes:
            pid = backend.live_pid(name)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        for r, w in pipes.values():
            os.close(r)
            os.close(w)
    assert all(isinstance(e, ShimError) for e in errors) and len(errors) == 2
    assert set(maps) == {"p1", "p2"} and all(0 <= g < 2048 for g in grew.values()), (grew, maps)
    for u in maps.values():
        # the file's pages, mapped and shared (a few metadata pages only one guest looked at are its own)
        assert u.rss >= BIG and u.shared_clean >= u.rss - (1 << 20) and u.shared_dirty == u.private_dirty == 0
        assert u.pss <= u.rss // 2 + (1 << 20)  # split between the two VMs
    one_copy = sum(u.pss for u in maps.values())
    assert one_copy <= hostmem.resident(image) + (1 << 20)
    assert BIG <= one_copy < BIG * 3 // 2  # once, not twice
    assert backend.leftovers() == [] and not vm_shim.sandboxes()


def first_line(fd: int, timeout: float) -> int:
    """The number on the first line written to `fd` within `timeout` seconds (-1: none)."""
    got = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in got and (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            got += chunk
    line = got.split(b"\n", 1)[0].strip()
    return int(line) if line.lstrip(b"-").isdigit() else -1


def test_kill9_of_the_vmm_then_recover(vm_shim: Shim, blobs: tuple[Path, list[str]]) -> None:
    backend: VmBackend = vm_shim.backends["vm"]  # type: ignore[assignment]
    errors: list[BaseException] = []
    codes: list[int] = []

    def run() -> None:
        with open(os.devnull, "wb") as null:
            try:
                codes.append(runner.run(vm_shim, env(blobs), ["/bin/sh", "-c", "sleep 600"], runtime="vm", keep=True,
                                        sandbox="k1", stdout=null, stderr=null).exit_code)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 120
    while backend.status("k1") != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.status("k1") == "running"
    spec_ = backend.spec("k1")
    # every drive read-only but the sandbox's own upper, in the VMM's own command line too
    assert [(d.serial, d.read_only) for d in spec_.drives][-2:] == [("upper", False), ("config", True)]
    argv = " ".join(qemu_argv(spec_))
    assert argv.count("readonly=off") == 1 and "-net none" in argv
    pid = backend.live_pid("k1")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    th.join(60)
    assert not th.is_alive()
    assert codes == [] and len(errors) == 1 and isinstance(errors[0], ShimError)
    assert backend.status("k1") is None  # the run deleted its workload on the way out
    assert [s.id for s in vm_shim.sandboxes()] == ["k1"]  # kept
    # a VMM killed while nobody waits for it: recovery finds its record and deletes it
    (backend.base / "run").mkdir(exist_ok=True)
    backend.record("k1").write_text(f'{{"pid": {pid}, "start": 1}}')
    assert backend.status("k1") == "stopped"
    rep = vm_shim.recover()
    assert "vm:k1" in rep.deleted_containers and backend.leftovers() == []
    vm_shim.unmount("k1")
    assert not (vm_shim.paths.sandbox_dir("k1")).exists()


def test_cold_node_laziness_commit_kill9_of_the_daemon_and_resume(tmp_path: Path) -> None:
    """Through the node daemon and a store: a kept VM sandbox on a cold node fetches only what
    its root image's making and its guest read; its writes and deletions are committed (read by a
    helper VM from the upper drive); after kill -9 of the daemon and recovery, a VM of the
    committed environment sees them, reading through the new daemon."""
    from testkit.cli_helpers import layerctl
    from testkit.shim_support import store_shim

    from layerstore.store import Store
    from runtime_shim.sandbox.commit import commit

    url = str(tmp_path / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    base = busybox_rootfs(tmp_path / "base")
    (base / "data").mkdir()
    (base / "data" / "drop").write_text("drop\n")
    tk = tmp_path / "tk"
    (tk / "opt").mkdir(parents=True)
    (tk / "opt" / "big").write_bytes(os.urandom(8 << 20))
    blobs = []
    for src in (base, tk):
        r = layerctl("build", str(src), "--push", "--store", url, "--all-root", "--json")
        assert r.code == 0, r.err
        blobs.append(r.json()["blob"])
    assert layerctl("env", "create", "--store", url, "--base", blobs[0], "--toolkit", blobs[1], "-t", "big:1").code == 0
    out = tmp_path / "out"
    with store_shim(tmp_path, url) as shim:
        shim.backends["vm"] = VmBackend(shim.paths)
        script = "cat /etc/motd; ls -l /opt/big; rm /data/drop; echo mine > /data/mine; mkdir -p /w/x"
        with open(out, "wb") as f:
            res = runner.run(shim, "big:1", ["/bin/sh", "-c", script], runtime="vm", keep=True, sandbox="c1",
                             stdout=f, stderr=f)
        text = out.read_text()
        assert res.exit_code == 0, text
        assert "base motd" in text and str(8 << 20) in text
        r = layerctl("stats", "--cache", str(shim.paths.cache), "--json")
        assert r.code == 0, r.err
        st = r.json()["blobs"]
        big = st[blobs[1]]
        assert big["fetched_bytes"] < big["size"] // 4  # the 8 MiB file was listed, never read
        assert sum(s["fetched_bytes"] for s in st.values()) < sum(s["size"] for s in st.values()) // 2
        with Store.open(url) as store:
            done = commit(store, shim.find("c1"), "big:c1", backends=shim.backends.values())
        assert done.files >= 4  # data/, data/drop (a whiteout), data/mine, w/, w/x
        shim.unmount("c1")
        # kill -9 of the node daemon, then recovery: the next VM reads through the new daemon
        kill9_daemon(shim)
        shim.recover()
        # resume through the CLI, as a user would: `layerctl run --backend vm` on the same node, on
        # pmem layers: their images are copied through the new daemon, which fetches them whole
        check = "ls /data; cat /data/mine; ls -d /w/x; head -c 100000 /opt/big | wc -c; exit 4"
        r = layerctl("run", "--backend", "vm", "--layer-device", "pmem", "--store", url, "--node-dir",
                     str(shim.paths.root), "big:c1", "--", "/bin/sh", "-c", check, timeout=600,
                     env={"LAYERSTORE_VM_ACCEL": "tcg"})
        assert (r.code, r.out.split()) == (4, ["mine", "mine", "/w/x", "100000"]), r.err
        assert shim.backends["vm"].leftovers() == [] and not shim.sandboxes()
        r = layerctl("stats", "--cache", str(shim.paths.cache), "--json")
        assert r.code == 0, r.err
        st = r.json()["blobs"]
        # a pmem layer is a complete one: the 8 MiB file no guest read was fetched for the copy (by
        # the new daemon, whose figures these are: the old one had fetched under a quarter)
        assert st[blobs[1]]["fetched_bytes"] > st[blobs[1]]["size"] // 2
        images = shim.paths.root / "vm" / "pmem"
        assert all(image_path(images, b).stat().st_size % PMEM_ALIGN == 0 for b in [*blobs, done.layer])
        assert image_path(images, blobs[1]).stat().st_size == padded(st[blobs[1]]["size"])


def test_backend_bookkeeping_without_a_boot(tmp_path: Path) -> None:
    """What clean-up relies on, with no VM: constructing touches nothing; an unknown sandbox is
    unknown; a record whose process is gone is "stopped" and is deleted; delete is idempotent."""
    paths = NodePaths(tmp_path / "node")
    b = VmBackend(paths)
    assert not (tmp_path / "node").exists()
    assert (b.has("x"), b.status("x"), b.leftovers(), b.pause("x")) == (False, None, [], False)
    b.delete("x")
    with pytest.raises(ShimError):
        b.spec("x")
    b.record("x").parent.mkdir(parents=True)
    b.record("x").write_text('{"pid": 1, "start": 0}')  # pid 1 never started at tick 0
    assert (b.has("x"), b.status("x"), b.leftovers(), b.live_pid("x")) == (True, "stopped", ["x"], None)
    b.delete("x")
    b.delete("x")
    assert (b.has("x"), b.leftovers()) == (False, [])
    assert len(b.sockets("x").name) < 40 and len(str(b.sockets("x") / "status.sock")) < 100


def test_layer_devices_without_a_boot(tmp_path: Path) -> None:
    """--layer-device: pmem on q35 (shared read-only, at its PCI slot), refused on microvm with
    the reason; the pmem image is the blob (an EROFS image) padded with zeros; the guest's mounts
    report is parsed as hostile input."""
    from layerstore.errors import ConfigError
    from runtime_shim.backends.microvm import MicrovmBackend
    from runtime_shim.vm.pmem import pmem_image, sweep
    from runtime_shim.vm.qemu import parse_mounts
    from runtime_shim.vm.spec import Pmem, VmSpec, VmSpecError

    paths = NodePaths(tmp_path / "node")
    vm, micro = VmBackend(paths), MicrovmBackend(paths)
    vm.use_layer_device("pmem")
    with pytest.raises(ConfigError, match="device-memory"):
        micro.use_layer_device("pmem")
    with pytest.raises(ConfigError):
        vm.use_layer_device("nvme")
    assert (vm.layer_device, micro.layer_device) == ("pmem", "blk")
    from erofs_builder.erofs import format as fmt

    img = tmp_path / "l.img"
    content = b"x" * fmt.SUPER_OFFSET + fmt.MAGIC.to_bytes(4, "little") + b"y" * 3972
    img.write_bytes(content)
    q35 = VmSpec(kernel="/k", initrd=None, cmdline="c", machine="q35", pmem=(Pmem(str(img), 2 << 20),))
    argv = qemu_argv(q35)
    assert argv[argv.index("-m") + 1] == "256M,slots=1,maxmem=258M"
    assert f"memory-backend-file,id=pm0,share=on,readonly=on,mem-path={img},size={2 << 20}" in argv
    assert "virtio-pmem-pci,memdev=pm0,id=pmem0,bus=pcie.0,addr=0x10" in argv
    with pytest.raises(VmSpecError, match="microvm"):
        qemu_argv(VmSpec(kernel="/k", initrd=None, cmdline="c", machine="microvm", pmem=q35.pmem))
    with pytest.raises(VmSpecError, match="2 MiB"):
        VmSpec(kernel="/k", initrd=None, cmdline="c", machine="q35", pmem=(Pmem(str(img), 5000),)).check()
    # the image: named by the blob's id, its bytes the blob's, zeros after
    assert (padded(1), padded(2 << 20), padded((2 << 20) + 1)) == (2 << 20, 2 << 20, 4 << 20)
    blob = digestmod.of(content)
    d = tmp_path / "pmem"
    path, size = pmem_image(d, blob, img)
    assert size == 2 << 20 and path.read_bytes() == content + bytes(size - len(content))
    assert pmem_image(d, blob, tmp_path / "gone") == (path, size)  # there already: no copy
    other = digestmod.of(b"other")
    (tmp_path / "junk").write_bytes(b"z" * 5000)
    for source, why in ((tmp_path / "junk", "no EROFS image"), (tmp_path / "gone", "cannot make")):
        with pytest.raises(ShimError, match=why):
            pmem_image(d, other, source)
    assert not image_path(d, other).exists() and not list(d.glob(".*.tmp"))
    (d / f".{image_path(d, other).name}.abc.tmp").write_bytes(b"half")  # a copy that died
    assert [p.name.endswith(".tmp") for p in sweep(d)] == [True] and not list(d.glob(".*.tmp"))
    # the host's check of a pmem guest's report: every layer mounted, each with DAX
    import json
    import subprocess

    from runtime_shim.backends.base import Execution
    from runtime_shim.vm.qemu import QemuVm

    vm.workdir("s").mkdir(parents=True)
    (vm.workdir("s") / "vm.json").write_text(json.dumps({"layer_device": "pmem", "pmem": [["/a", 1], ["/b", 1]]}))
    dax = b"/dev/pmem0 /layers/0 erofs ro,dax=always 0 0\n/dev/pmem1 /layers/1 erofs ro,dax=always 0 0\n"
    for report, ok in ((dax, True), (dax.replace(b",dax=always", b"", 1), False), (dax[:46], False), (b"", False)):
        proc = subprocess.Popen(["true"])
        vm.running["s"] = QemuVm(proc, status=bytearray(b"exit 3\n"), mounts=bytearray(report))
        if ok:
            assert vm.wait(Execution("s", proc)) == 3
        else:
            with pytest.raises(ShimError, match="with DAX"):
                vm.wait(Execution("s", proc))
    # what the guest says about its mounts: fields of printable ASCII, nothing else
    raw = (b"/dev/pmem0 /layers/0 erofs ro,dax=always 0 0\n\xff\xfe bad line\n \n"
           b"/dev/pmem1 /layers/1 erofs ro 0 0\n" + b"x" * 5000)
    assert parse_mounts(raw) == [("/dev/pmem0", "/layers/0", "erofs", ("ro", "dax=always")),
                                 ("/dev/pmem1", "/layers/1", "erofs", ("ro",))]


def test_layerctl_run_layer_device_refusals(tmp_path: Path) -> None:
    from testkit.cli_helpers import layerctl

    r = layerctl("run", "--layer-device", "pmem", "--node-dir", str(tmp_path / "n"), "x:1", "--", "true")
    assert r.code == 2 and "VM backends" in r.err
    r = layerctl("run", "--backend", "microvm", "--layer-device", "pmem", "--node-dir", str(tmp_path / "n"), "x:1",
                 "--", "true")
    assert r.code == 2 and "no device-memory area" in r.err
