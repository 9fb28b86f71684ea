"""Pure units of the runtime shim: overlay options, mount(8) helper argv, OCI config, mountinfo."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from layerstore import linux
from layerstore.errors import BadInput, ConfigError
from runtime_shim.backends import bundle
from runtime_shim.backends.base import Confinement
from runtime_shim.errors import ShimError
from runtime_shim.mount_helper import parse_mount_argv, parse_umount_argv
from runtime_shim.node import overlay
from runtime_shim.nodestate.paths import check_sandbox_id, new_sandbox_id, resolve_node_dir
from runtime_shim.resolve.environment import LayerSpec
from runtime_shim.sandbox.commit import committed_layers, layer_entries


def test_overlay_options_stack_top_first() -> None:
    opts = overlay.options(["/n/layers/ws", "/n/layers/tk", "/n/layers/base"], "/n/s/up", "/n/s/work")
    assert opts.startswith("lowerdir=/n/layers/ws:/n/layers/tk:/n/layers/base,upperdir=/n/s/up,workdir=/n/s/work")
    assert "redirect_dir=off" in opts and "metacopy=off" in opts and "index=off" in opts


@pytest.mark.parametrize("bad", ["/a,b", "/a:b", "/a b", "/a\\b"])
def test_overlay_refuses_paths_it_cannot_express(bad: str) -> None:
    with pytest.raises(ConfigError):
        overlay.options([bad], "/u", "/w")


def test_overlay_needs_a_layer_and_at_most_500() -> None:
    with pytest.raises(ShimError):
        overlay.options([], "/u", "/w")
    with pytest.raises(ShimError):
        overlay.options([f"/l{i}" for i in range(501)], "/u", "/w")


def test_node_dir_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAYERSTORE_NODE_DIR", raising=False)
    assert str(resolve_node_dir()) == "/var/lib/layerstore"
    monkeypatch.setenv("LAYERSTORE_NODE_DIR", "/srv/node")
    assert str(resolve_node_dir()) == "/srv/node"
    assert str(resolve_node_dir("/x/y")) == "/x/y"
    with pytest.raises(ConfigError):
        resolve_node_dir("/x,y")


def test_sandbox_ids() -> None:
    assert check_sandbox_id("task-1.a_b") == "task-1.a_b"
    for bad in ("", ".trash", "../x", "a/b", "x" * 129):
        with pytest.raises(ConfigError):
            check_sandbox_id(bad)
    assert new_sandbox_id() != new_sandbox_id()


def test_mount_helper_argv_as_mount8_passes_it() -> None:
    req = parse_mount_argv(["bb:1", "/mnt/x", "-n", "-o", "rw,sandbox=s1,upper=/u/s1,eager,node_dir=/n"])
    assert (req.env, req.target, req.sandbox, req.upper, req.node_dir, req.eager) == \
        ("bb:1", "/mnt/x", "s1", "/u/s1", "/n", True)
    assert req.ignored == ["rw"]
    req = parse_mount_argv(["-sfv", "-o", "whatever=1,sandbox=s2", "b3:" + "0" * 64, "/t", "-t", "layerstore"])
    assert req.fake and req.verbose and req.sandbox == "s2" and req.ignored == ["whatever=1"]
    assert parse_mount_argv(["e:1", "/t", "-osandbox=a"]).sandbox == "a"


@pytest.mark.parametrize("argv", [["only-one"], ["a", "b", "c"], ["a", "b", "-o", "bogus=1"], ["a", "b", "-x"],
                                  ["a", "b", "-o", "ro"]])
def test_mount_helper_bad_argv(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_mount_argv(argv)


def test_umount_helper_argv() -> None:
    assert parse_umount_argv(["/mnt/x", "-n", "-t", "overlay"]) == "/mnt/x"
    with pytest.raises(ConfigError):
        parse_umount_argv(["-l"])


def test_oci_config_defaults() -> None:
    cfg = bundle.oci_config("/n/s/rootfs", ["/bin/sh"], env=["PATH=/bin"], hostname="sb-1")
    assert cfg["root"] == {"path": "/n/s/rootfs", "readonly": False}
    assert cfg["process"]["user"] == {"uid": 0, "gid": 0}
    assert {n["type"] for n in cfg["linux"]["namespaces"]} == {"pid", "ipc", "uts", "mount", "network"}
    assert not any(n.get("path") for n in cfg["linux"]["namespaces"])  # new namespaces, loopback only
    dests = {m["destination"] for m in cfg["mounts"]}
    assert {"/proc", "/dev", "/sys", "/tmp"} <= dests
    assert all(m["type"] != "bind" for m in cfg["mounts"])  # nothing of the node is bound in
    # least privilege by default
    proc = cfg["process"]
    assert proc["noNewPrivileges"] is True
    assert set(proc["capabilities"]["bounding"]) == set(bundle.CAPABILITIES)
    assert "CAP_SYS_ADMIN" not in proc["capabilities"]["bounding"] and "inheritable" not in proc["capabilities"]
    assert {"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware", "/proc/scsi",
            "/proc/acpi"} <= set(cfg["linux"]["maskedPaths"])
    readonly = set(cfg["linux"]["readonlyPaths"])
    assert {"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"} <= readonly
    sec = cfg["linux"]["seccomp"]
    assert sec["defaultAction"] == "SCMP_ACT_ALLOW"
    assert sec["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    denied = {n for r in sec["syscalls"] if "args" not in r for n in r["names"] if r["errnoRet"] == errno.EPERM}
    assert {"keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load",
            "kexec_file_load", "init_module", "finit_module", "delete_module", "mount", "umount2", "pivot_root",
            "swapon", "swapoff", "reboot", "syslog", "acct", "settimeofday", "clock_settime", "clock_adjtime",
            "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "setns", "ptrace"} <= denied
    assert {n: r["errnoRet"] for r in sec["syscalls"] for n in r["names"] if n == "clone3"} == {"clone3": errno.ENOSYS}
    assert {n for r in sec["syscalls"] if "args" in r for n in r["names"]} == {"clone", "unshare", "personality"}
    assert cfg["linux"]["resources"] == {"devices": [{"allow": False, "access": "rwm"}]}  # (no limit given)


def test_oci_config_confinement_and_its_relaxations() -> None:
    conf = Confinement(pids=64, memory=1 << 30, cpus=1.5)
    res = bundle.oci_config("/r", ["sh"], env=[], confinement=conf)["linux"]["resources"]
    assert res["pids"] == {"limit": 64} and res["memory"] == {"limit": 1 << 30}
    assert res["cpu"] == {"quota": 150_000, "period": 100_000}
    relaxed = bundle.oci_config("/r", ["sh"], env=[], confinement=Confinement(
        seccomp=False, new_privileges=True, system_paths=True))
    assert "seccomp" not in relaxed["linux"] and relaxed["process"]["noNewPrivileges"] is False
    assert "maskedPaths" not in relaxed["linux"] and "readonlyPaths" not in relaxed["linux"]
    traced = bundle.oci_config("/r", ["sh"], env=[], confinement=Confinement(ptrace=True))["linux"]["seccomp"]
    assert not any("ptrace" in r["names"] for r in traced["syscalls"])


def test_oci_config_with_and_without_an_init() -> None:
    """An init (its host path): bound read-only at /dev/init after the /dev tmpfs, the workload its
    argv; none (`--no-init`): the workload's own args are PID 1's and nothing is bound in."""
    with_init = bundle.oci_config("/r", ["/sbin/my-init", "-v"], env=[], init="/usr/bin/tini-static")
    assert with_init["process"]["args"] == ["/dev/init", "--", "/sbin/my-init", "-v"]
    dests = [m["destination"] for m in with_init["mounts"]]
    assert dests.index("/dev") < dests.index("/dev/init")
    assert [m for m in with_init["mounts"] if m["type"] == "bind"] == [
        {"destination": "/dev/init", "type": "bind", "source": "/usr/bin/tini-static",
         "options": ["bind", "ro", "nosuid", "nodev"]}]
    without = bundle.oci_config("/r", ["/sbin/my-init", "-v"], env=[], init=None)
    assert without["process"]["args"] == ["/sbin/my-init", "-v"]
    assert "/dev/init" not in [m["destination"] for m in without["mounts"]]
    assert all(m["type"] != "bind" for m in without["mounts"])


def test_personality_rules_refuse_the_flags_but_not_the_query() -> None:
    from runtime_shim.backends.seccomp import default_profile

    rules = [r["args"][0] for r in default_profile()["syscalls"] if r["names"] == ["personality"]]

    def refused(value: int) -> bool:
        return any(value & a["value"] == a["valueTwo"] for a in rules)

    assert not any(refused(v) for v in (0, 8, 0x20000, 0x20008, 0xFFFFFFFF))
    assert all(refused(v) for v in (0x0040000, 0x0400000, 0x80040000, 0xFFFFFFFE, 0x1_0004_0000))


def test_process_args_and_env() -> None:
    conf = {"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo hi"], "env": ["A=1"]}
    assert bundle.process_args(conf, None) == ["/bin/sh", "-c", "echo hi"]
    assert bundle.process_args(conf, ["echo bye"]) == ["/bin/sh", "-c", "echo bye"]
    assert bundle.process_env(conf)[0].startswith("PATH=")
    assert bundle.process_env({"env": ["PATH=/x"]}, ["B=2"]) == ["PATH=/x", "B=2"]
    with pytest.raises(BadInput):
        bundle.process_args({"entrypoint": [], "cmd": []}, None)


def test_parse_user() -> None:
    passwd = "root:x:0:0::/:/bin/sh\napp:x:1000:1001::/:/bin/sh\n"
    group = "root:x:0:\nstaff:x:50:\n"
    assert bundle.parse_user("", passwd, group) == (0, 0)
    assert bundle.parse_user("app", passwd, group) == (1000, 1001)
    assert bundle.parse_user("1000", passwd, group) == (1000, 1001)
    assert bundle.parse_user("app:staff", passwd, group) == (1000, 50)
    assert bundle.parse_user("7:8", "", "") == (7, 8)
    with pytest.raises(BadInput):
        bundle.parse_user("ghost", passwd, group)


def test_mountinfo_parse() -> None:
    lines = [
        "30 1 0:25 / / rw - ext4 /dev/vda1 rw\n",
        "40 30 0:40 / /n/layers/ab rw,relatime - erofs /n/fuse/blobs/b3:ab ro\n",
        "41 30 0:41 / /n/with\\040space rw - overlay overlay rw,lowerdir=/a,upperdir=/u,workdir=/w\n",
    ]
    mounts = linux.parse_mountinfo(lines)
    assert mounts["/n/layers/ab"].fstype == "erofs"
    assert mounts["/n/with space"].options.endswith("workdir=/w")
    assert [m.mountpoint for m in linux.mounts_under(mounts, "/n")] == ["/n/layers/ab", "/n/with space"]


def test_committed_layers_stack_the_new_workspace_on_top() -> None:
    base, tk, ws = LayerSpec("b3:" + "1" * 64, 1, "base"), LayerSpec("b3:" + "2" * 64, 2, "toolkit"), \
        LayerSpec("b3:" + "3" * 64, 3, "workspace")
    out = committed_layers([base, tk, ws], "b3:" + "4" * 64, 4, LayerSpec)
    assert [(x.blob[3], x.role) for x in out] == [("1", "base"), ("2", "toolkit"), ("3", "toolkit"),
                                                   ("4", "workspace")]
    assert committed_layers([base, tk], tk.blob, 2, LayerSpec) == (base, tk)


def test_layer_entries_keep_only_opaque() -> None:
    class E:
        def __init__(self, xattrs: dict[bytes, bytes]) -> None:
            self.xattrs = xattrs

    entries = [(E({b"trusted.overlay.opaque": b"y", b"trusted.overlay.origin": b"\0", b"user.a": b"1"}), None),
               (E({b"trusted.overlay.impure": b"y"}), None)]
    out = [e.xattrs for e, _ in layer_entries(entries)]
    assert out == [{b"user.a": b"1", b"trusted.overlay.opaque": b"y"}, {}]


# -- node state, records, utab, resolution (no kernel) -------------------------------------------
def test_state_indexes_pending_and_boot(tmp_path: Path) -> None:
    from runtime_shim.nodestate.state import MOUNTED, NodeState, Sandbox, boot_id

    with NodeState(tmp_path / "state") as st:
        sb = Sandbox(id="s1", env="e:1", manifest="", layers=["b3:" + "1" * 64], config={}, target="/t/1",
                     upper="/u/1", work="/w/1", owned=True, status=MOUNTED)
        with st.write() as t:
            t.put_sandbox(sb)
            t.put_pending("s1", "mount")
            t.put_boot(boot_id())
        with st.read() as t:
            assert t.sandbox_at("/t/1") == sb and t.sandbox_with_upper("/u/1") == sb
            assert t.count("pending") == 1 and t.pending()["s1"]["op"] == "mount"
            assert t.boot() == boot_id() != ""
        moved = Sandbox(**{**sb.to_json(), "target": "/t/2", "upper": "/u/2"})
        with st.write() as t:
            t.put_sandbox(moved)
            t.clear_pending("s1")
        with st.read() as t:
            assert t.sandbox_at("/t/1") is None and t.sandbox_with_upper("/u/1") is None
            assert t.sandbox_with_upper("/u/2") == moved and t.count("pending") == 0
        with st.write() as t:
            t.delete_sandbox("s1")
        with st.read() as t:
            assert t.sandbox_at("/t/2") is None and t.sandbox_with_upper("/u/2") is None and t.sandboxes() == []
        with st.write() as t:
            t.put_sandbox(sb)
        st.reset()  # a reboot: forget everything
        with st.read() as t:
            assert t.sandboxes() == [] and t.boot() is None and t.count("targets") == 0


def test_state_is_opened_without_fsync_per_transaction(tmp_path: Path) -> None:
    # Durability comes from the boot id + records (docs/runtime-shim.md); a synced LMDB would cost
    # a flush per mount and per teardown again.
    from runtime_shim.nodestate.state import NodeState

    with NodeState(tmp_path / "state") as st:
        flags = st._env.flags()
        assert flags["sync"] is False and flags["metasync"] is False


def test_default_roots_and_shim_made_uppers_are_found_without_index_entries(tmp_path: Path) -> None:
    from runtime_shim.nodestate.state import MOUNTED, NodeState, Sandbox

    def sandbox(sid: str, target: str, upper: str) -> Sandbox:
        return Sandbox(id=sid, env="e:1", manifest="", layers=[], config={}, target=target, upper=upper,
                       work=upper + ".w", owned=True, status=MOUNTED)

    default = sandbox("a", "/n/roots/a", "/n/sandboxes/a/upper")  # both derivable: no entries
    named = sandbox("b", "/mnt/b", "/n/sandboxes/b/upper")  # a caller's target named like its id
    elsewhere = sandbox("c", "/mnt/a", "/data/a/upper")  # paths naming another sandbox: entries
    with NodeState(tmp_path / "state") as st:
        with st.write() as t:
            for sb in (default, named, elsewhere):
                t.put_sandbox(sb)
        with st.read() as t:
            assert t.count("targets") == 1 and t.count("uppers") == 1  # only c's
            assert t.sandbox_at("/n/roots/a") == default and t.sandbox_with_upper("/n/sandboxes/a/upper") == default
            assert t.sandbox_at("/mnt/b") == named and t.sandbox_with_upper("/n/sandboxes/b/upper") == named
            assert t.sandbox_at("/mnt/a") == elsewhere and t.sandbox_with_upper("/data/a/upper") == elsewhere
            # a path whose last component names a sandbox that is mounted elsewhere is nobody's
            assert t.sandbox_at("/other/a") is None and t.sandbox_at("/n/roots/b") is None
            assert t.sandbox_with_upper("/x/a/upper") is None and t.sandbox_with_upper("/n/sandboxes/a/work") is None
            # a new id the caller knows is absent skips the path's own lookup, never an index entry
            assert t.sandbox_at("/mnt/a", absent="a") == elsewhere and t.sandbox_at("/n/roots/x", absent="x") is None
            assert t.sandbox_with_upper("/data/a/upper", absent="a") == elsewhere
        with st.write() as t:
            t.put_sandbox(sandbox("a", "/mnt/elsewhere", "/n/sandboxes/a/upper"))  # moved: an entry now
            t.delete_sandbox("c")
        with st.read() as t:
            assert t.sandbox_at("/n/roots/a") is None and t.sandbox_at("/mnt/elsewhere").id == "a"  # type: ignore[union-attr]
            assert t.sandbox_at("/mnt/a") is None and t.count("uppers") == 0
        with st.write() as t:
            t.delete_sandbox("a")
            t.delete_sandbox("b")
        with st.read() as t:
            assert t.count("targets") == 0 and t.sandboxes() == []


@pytest.mark.root
def test_a_record_is_an_attribute_of_the_sandboxs_directory_and_a_file_where_that_is_refused(
        tmp_path: Path) -> None:
    import json
    import os

    from runtime_shim.nodestate import records
    from runtime_shim.nodestate.paths import NodePaths
    from runtime_shim.nodestate.state import Sandbox, encode

    paths = NodePaths(tmp_path / "node")
    paths.create()
    base = {"env": "", "manifest": "", "layers": ["b" * 64], "config": {}, "target": "/t", "upper": "/u",
            "work": "/w", "owned": True}
    small = Sandbox.from_json({**base, "id": "small"})
    large = Sandbox.from_json({**base, "id": "large", "config": {"env": ["X=" + "y" * 9000]}})  # > one ext4 block
    legacy = Sandbox.from_json({**base, "id": "legacy"})
    for sb in (small, large, legacy):
        paths.sandbox_dir(sb.id).mkdir()
    records.save(paths, small, fresh=True)
    records.save(paths, large, fresh=True)
    (paths.sandbox_dir("legacy") / records.RECORD).write_bytes(encode(legacy.to_json()))  # an earlier shim's
    assert os.getxattr(paths.sandbox_dir("small"), records.XATTR) == encode(small.to_json())
    assert not (paths.sandbox_dir("small") / records.RECORD).exists()  # no inode of its own
    assert (paths.sandbox_dir("large") / records.RECORD).read_bytes() == encode(large.to_json())
    assert [sb.id for sb in records.scan(paths)] == ["large", "legacy", "small"]
    with pytest.raises(FileExistsError):  # fresh: the directory holds no record yet, or something is wrong
        records.save(paths, small, fresh=True)
    small.upper = "/u2"
    records.save(paths, small)  # a caller's upper, recorded again: replaced whole
    assert json.loads(records.load(paths.sandbox_dir("small")) or b"")["upper"] == "/u2"
    records.save(paths, legacy)  # the attribute now, and the file it replaces is gone
    assert not (paths.sandbox_dir("legacy") / records.RECORD).exists()
    for sid in ("small", "large", "legacy"):
        records.remove(paths, sid)
        assert records.load(paths.sandbox_dir(sid)) is None and paths.sandbox_dir(sid).is_dir()
    assert list(records.scan(paths)) == [] and records.unrecorded(paths, set()) == ["large", "legacy", "small"]
    assert records.load(paths.sandbox_dir("gone")) is None


def test_records_ignore_unknown_fields_and_trash_names_its_owner(tmp_path: Path) -> None:
    import os

    from runtime_shim.nodestate import records
    from runtime_shim.nodestate.paths import NodePaths
    from runtime_shim.nodestate.state import Sandbox

    obj = {"id": "s1", "env": "", "manifest": "", "layers": [], "config": {}, "target": "/t", "upper": "/u",
           "work": "/w", "owned": True, "from_a_newer_shim": 1}
    assert Sandbox.from_json(obj).id == "s1"
    paths = NodePaths(tmp_path / "node")
    paths.create()
    for sid in ("a", "b", "c"):
        paths.sandbox_dir(sid).mkdir()
    records.save(paths, Sandbox.from_json({**obj, "id": "a"}))
    (paths.sandbox_dir("b") / records.RECORD).write_text("")  # a record a power loss emptied
    assert [sb.id for sb in records.scan(paths)] == ["a"]
    assert records.unrecorded(paths, {"a"}) == ["b", "c"]
    mine = records.trash(paths, "a")
    assert mine is not None and mine.name.startswith(f"a.{os.getpid()}-")
    (paths.sandboxes / records.TRASH / "x.1-dead").mkdir()  # pid 1 is alive: not ours to delete
    (paths.sandboxes / records.TRASH / "y.999999999-dead").mkdir()  # no such pid
    assert records.trashed_ids(paths) == {"a", "x", "y"}
    assert records.empty_trash(paths, only_dead=True) == 2
    assert os.listdir(paths.sandboxes / records.TRASH) == ["x.1-dead"]


def test_utab_entries(tmp_path: Path) -> None:
    from runtime_shim.nodestate import utab

    (tmp_path / "utab").write_text("ID=7 SRC=/dev/sdb1 TARGET=/media/usb ROOT=/ OPTS=uhelper=udisks2\n")
    utab.add(41, "/run/sbx/1/rootfs", directory=tmp_path)
    utab.add(42, "/run/sbx/with space", directory=tmp_path)
    lines = (tmp_path / "utab").read_text().splitlines()
    assert lines[1] == "ID=41 SRC=overlay TARGET=/run/sbx/1/rootfs ROOT=/ OPTS=helper=layerstore"
    assert "TARGET=/run/sbx/with\\040space " in lines[2]
    assert utab.targets(directory=tmp_path) == {"/run/sbx/1/rootfs", "/run/sbx/with space"}
    assert utab.remove("/run/sbx/with space", directory=tmp_path)
    assert not utab.remove("/media/usb", directory=tmp_path)  # not ours
    assert (tmp_path / "utab").read_text().splitlines() == lines[:2]
    assert not utab.remove("/nowhere", directory=tmp_path / "absent")


def test_mount_table_questions_about_one_path(tmp_path: Path) -> None:
    assert linux.is_mount("/proc") and linux.is_mount("/")
    assert not linux.is_mount(tmp_path) and not linux.is_mount(tmp_path / "absent")
    assert linux.fs_type("/proc") == 0x9FA0  # PROC_SUPER_MAGIC
    assert linux.fs_type(tmp_path / "absent") is None
    root = linux.find_mount("/proc")
    assert root is not None and root.fstype == "proc"
    assert linux.find_mount(str(tmp_path)) is None
    table = Path("/proc/self/mountinfo").read_text().splitlines()
    assert linux.mount_id("/proc") == int(next(ln.split()[0] for ln in table if ln.split()[4] == "/proc"))


def test_environments_are_cached_by_manifest_digest(tmp_path: Path) -> None:
    from testkit.cli_helpers import layerctl

    from layerstore.store import Store
    from runtime_shim.resolve.environment import CachingResolver

    url = str(tmp_path / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    blobs = []
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(name.encode() * 5000)
        blobs.append(layerctl("store", "put-blob", "--store", url, "--json", str(tmp_path / name)).json()["blob"])
    one = layerctl("env", "create", "--store", url, "--base", blobs[0], "-t", "e:1", "--json").json()["manifest"]
    with Store.open(url) as store:
        reads: list[str] = []
        get = store.get_manifest

        def counting(digest: str) -> bytes:
            reads.append(digest)
            return get(digest)

        store.get_manifest = counting  # type: ignore[method-assign]
        res = CachingResolver(store)
        first = res("e:1")
        assert first.manifest == one and first.blobs == [blobs[0]] and first.ref == "e:1"
        n = len(reads)
        again, by_digest = res("e:1"), res(one)
        assert len(reads) == n  # the manifest is not read again
        assert again == first and by_digest.manifest == one and by_digest.ref == one
        # the tag moves: the next resolution follows it
        two = layerctl("env", "create", "--store", url, "--base", blobs[1], "-t", "e:1", "--json").json()["manifest"]
        moved = res("e:1")
        assert moved.manifest == two != one and moved.blobs == [blobs[1]]
        assert (res.hits, res.misses) == (2, 2)


def test_a_node_directory_too_long_for_the_daemons_socket_is_refused_up_front(tmp_path: Path) -> None:
    from testkit.cli_helpers import layerctl

    from runtime_shim.errors import DaemonError
    from runtime_shim.node.shim import Shim

    store = str(tmp_path / "store")
    assert layerctl("store", "init", "--store", store).code == 0
    with Shim.for_node(tmp_path / ("n" * 100), store) as shim, shim.lock, \
            pytest.raises(DaemonError, match="too long"):
        shim.blobs.ensure()
    assert not (tmp_path / ("n" * 100) / "daemon.log").exists()  # nothing was started


def test_for_node_resolves_every_environment_through_one_store_client(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from testkit.cli_helpers import layerctl

    from layerstore.store import Store
    from runtime_shim.node.shim import Shim

    url = str(tmp_path / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    (tmp_path / "a").write_bytes(b"a" * 5000)
    blob = layerctl("store", "put-blob", "--store", url, "--json", str(tmp_path / "a")).json()["blob"]
    assert layerctl("env", "create", "--store", url, "--base", blob, "-t", "e:1", "--json").code == 0
    opened: list[str | None] = []
    real = Store.open.__func__  # type: ignore[attr-defined]

    def counting(cls: type[Store], u: str | None = None, **kw: object) -> Store:
        opened.append(u)
        return real(cls, u, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(Store, "open", classmethod(counting))
    with Shim.for_node(tmp_path / "node", url, auto_recover=False) as shim:
        got: list[list[str]] = []
        threads = [threading.Thread(target=lambda: got.append(shim.resolve("e:1").blobs)) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert got == [[blob]] * 8
    assert len(opened) == 1  # one client for the shim's lifetime, shared by every thread


def test_eager_fetches_a_blob_once_for_every_concurrent_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import fuse_client.control as control
    from runtime_shim.errors import DaemonError
    from runtime_shim.node.blobs import DaemonBlobs
    from runtime_shim.nodestate.paths import NodePaths
    from runtime_shim.nodestate.state import NodeState

    paths = NodePaths(tmp_path / "node")
    paths.create()
    blob, bad = "b3:" + "a" * 64, "b3:" + "b" * 64
    calls: list[tuple[str, dict[str, Any]]] = []
    entered, go = threading.Event(), threading.Event()

    def fake(cache_dir: Path, method: str, path: str, body: dict[str, Any], timeout: float | None = 60.0) -> Any:
        calls.append((path, body))
        entered.set()
        assert go.wait(30)
        assert timeout is None and method == "POST" and path == "/prefetch" and body["all"] and body["wait"]
        return {"blob": body["blob"], "queued": 3, "done": 3 if body["blob"] == blob else 1,
                "failed": 0 if body["blob"] == blob else 2}

    monkeypatch.setattr(control, "request_json", fake)
    with NodeState(paths.state) as state:
        blobs = DaemonBlobs(paths, state, "unused")
        errors: list[BaseException] = []

        def fetch(b: str) -> None:
            try:
                blobs.fetch_all(b)
            except BaseException as e:  # noqa: BLE001 - collected for the test
                errors.append(e)

        threads = [threading.Thread(target=fetch, args=(blob,)) for _ in range(6)]
        for th in threads:
            th.start()
        try:
            assert entered.wait(30)
        finally:
            go.set()
            for th in threads:
                th.join(30)
        assert errors == [] and len(calls) == 1  # six callers, one fetch
        blobs.fetch_all(blob)
        assert len(calls) == 2  # asked again: the daemon may have evicted chunks since
        with pytest.raises(DaemonError, match="2 chunk"):
            blobs.fetch_all(bad)
        with pytest.raises(DaemonError):
            blobs.fetch_all(bad)  # a failure is not remembered either
        assert len(calls) == 4


def test_a_layer_mount_follows_the_group_or_the_daemon_it_was_made_on() -> None:
    """On the fanotify data path the blob source's generation names the group and the daemon: a
    layer attached to the group stays current across daemon restarts, a layer whose attach failed
    (mounted on the daemon's FUSE file) goes stale with its daemon; off that path, the daemon's."""
    from runtime_shim.nodestate.state import LayerMount, fuse_generation, group_generation

    gen = group_generation("fanotify:g1", "daemon:10:1")
    attached = LayerMount("b", "/m", "/c", 0, "fanotify:g1")
    on_fuse = LayerMount("b", "/m", "/f", 0, fuse_generation(gen))
    assert on_fuse.generation == "daemon:10:1"
    assert attached.current(gen) and on_fuse.current(gen)
    restarted = group_generation("fanotify:g1", "daemon:11:2")
    assert attached.current(restarted) and not on_fuse.current(restarted)
    regrouped = group_generation("fanotify:g2", "daemon:11:2")
    assert not attached.current(regrouped)
    plain = LayerMount("b", "/m", "/f", 0, fuse_generation("daemon:10:1"))
    assert plain.current("daemon:10:1") and not plain.current("daemon:11:2") and not plain.current(None)
    assert LayerMount("b", "/m", "/c", 0, "direct", pin="shim:x").current(None)
