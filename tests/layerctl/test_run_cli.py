"""End to end through the CLI with the real node daemon and a local store: run, the mount(8)
helpers, sandbox ls/rm, commit onto a fresh node, eager mode, and recovery after kill -9 of the
daemon."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.cli_helpers import layerctl
from testkit.fanotify_helpers import needs_fanotify, stop_holder
from testkit.shim_support import busybox_rootfs, cleanup_node, needs_busybox, needs_root, needs_runc, snapshot

from layerstore import linux
from runtime_shim.nodestate.state import NodeState
from runtime_shim.supervise.daemon import is_alive

pytestmark = [needs_root, needs_busybox, needs_runc]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A store with bb:1 (busybox base) and big:1 (base + a toolkit holding 6 MiB nobody reads)."""
    root = tmp_path_factory.mktemp("cli")
    url = str(root / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    base = busybox_rootfs(root / "base")
    (base / "data").mkdir()
    (base / "data" / "keep").write_text("keep\n")
    (base / "data" / "drop").write_text("drop\n")
    (base / "olddir").mkdir()
    (base / "olddir" / "x").write_text("x\n")
    tk = root / "tk"
    (tk / "opt").mkdir(parents=True)
    (tk / "opt" / "big").write_bytes(os.urandom(6 << 20))

    def build(src: Path) -> str:
        r = layerctl("build", str(src), "--push", "--store", url, "--all-root", "--json")
        assert r.code == 0, r.err
        return str(r.json()["blob"])

    b, t = build(base), build(tk)
    assert layerctl("env", "create", "--store", url, "--base", b, "-t", "bb:1").code == 0
    assert layerctl("env", "create", "--store", url, "--base", b, "--toolkit", t, "-t", "big:1").code == 0
    return {"url": url, "base": b, "toolkit": t}


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Path]]:
    made = [tmp_path / "node-a", tmp_path / "node-b"]
    try:
        yield made
    finally:
        for n in made:
            cleanup_node(n, tmp_path)


def daemon_pid(node: Path) -> int:
    with NodeState(node / "state") as st, st.read() as t:
        rec = t.daemon()
    assert rec is not None and is_alive(rec)
    return rec.pid


def test_run_streams_output_and_exits_with_the_commands_code(store: dict[str, str], nodes: list[Path]) -> None:
    args = ("run", "--store", store["url"], "--node-dir", str(nodes[0]), "bb:1", "--")
    r = layerctl(*args, "sh", "-c", "echo to-out; echo to-err >&2; exit 3")
    assert (r.code, r.out, r.err) == (3, "to-out\n", "to-err\n")
    r = layerctl(*args, "cat", input=b"piped stdin\n")
    assert (r.code, r.out) == (0, "piped stdin\n")
    first = daemon_pid(nodes[0])
    assert layerctl(*args, "true").code == 0
    assert daemon_pid(nodes[0]) == first  # the running daemon is reused
    r = layerctl("sandbox", "ls", "--node-dir", str(nodes[0]), "--json")
    assert r.json() == {"sandboxes": [], "layers": {}}
    r = layerctl("run", "--store", store["url"], "--node-dir", str(nodes[0]), "nope:1", "--", "true")
    assert r.code == 3 and "Traceback" not in r.err and "nope:1" in r.err


def test_mount_helper_as_mount8_calls_it(store: dict[str, str], nodes: list[Path], tmp_path: Path) -> None:
    target = tmp_path / "root"
    target.mkdir()
    opts = f"sandbox=h1,node_dir={nodes[0]},store={store['url']}"
    p = subprocess.run([str(BIN / "mount.layerstore"), "bb:1", str(target), "-n", "-o", opts], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    assert (target / "data" / "keep").read_text() == "keep\n"
    r = layerctl("sandbox", "ls", "--node-dir", str(nodes[0]), "--json")
    assert [s["sandbox"] for s in r.json()["sandboxes"]] == ["h1"]
    p = subprocess.run([str(BIN / "mount.layerstore"), "bb:1", str(tmp_path / "r2"), "-o", opts], capture_output=True,
                       text=True)
    assert p.returncode == 32 and "h1" in p.stderr  # the id is taken
    env = {k: v for k, v in os.environ.items() if k != "LAYERSTORE_NODE_DIR"}
    p = subprocess.run([str(BIN / "umount.layerstore"), str(target)], capture_output=True, text=True,
                       env=env)  # the node directory is found from the mount itself
    assert p.returncode == 0, p.stderr
    assert not os.path.ismount(target)
    # through mount(8) itself, with the helper installed where it looks for it
    helper = Path("/sbin/mount.layerstore")
    if helper.exists() or helper.is_symlink():
        pytest.skip("a mount.layerstore is installed on this machine already")
    helper.symlink_to(BIN / "mount.layerstore")
    try:
        p = subprocess.run(["mount", "-t", "layerstore", "bb:1", str(target), "-o", opts.replace("h1", "h2")],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        assert (target / "data" / "keep").exists()
    finally:
        helper.unlink()
    r = layerctl("umount", "--node-dir", str(nodes[0]), str(target))
    assert r.code == 0, r.err
    assert not os.path.ismount(target)


def test_commit_then_resume_on_another_node(store: dict[str, str], nodes: list[Path], tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    r = layerctl("mount", "--store", store["url"], "--node-dir", str(nodes[0]), "bb:1", str(a), "--sandbox", "c1")
    assert r.code == 0, r.err
    (a / "data" / "new").write_text("new file\n")
    (a / "etc" / "motd").write_text("changed\n")
    (a / "data" / "drop").unlink()  # a whiteout
    shutil.rmtree(a / "olddir")
    (a / "olddir").mkdir()  # an opaque directory
    (a / "olddir" / "y").write_text("y\n")
    os.symlink("/data/new", a / "link")
    seen = snapshot(a)
    r = layerctl("commit", "--store", store["url"], "--node-dir", str(nodes[0]), "c1", "-t", "bb:c1", "--json")
    assert r.code == 0, r.err
    res = r.json()
    assert set(res) >= {"manifest", "layer"} and res["manifest"].startswith("b3:")
    r = layerctl("env", "show", "--store", store["url"], "bb:c1", "--json")
    layers = r.json()["environment"]["layers"]
    assert [x["blob"] for x in layers] == [store["base"], res["layer"]]
    r = layerctl("mount", "--store", store["url"], "--node-dir", str(nodes[1]), "bb:c1", str(b))
    assert r.code == 0, r.err
    assert snapshot(b) == seen
    assert not (b / "data" / "drop").exists() and os.listdir(b / "olddir") == ["y"]
    r = layerctl("run", "--store", store["url"], "--node-dir", str(nodes[1]), "bb:c1", "--", "cat", "/data/new")
    assert (r.code, r.out) == (0, "new file\n")
    for node, tgt in ((nodes[0], a), (nodes[1], b)):
        assert layerctl("umount", "--node-dir", str(node), str(tgt)).code == 0


def test_recover_after_kill9_of_the_daemon(store: dict[str, str], nodes: list[Path], tmp_path: Path) -> None:
    node = nodes[0]
    targets = [tmp_path / "k1", tmp_path / "k2"]
    for i, t in enumerate(targets):
        r = layerctl("mount", "--store", store["url"], "--node-dir", str(node), "big:1", str(t), "--sandbox", f"k{i}")
        assert r.code == 0, r.err
    (targets[0] / "mine").write_text("upper data\n")
    old = daemon_pid(node)
    os.kill(old, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(old, os.WNOHANG)
    with pytest.raises(OSError):
        (targets[1] / "opt" / "big").read_bytes()  # never read before: the dead daemon cannot serve it
    r = layerctl("recover", "--node-dir", str(node), "--json")
    assert r.code == 0, r.err
    rep = r.json()
    assert sorted(rep["remounted_sandboxes"]) == ["k0", "k1"] and rep["broken"] == {}
    assert daemon_pid(node) != old
    assert len((targets[1] / "opt" / "big").read_bytes()) == 6 << 20
    assert (targets[0] / "mine").read_text() == "upper data\n"
    assert (targets[0] / "data" / "keep").read_text() == "keep\n"
    r = layerctl("sandbox", "ls", "--node-dir", str(node), "--json")
    assert {s["status"] for s in r.json()["sandboxes"]} == {"mounted"}
    for i in range(2):
        assert layerctl("sandbox", "rm", "--node-dir", str(node), f"k{i}").code == 0


def test_eager_fetches_every_chunk_before_mounting(store: dict[str, str], nodes: list[Path], tmp_path: Path) -> None:
    def cached(node: Path) -> dict[str, tuple[int, int]]:
        r = layerctl("cache", "ls", "--cache", str(node / "cache"), "--json")
        assert r.code == 0, r.err
        return {b["blob"]: (b["cached_chunks"], b["chunks"]) for b in r.json()["blobs"]}

    lazy, eager = tmp_path / "lazy", tmp_path / "eager"
    assert layerctl("mount", "--store", store["url"], "--node-dir", str(nodes[0]), "big:1", str(lazy)).code == 0
    got, total = cached(nodes[0]).get(store["toolkit"], (0, 1))
    assert got < total  # lazy: the big file was never read
    r = layerctl("mount", "--store", store["url"], "--node-dir", str(nodes[1]), "--eager", "big:1", str(eager))
    assert r.code == 0, r.err
    for blob in (store["base"], store["toolkit"]):
        got, total = cached(nodes[1])[blob]
        assert got == total
    for node, t in ((nodes[0], lazy), (nodes[1], eager)):
        assert layerctl("umount", "--node-dir", str(node), str(t)).code == 0


def test_complete_layers_are_mounted_directly_and_survive_the_daemon(store: dict[str, str], nodes: list[Path],
                                                                     tmp_path: Path) -> None:
    from layerstore import linux

    node, target = nodes[0], tmp_path / "direct"
    r = layerctl("mount", "--store", store["url"], "--node-dir", str(node), "--eager", "--sandbox", "d1", "big:1",
                 str(target))
    assert r.code == 0, r.err
    with NodeState(node / "state") as st, st.read() as t:
        layers = {lm.blob: lm for lm in t.layers()}
    assert set(layers) == {store["base"], store["toolkit"]}
    for lm in layers.values():  # on the cache's data file, not the daemon's FUSE file
        assert lm.pin and lm.generation == "direct" and lm.source.startswith(str(node / "cache"))
        m = linux.read_mounts()[lm.mountpoint]
        assert m.fstype == "erofs" and "directio" not in m.options
    pins = layerctl("cache", "ls", "--cache", str(node / "cache"), "--json").json()["pins"]
    assert sorted(p["holder"] for p in pins) == sorted(lm.pin for lm in layers.values())
    old = daemon_pid(node)
    os.kill(old, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(old, os.WNOHANG)
    assert len((target / "opt" / "big").read_bytes()) == 6 << 20  # no daemon needed
    rep = layerctl("recover", "--node-dir", str(node), "--json").json()
    assert rep["remounted_layers"] == [] and rep["remounted_sandboxes"] == [] and rep["broken"] == {}
    assert (target / "data" / "keep").read_text() == "keep\n"
    assert layerctl("umount", "--node-dir", str(node), str(target)).code == 0
    assert layerctl("cache", "ls", "--cache", str(node / "cache"), "--json").json()["pins"] == []  # unpinned


def test_a_manifests_prefetch_hints_are_fetched_when_the_environment_is_first_used(
        store: dict[str, str], nodes: list[Path], tmp_path: Path) -> None:
    from layerstore.store import Store

    with Store.open(store["url"]) as s:
        n = len(s.get_chunk_map(store["toolkit"]).chunks)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"version": 1, "blobs": {store["toolkit"]: list(range(n))}}))
    assert layerctl("env", "create", "--store", store["url"], "--base", store["base"], "--toolkit", store["toolkit"],
                    "--prefetch-trace", str(trace), "-t", "hinted:1").code == 0
    target = tmp_path / "hinted"
    r = layerctl("mount", "--store", store["url"], "--node-dir", str(nodes[0]), "hinted:1", str(target))
    assert r.code == 0, r.err
    cached = (0, 1)
    for _ in range(3000):  # the hints are fetched in the background (a guard against a hang, not a timing)
        r = layerctl("cache", "ls", "--cache", str(nodes[0] / "cache"), "--json")
        cached = next((b["cached_chunks"], b["chunks"]) for b in r.json()["blobs"] if b["blob"] == store["toolkit"])
        if cached[0] == cached[1]:
            break
        time.sleep(0.02)
    assert cached == (n, n)  # nobody read the big file: the hints brought it
    with NodeState(nodes[0] / "state") as st, st.read() as t:
        assert t.hinted(store["toolkit"]) == set(range(n))
    assert layerctl("umount", "--node-dir", str(nodes[0]), str(target)).code == 0


def test_usage_errors_are_one_line(store: dict[str, str], nodes: list[Path]) -> None:
    r = layerctl("umount", "--node-dir", str(nodes[0]), "/no/such/target")
    assert r.code == 3 and "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    r = layerctl("mount", "--node-dir", str(nodes[0]) + ",x", "bb:1", "/tmp/x")
    assert r.code == 2 and "Traceback" not in r.err
    assert json.loads(layerctl("recover", "--node-dir", str(nodes[0]), "--json").out)["broken"] == {}


def test_concurrent_invocations_on_one_node(store: dict[str, str], nodes: list[Path], tmp_path: Path) -> None:
    env = {**os.environ, "LAYERSTORE_NODE_DIR": str(nodes[0]), "LAYERSTORE_STORE": store["url"]}
    targets = [tmp_path / f"c{i}" for i in range(6)]
    procs = [subprocess.Popen([str(BIN / "mount.layerstore"), "big:1", str(t), "-o", f"sandbox=c{i}"], env=env,
                              stderr=subprocess.PIPE) for i, t in enumerate(targets)]
    errs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, errs
    r = layerctl("sandbox", "ls", "--node-dir", str(nodes[0]), "--json")
    assert sorted(s["sandbox"] for s in r.json()["sandboxes"]) == [f"c{i}" for i in range(6)]
    assert r.json()["layers"] == {store["base"]: 6, store["toolkit"]: 6}
    procs = [subprocess.Popen([str(BIN / "umount.layerstore"), str(t)], env=env, stderr=subprocess.PIPE)
             for t in targets]
    errs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, errs
    r = layerctl("sandbox", "ls", "--node-dir", str(nodes[0]), "--json")
    assert r.json() == {"sandboxes": [], "layers": {}}


def test_unsigned_environment_refused_before_anything_is_mounted(store: dict[str, str], nodes: list[Path],
                                                                  tmp_path: Path) -> None:
    r = layerctl("env", "keygen", "--out", str(tmp_path / "key.pem"), "--json")
    assert r.code == 0, r.err
    key = r.json()["public_key"] if "public_key" in r.json() else next(iter(r.json().values()))
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"require_signature": True, "trusted_keys": [key]}))
    r = layerctl("mount", "--store", store["url"], "--node-dir", str(nodes[0]), "--policy", str(policy), "bb:1",
                 str(tmp_path / "t"))
    assert r.code == 6 and "Traceback" not in r.err, r
    assert not (tmp_path / "t").exists()
    assert layerctl("sandbox", "ls", "--node-dir", str(nodes[0]), "--json").json() == {"sandboxes": [], "layers": {}}
    assert not os.path.exists(nodes[0] / "fuse" / "blobs")  # not even the daemon was started
    # the same policy accepts the environment once it is signed with the trusted key (the refusal
    # above is about the signature, not a policy that refuses everything)
    r = layerctl("env", "sign", "--store", store["url"], "--key", str(tmp_path / "key.pem"), "bb:1")
    assert r.code == 0, r.err
    r = layerctl("mount", "--store", store["url"], "--node-dir", str(nodes[0]), "--policy", str(policy), "bb:1",
                 str(tmp_path / "t"))
    assert r.code == 0, r.err
    assert (tmp_path / "t" / "data" / "keep").read_text() == "keep\n"
    assert layerctl("umount", "--node-dir", str(nodes[0]), str(tmp_path / "t")).code == 0


def test_the_sandbox_cannot_reach_the_daemon_or_the_node(store: dict[str, str], nodes: list[Path]) -> None:
    """With the real node daemon running: its control socket, FUSE mount and cache exist on the host
    and none of them is reachable from inside a sandbox."""
    node = nodes[0]
    args = ("run", "--store", store["url"], "--node-dir", str(node), "bb:1", "--")
    assert layerctl(*args, "true").code == 0  # starts the daemon
    sock = node / "cache" / "control.sock"
    assert sock.exists() and os.path.ismount(node / "fuse")
    script = (f"test -e {node} && echo REACHABLE node; test -e {sock} && echo REACHABLE socket; "
              "find / -xdev -type s 2>/dev/null | sed 's/^/SOCKET /'; "
              "grep -E ' - (fuse|erofs) ' /proc/self/mountinfo | sed 's/^/MOUNT /'; "
              "ls /proc/1/root/ >/dev/null && echo probed")
    r = layerctl(*args, "sh", "-c", script)
    assert r.code == 0, r.err
    assert "probed" in r.out
    assert "REACHABLE" not in r.out and "SOCKET" not in r.out and "MOUNT" not in r.out, r.out


def test_a_thousand_sandboxes_through_the_daemon_then_nothing_left(store: dict[str, str], nodes: list[Path]) -> None:
    from layerstore import linux
    from runtime_shim.node.request import MountRequest
    from runtime_shim.node.shim import Shim

    node = nodes[0]
    with Shim.for_node(node, store["url"]) as shim:
        sbs = [shim.mount(MountRequest("big:1")) for _ in range(1000)]
        assert shim.layer_refs() == {store["base"]: 1000, store["toolkit"]: 1000}
        assert (Path(sbs[-1].target) / "data" / "keep").read_text() == "keep\n"
        assert len((Path(sbs[0].target) / "opt" / "big").read_bytes()) == 6 << 20  # through the daemon
        assert sum(1 for m in linux.read_mounts().values() if m.fstype == "overlay"
                   and m.mountpoint.startswith(str(node) + "/")) == 1000
        with shim.state.read() as t:
            rec = t.daemon()
        assert rec is not None and is_alive(rec)
        for sb in sbs:
            shim.unmount(sb.id)
        assert shim.sandboxes() == [] and shim.layer_refs() == {}
        assert shim.stop_daemon()
    assert not is_alive(rec)
    assert linux.mounts_under(linux.read_mounts(), str(node)) == []
    loops = Path("/sys/block")
    assert not any(str(node) in (d / "loop" / "backing_file").read_text()
                   for d in loops.iterdir() if (d / "loop" / "backing_file").exists())
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if str(node).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                holders.append(pid)
    assert holders == []
    assert [d for d in os.listdir(node / "sandboxes") if d != ".trash"] == []
    assert os.listdir(node / "layers") == []


UMOUNT8 = r"""
set -eu
sbin=$(readlink -f /sbin)
mkdir -p "$W/sbin-up" "$W/sbin-work"
ln -s "$BIN/mount.layerstore" "$W/sbin-up/mount.layerstore"
ln -s "$BIN/umount.layerstore" "$W/sbin-up/umount.layerstore"
# This namespace only: the helpers appear in /sbin and utab is private, the machine's are untouched.
mount -t overlay overlay -o "lowerdir=$sbin,upperdir=$W/sbin-up,workdir=$W/sbin-work" "$sbin"
mount -t tmpfs tmpfs /run/mount
mkdir -p "$T"
mount -t layerstore bb:1 "$T" -o "sandbox=u1,node_dir=$NODE,store=$STORE"
echo "read: $(cat "$T/data/keep")"
echo "utab: $(grep -c 'helper=layerstore' /run/mount/utab)"
echo "listed: $("$BIN/layerctl" sandbox ls --node-dir "$NODE")"
umount "$T"
echo "after: $("$BIN/layerctl" sandbox ls --node-dir "$NODE" --json)"
echo "utab after: $(grep -c 'helper=layerstore' /run/mount/utab || true)"
mountpoint -q "$T" && echo "still mounted"
"$BIN/layerctl" node stop --node-dir "$NODE"
"""


def test_plain_umount_tears_the_sandbox_down(store: dict[str, str], nodes: list[Path], tmp_path: Path) -> None:
    """`mount -t layerstore` records the root in utab with helper=layerstore, so util-linux's plain
    `umount TARGET` calls umount.layerstore: the sandbox is torn down, its layer references released."""
    env = {**os.environ, "W": str(tmp_path), "BIN": str(BIN), "NODE": str(nodes[0]), "STORE": store["url"],
           "T": str(tmp_path / "root")}
    env.pop("LAYERSTORE_NODE_DIR", None)
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", UMOUNT8], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "read: keep\n" in p.stdout and "utab: 1\n" in p.stdout and "u1" in p.stdout
    after = next(ln for ln in p.stdout.splitlines() if ln.startswith("after: "))
    assert json.loads(after[len("after: "):]) == {"sandboxes": [], "layers": {}}, p.stdout
    assert "utab after: 0" in p.stdout and "still mounted" not in p.stdout


def _command_lines_holding(needle: bytes) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(pid)
    return found


def test_a_secret_passed_with_e_key_stays_off_command_lines_and_out_of_errors(store: dict[str, str],
                                                                               nodes: list[Path]) -> None:
    secret = "s3cr3t-" + os.urandom(8).hex()
    env = {k: v for k, v in os.environ.items() if k != "LAYERSTORE_STORE"} | {"AGENT_TOKEN": secret}
    argv = [str(BIN / "layerctl"), "run", "--store", store["url"], "--node-dir", str(nodes[0]), "-e", "AGENT_TOKEN",
            "-e", "UNSET_HERE", "bb:1", "--", "sh", "-c", 'echo "got=$AGENT_TOKEN unset=${UNSET_HERE-none}"; read x']
    env.pop("UNSET_HERE", None)
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as p:
        try:
            assert p.stdout is not None and p.stdin is not None and p.stderr is not None
            line = p.stdout.readline()  # (EOF at once if the run failed: no hang)
            assert line == f"got={secret} unset=none\n".encode(), (line, p.poll())
            # the container runs: no process on the machine has the value on its command line
            assert _command_lines_holding(secret.encode()) == []
            # runc got it through config.json: 0600 in a 0700 bundle directory
            bundles = list((nodes[0] / "sandboxes").glob("*/bundle"))
            assert len(bundles) == 1
            assert stat.S_IMODE(bundles[0].stat().st_mode) == 0o700
            assert stat.S_IMODE((bundles[0] / "config.json").stat().st_mode) == 0o600
            assert stat.S_IMODE((nodes[0] / "oci" / "runc").stat().st_mode) == 0o700  # runc's state holds it too
            p.stdin.write(b"\n")
            p.stdin.close()
            assert p.wait(timeout=120) == 0
            assert secret.encode() not in p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()
    assert secret not in (nodes[0] / "daemon.log").read_text(errors="replace")
    for bad in (f"={secret}", f"A B={secret}"):  # refused, and the refusal does not show the value
        r = layerctl("run", "--store", store["url"], "--node-dir", str(nodes[0]), "-e", bad, "bb:1", "--", "true")
        assert r.code != 0 and "--env" in r.err and secret not in r.err + r.out, r


@needs_fanotify
def test_the_opt_in_fanotify_data_path_end_to_end(store: dict[str, str], nodes: list[Path], tmp_path: Path) -> None:
    """LAYERSTORE_DATA_PATH=fanotify: the shim mounts the layers on the node cache's own data files
    (not the daemon's FUSE files), a sandbox reads right bytes, and a kill -9 of the daemon in the
    middle does not break the mount (the holder keeps the group; the next daemon serves it)."""
    node, env = nodes[0], {"LAYERSTORE_DATA_PATH": "fanotify"}
    target = tmp_path / "root"
    try:
        r = layerctl("mount", "--store", store["url"], "--node-dir", str(node), "big:1", str(target),
                     "--sandbox", "f1", env=env)
        assert r.code == 0, r.err
        st = layerctl("stats", "--cache", str(node / "cache"), "--json")
        assert st.code == 0 and st.json()["data_path"] == "fanotify", st.out + st.err
        sources = {m.source for m in linux.read_mounts().values() if m.fstype == "erofs"
                   and m.mountpoint.startswith(str(node))}
        # Every layer attached: one whose attach failed is mounted on the FUSE file instead, which the
        # kill -9 below leaves dead (its reads fail with EIO). Concurrent attaches once raced on the
        # persisted list (ENOENT; docs/fanotify.md, "Marks and eviction"): seen in 4 of 9 runs under load.
        assert sources and all(s.startswith(str(node / "cache" / "data")) for s in sources), \
            (sources, st.json().get("fanotify", {}).get("attach_failed"), (node / "daemon.log").read_text()[-3000:])
        assert (target / "data" / "keep").read_text() == "keep\n"
        old = daemon_pid(node)
        os.kill(old, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(old, os.WNOHANG)
        # The next layerctl call starts a daemon that takes the group over; the read never failed.
        r = layerctl("sandbox", "ls", "--node-dir", str(node), "--json", env=env)
        assert r.code == 0, r.err
        big = layerctl("run", "--store", store["url"], "--node-dir", str(node), "big:1", "--", "wc", "-c",
                       "/opt/big", env=env)
        assert big.code == 0, big.err
        assert big.out.split()[0] == str(6 << 20)
        assert len((target / "opt" / "big").read_bytes()) == 6 << 20
        assert layerctl("sandbox", "rm", "--node-dir", str(node), "f1").code == 0
    finally:
        cleanup_node(node, tmp_path)
        stop_holder(node / "cache")
