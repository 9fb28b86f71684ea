"""Sandboxes in user namespaces (`runtime_shim.nodestate.idmap`), with real runc on a real node: root in a
sandbox is an unprivileged uid on the host, the layers show their recorded owners through
idmapped clones, what the sandbox writes is owned by its range on the host, two sandboxes get
disjoint ranges, and a commit gives the layer the same tree gives without a user namespace."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.fuse_helpers import wait_until
from testkit.shim_support import (
    busybox_rootfs,
    needs_busybox,
    needs_root,
    needs_runc,
    store_shim,
    store_with_env,
)

from layerstore.errors import BadInput
from layerstore.store import Store
from runtime_shim.backends.bundle import oci_config
from runtime_shim.node.request import MountRequest
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate import idmap
from runtime_shim.nodestate.state import Sandbox
from runtime_shim.sandbox import runner
from runtime_shim.sandbox.commit import commit

pytestmark = [needs_root, needs_busybox, needs_runc]


def test_ranges_and_id_mapping_are_pure() -> None:
    assert idmap.base_of(0) == idmap.FIRST_BASE and idmap.slot_of(idmap.base_of(7)) == 7
    base = idmap.base_of(3)
    assert idmap.to_layer_ids(base, base, base + 1000) == (0, 1000)
    for uid, gid in ((base - 1, base), (base, base + idmap.RANGE_SIZE), (0, 0)):
        with pytest.raises(BadInput, match="outside the sandbox's id range"):
            idmap.to_layer_ids(base, uid, gid, b"etc/x")
    conf = oci_config("/r", ["true"], env=[], userns=base)["linux"]
    assert {"type": "user"} in conf["namespaces"]
    assert conf["uidMappings"] == conf["gidMappings"] == [{"containerID": 0, "hostID": base, "size": 65536}]
    assert "uidMappings" not in oci_config("/r", ["true"], env=[])["linux"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store with bb:1: a busybox base whose home/u is owned by 1000:1000 (owners recorded)."""
    root = tmp_path_factory.mktemp("userns")
    base = busybox_rootfs(root / "base")
    for applet in ("chown", "id", "stat", "touch"):
        if not (base / "bin" / applet).exists():
            os.symlink("busybox", base / "bin" / applet)
    (base / "home" / "u").mkdir(parents=True)
    (base / "home" / "u" / "f").write_text("owned by u\n")
    for p in (base / "home" / "u", base / "home" / "u" / "f"):
        os.chown(p, 1000, 1000)
    return store_with_env(root, base)


@pytest.fixture
def shim(tmp_path: Path, store: str) -> Iterator[Shim]:
    with store_shim(tmp_path, store) as s:
        if not idmap.supported(s.paths.root, s.paths.layers):
            pytest.skip("this kernel cannot idmap the layers")
        yield s


def status_ids(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])


def test_root_in_the_sandbox_is_its_range_on_the_host(shim: Shim) -> None:
    sb = shim.mount(MountRequest("bb:1", userns=True))
    backend = shim.backend("runc")
    script = ("id -u > /tmp/id; stat -c '%u:%g' /home/u/f /bin/busybox > /tmp/owners; touch /made; "
              "mv /tmp/id /tmp/owners /; exec sleep 600")
    upper = Path(sb.upper)
    try:
        backend.prepare(sb, ["/bin/sh", "-c", script])
        ex = backend.start(sb.id, stdin=subprocess.DEVNULL)
        try:
            wait_until(lambda: (upper / "owners").exists(), 30, "the sandbox's report")
            assert (upper / "id").read_text() == "0\n"  # root inside
            assert (upper / "owners").read_text() == "1000:1000\n0:0\n"  # the layer's recorded owners
            state = subprocess.run(["runc", "--root", str(shim.paths.root / "oci" / "runc"), "state", sb.id],
                                   capture_output=True, check=True, text=True)
            import json

            pid = json.loads(state.stdout)["pid"]
            assert status_ids(pid) == (sb.userns, sb.userns)  # an unprivileged uid on the host
            st = os.stat(upper / "made")
            assert (st.st_uid, st.st_gid) == (sb.userns, sb.userns)
        finally:
            backend.delete(sb.id)
            ex.process.wait()
    finally:
        shim.unmount(sb.id)


def test_two_sandboxes_get_disjoint_ranges_and_give_them_back(shim: Shim) -> None:
    a = shim.mount(MountRequest("bb:1", userns=True))
    b = shim.mount(MountRequest("bb:1", userns=True))
    plain = shim.mount(MountRequest("bb:1"))
    try:
        assert a.userns is not None and b.userns is not None and plain.userns is None
        assert abs(a.userns - b.userns) >= idmap.RANGE_SIZE
        for sb in (a, b):
            assert os.stat(sb.target).st_uid == sb.userns
            assert os.stat(Path(sb.target) / "home" / "u" / "f").st_uid == sb.userns + 1000
        assert os.stat(Path(plain.target) / "home" / "u" / "f").st_uid == 1000
    finally:
        for sb in (a, b, plain):
            shim.unmount(sb.id)
    with shim.state.read() as t:
        assert t.count("idranges") == 0


# (no deletion: a whiteout carries the time it was made, which no touch inside can set)
WRITER = """
mkdir /data && echo data > /data/f && chown 1000:1000 /data/f && echo more >> /home/u/f
echo added > /etc/added && ln -s f /data/l
for p in / /data /data/f /data/l /etc /etc/added /home /home/u /home/u/f; do touch -h -d @1000000 $p; done
"""


def test_commit_gives_the_same_layer_with_or_without_userns(shim: Shim, store: str, tmp_path: Path) -> None:
    blobs = []
    for userns in (True, False):
        res = runner.run(shim, "bb:1", ["/bin/sh", "-c", WRITER], keep=True, userns=userns,
                         stdin=subprocess.DEVNULL)
        assert res.exit_code == 0
        sb = shim.find(res.sandbox)
        assert (sb.userns is not None) == userns
        with Store.open(store) as st:
            blobs.append(commit(st, sb, f"bb:c{int(userns)}", workdir=tmp_path).layer)
        shim.unmount(sb.id)
    assert blobs[0] == blobs[1]


def test_commit_refuses_ids_outside_the_range(shim: Shim, store: str, tmp_path: Path) -> None:
    sb = shim.mount(MountRequest("bb:1", userns=True, upper_size=1 << 20))
    try:
        (Path(sb.upper) / "planted").write_text("not the sandbox's\n")  # owned by host root
        with Store.open(store) as st, pytest.raises(BadInput, match="outside the sandbox's id range"):
            commit(st, Sandbox.from_json(sb.to_json()), "bb:bad", workdir=tmp_path)
    finally:
        shim.unmount(sb.id)


def test_run_without_userns_is_host_root(shim: Shim) -> None:
    out = shim.paths.root / "out.txt"
    for userns, want in ((True, None), (False, "0 0 4294967295")):
        with open(out, "wb") as o:
            res = runner.run(shim, "bb:1", ["/bin/sh", "-c", "cat /proc/self/uid_map"], userns=userns,
                             stdin=subprocess.DEVNULL, stdout=o)
        assert res.exit_code == 0
        fields = " ".join(out.read_text().split())
        if want is None:
            assert fields.startswith("0 ") and fields.endswith(" 65536") and fields != "0 0 65536"
        else:
            assert fields == want
