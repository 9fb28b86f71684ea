"""Kubernetes' pull path: containerd 1.6's CRI plugin with `snapshotter = "layerstore"` (the shipped
snapshotter/contrib/containerd-cri.toml), driven over the CRI API (testkit.cri) as the kubelet
would, with a local registry (pause image built here) and host-network pods (no CNI):

- a layerstore image (Debian minbase + the machine's python3.11, > 150 MB of layers) pulled by the
  CRI's own PullImage: no layer enters containerd's content store, the node daemon fetched at most
  5% of the image by then; RunPodSandbox, CreateContainer, StartContainer, ExecSync of python; the
  container's file tree equal, file by file, to the same layers pushed as an ordinary image and
  pulled by a second containerd whose CRI plugin uses the overlayfs snapshotter;
- the snapshotter restarted (kill -9) between pull and run;
- the image removed while its pod runs; its layers go once the pod goes;
- the registry gone after the pull: cached and uncached reads keep working;
- an environment signed by an untrusted key under a policy requiring signatures: refused at pull,
  nothing mounted.

One registry, store, node, snapshotter and the two containerds for the module; the images are
built once. Tests run in file order, each leaving no pod behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from testkit.cli_helpers import layerctl
from testkit.containerd import CRI_NAMESPACE, Containerd, Cri, containerd, needs_containerd
from testkit.cri import CriClient, push_pause
from testkit.oci_registry import Registry, needs_registry, oci_registry
from testkit.shim_support import busybox_rootfs, cleanup_node, needs_busybox, needs_runc

from erofs_builder.sources.registry import RegistryClient
from snapshotter.snapshots import LABEL_BLOB, REMOTE_PREFIX

from ..runtime_shim.test_shim_debian import debian_tar
from .test_containerd import SnapshotterProcess, retry

pytestmark = [pytest.mark.root, needs_containerd, needs_registry, needs_busybox, needs_runc,
              pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="needs mmdebstrap (.ci/install-deps.sh)")]
PYTHON = "/usr/bin/python3.11"
TAR_LAYER = "application/vnd.oci.image.layer.v1.tar"


def python_tree(root: Path) -> Path:
    """The machine's Debian python3.11 (the minbase's libc): interpreter, stdlib, libexpat."""
    (root / "usr" / "bin").mkdir(parents=True)
    shutil.copy2(PYTHON, root / "usr" / "bin" / "python3.11")
    os.symlink("python3.11", root / "usr" / "bin" / "python3")
    shutil.copytree("/usr/lib/python3.11", root / "usr" / "lib" / "python3.11", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "dist-packages", "site-packages"))
    lib = root / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    for name in os.listdir("/usr/lib/x86_64-linux-gnu"):
        if name.startswith("libexpat.so"):
            shutil.copy2(f"/usr/lib/x86_64-linux-gnu/{name}", lib / name, follow_symlinks=False)
    return root


def tar_of(tree: Path, out: Path) -> Path:
    def root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        for entry in sorted(os.listdir(tree)):
            tf.add(tree / entry, arcname=entry, filter=root_owned)
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def push_tar_image(registry: str, repo: str, tag: str, tars: list[Path]) -> None:
    """An ordinary OCI image of uncompressed tar layers (the same bytes the layerstore image was
    built from)."""
    diff_ids = [sha256_file(t) for t in tars]
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin:/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    cdigest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdigest,
                           "size": len(config)},
                "layers": [{"mediaType": TAR_LAYER, "digest": d, "size": t.stat().st_size}
                           for d, t in zip(diff_ids, tars, strict=True)]}
    with RegistryClient(registry) as reg:
        for d, t in zip(diff_ids, tars, strict=True):
            reg.push_blob(repo, t, d)
        reg.push_blob(repo, config, cdigest)
        reg.put_manifest(repo, tag, json.dumps(manifest).encode(), manifest["mediaType"])


@dataclass
class World:
    lazy: Containerd  # CRI -> layerstore
    plain: Containerd  # CRI -> overlayfs
    reg: Registry
    snap: SnapshotterProcess
    store: str
    node: Path
    work: Path
    env_ref: str  # the layerstore image (pointers)
    oci_ref: str  # the same layers as an ordinary image
    blobs: dict[str, int]  # the environment's blobs and their sizes


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    minbase = debian_tar()  # (built once per machine, shared with the shim's Debian tests)
    work = tmp_path_factory.mktemp("cri")
    node = work / "node"
    py_tar = tar_of(python_tree(work / "python"), work / "python.tar")
    store = str(work / "store")
    assert layerctl("store", "init", "--store", store).code == 0
    blobs: dict[str, int] = {}
    for src, role in ((minbase, "base"), (py_tar, "toolkit")):
        r = layerctl("build", str(src), "--push", "--role", role, "--store", store, "--json", timeout=600)
        assert r.code == 0, r.err
        blobs[r.json()["blob"]] = int(r.json()["size"])
    base, tool = list(blobs)
    r = layerctl("env", "create", "--store", store, "--base", base, "--toolkit", tool, "-t", "py:1")
    assert r.code == 0, r.err
    sock = Path(f"/run/ls-cri-{os.getpid()}.sock")
    snap = SnapshotterProcess(node, store, sock, work / "snapshotter.log")
    try:
        snap.start()
        with contextlib.ExitStack() as stack:
            reg = stack.enter_context(oci_registry(work / "registry"))
            pause = push_pause(work, reg.host)
            env_ref, oci_ref = reg.ref("envs/py", "1"), reg.ref("oci/py", "1")
            r = layerctl("ctr", "push", "--store", store, "py:1", env_ref, "--json")
            assert r.code == 0, r.err
            push_tar_image(reg.host, "oci/py", "1", [minbase, py_tar])
            lazy = stack.enter_context(containerd(snapshotters={"layerstore": str(sock)},
                                                  cri=Cri(pause, (reg.host,))))
            plain = stack.enter_context(containerd(cri=Cri(pause, (reg.host,), snapshotter="overlayfs")))
            yield World(lazy, plain, reg, snap, store, node, work, env_ref, oci_ref, blobs)
    finally:
        snap.stop()
        cleanup_node(node, work)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()


@contextlib.contextmanager
def pod_with(ctd: Containerd, image: str, name: str) -> Iterator[tuple[CriClient, str]]:
    """A host-network pod running one container of `image` (sleeping); removed afterwards."""
    with CriClient(ctd.cri_address) as cri:
        pod = cri.run_pod(name)
        try:
            cid = cri.create(pod, name, image, ["/bin/sleep", "600"])
            cri.start(cid)
            yield cri, cid
        finally:
            cri.remove_pod(pod)


def rootfs(ctd: Containerd, cid: str) -> Path:
    return ctd.root / "state" / "io.containerd.runtime.v2.task" / CRI_NAMESPACE / cid / "rootfs"


def tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under `root` (not crossing mounts): type, mode, owner, size, content digest,
    symlink target, device number."""
    out: dict[str, tuple[object, ...]] = {}
    dev = root.stat().st_dev
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISDIR(st.st_mode) and st.st_dev != dev:
                dirs.remove(name)
                continue
            rel = str(p.relative_to(root))
            content: object = ""
            if stat.S_ISREG(st.st_mode):
                content = sha256_file(p)
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                content = st.st_rdev
            size = st.st_size if not stat.S_ISDIR(st.st_mode) else 0  # (a directory's size is the fs's)
            out[rel] = (st.st_mode, st.st_uid, st.st_gid, size, content)
    return out


def fetched(w: World) -> int:
    r = layerctl("stats", "--cache", str(w.node / "cache"), "--json")
    assert r.code == 0, r.err
    blobs = r.json()["blobs"]
    return sum(int(blobs.get(b, {}).get("fetched_bytes", 0)) for b in w.blobs)


def layer_descriptors(w: World, ref: str) -> list[str]:
    repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
    with RegistryClient(w.reg.host) as reg:
        body, _, _ = reg.get_manifest(repo, tag)
    return [d["digest"] for d in json.loads(body)["layers"]]


def remote_snapshots(w: World) -> list[str]:
    return [k for k in w.snap.walk() if k.startswith(REMOTE_PREFIX)]


def test_cri_pull_is_lazy_and_the_container_equals_the_ordinary_image(world: World) -> None:
    w = world
    total = sum(w.blobs.values())
    assert total >= 150 << 20
    with CriClient(w.lazy.cri_address) as cri:
        cri.pull(w.env_ref)
    # nothing of the layers in containerd's content store: the manifest and the config only
    content = set(w.lazy.ctr("content", "ls", "-q", namespace=CRI_NAMESPACE).stdout.split())
    assert not content & set(layer_descriptors(w, w.env_ref)) and len(content) == 2
    assert len(remote_snapshots(w)) == 2 and len(w.snap.layer_mounts()) == 2
    at_pull = fetched(w)
    assert 0 < at_pull <= total * 5 // 100, (at_pull, total)
    print(f"CRI pull: {at_pull} of {total} bytes fetched from the store ({100 * at_pull / total:.2f}%)")
    with CriClient(w.plain.cri_address) as cri2:
        cri2.pull(w.oci_ref)
    with pod_with(w.lazy, w.env_ref, "lazy") as (cri, cid), pod_with(w.plain, w.oci_ref, "plain") as (cri2, cid2):
        want = tree(rootfs(w.plain, cid2))  # (before any exec: python would write bytecode caches)
        got = tree(rootfs(w.lazy, cid))
        code, out, err = cri.exec(cid, ["/usr/bin/python3", "-c",
                                        "import json, sys; print(json.dumps(sys.version_info[:2]))"])
        assert (code, out) == (0, b"[3, 11]\n"), err
    assert len(want) > 5000
    assert got == want, sorted(set(got.items()) ^ set(want.items()))[:10]
    with CriClient(w.plain.cri_address) as cri2:
        cri2.remove_image(w.oci_ref)


def reachable(w: World) -> None:
    """Wait until containerd reaches a restarted snapshotter (it reconnects with a backoff of up
    to ~3 s; until then it fails proxied calls at once)."""
    def probe() -> None:
        key = f"probe-{time.monotonic_ns()}"
        w.lazy.ctr("snapshots", "--snapshotter", "layerstore", "prepare", key)
        w.lazy.ctr("snapshots", "--snapshotter", "layerstore", "rm", key)

    retry(probe)


def test_snapshotter_restarted_between_pull_and_run(world: World) -> None:
    w = world
    with CriClient(w.lazy.cri_address) as cri:
        cri.pull(w.env_ref)
    w.snap.stop(signal.SIGKILL)
    w.snap.start()
    reachable(w)
    with pod_with(w.lazy, w.env_ref, "restart") as (cri, cid):
        code, out, _ = cri.exec(cid, ["/usr/bin/python3", "-c", "import email.parser; print('ok')"])
        assert (code, out) == (0, b"ok\n")


def test_image_removed_while_its_pod_runs(world: World) -> None:
    w = world
    with CriClient(w.lazy.cri_address) as cri:
        cri.pull(w.env_ref)
        with pod_with(w.lazy, w.env_ref, "removal") as (cri2, cid):
            cri.remove_image(w.env_ref)
            assert cri.image_status(w.env_ref) is None
            code, out, _ = cri2.exec(cid, ["/usr/bin/python3", "-c", "import xml.dom.minidom; print('still')"])
            assert (code, out) == (0, b"still\n")
            assert len(w.snap.layer_mounts()) == 2  # the running container's layers stay
        # the pod gone, containerd's garbage collection takes the layers (and our holds)
        w.lazy.ctr("images", "ls", namespace=CRI_NAMESPACE)
        deadline = time.monotonic() + 30
        while remote_snapshots(w) and time.monotonic() < deadline:
            w.lazy.ctr("snapshots", "--snapshotter", "layerstore", "ls", namespace=CRI_NAMESPACE)
            time.sleep(0.5)
        assert remote_snapshots(w) == [] and w.snap.layer_mounts() == []


def test_untrusted_signature_is_refused_at_pull(world: World) -> None:
    w = world
    keys = w.work / "keys"
    keys.mkdir()
    trusted = layerctl("env", "keygen", "--out", str(keys / "trusted.pem"), "--json")
    assert layerctl("env", "keygen", "--out", str(keys / "other.pem")).code == 0
    r = layerctl("build", str(busybox_rootfs(w.work / "untrusted-base")), "--push", "--store", w.store, "--json")
    assert r.code == 0, r.err
    blob = r.json()["blob"]
    assert layerctl("env", "create", "--store", w.store, "--base", blob, "-t", "bb:1", "--sign",
                    str(keys / "other.pem")).code == 0  # signed, by a key the node does not trust
    ref = w.reg.ref("envs/untrusted", "1")
    assert layerctl("ctr", "push", "--store", w.store, "bb:1", ref).code == 0
    policy = w.node / "policy.json"
    policy.write_text(json.dumps({"require_signature": True, "trusted_keys": [trusted.json()["public_key"]]}))
    try:
        w.snap.stop()
        w.snap.start()  # (the node's policy is read at start)
        reachable(w)
        with CriClient(w.lazy.cri_address) as cri:
            def refused() -> str:
                try:
                    cri.pull(ref)
                except grpc.RpcError as e:
                    return e.details() or ""
                raise AssertionError(f"{ref} was pulled under a policy that requires a trusted signature")

            detail = refused()
            assert "sign" in detail or "trust" in detail, detail
            assert cri.image_status(ref) is None
        # no record of the blob (other snapshots may come and go: the collection of the test before)
        assert not [i.name for i in w.snap.walk().values() if i.labels.get(LABEL_BLOB) == blob]
        assert not any(blob.split(":")[1] in m for m in w.snap.layer_mounts())
    finally:
        policy.unlink()
        w.snap.stop()
        w.snap.start()
        reachable(w)


def test_registry_gone_after_the_pull(world: World) -> None:
    """(Last: the module's registry is stopped for good.)"""
    w = world
    with CriClient(w.lazy.cri_address) as cri:
        cri.pull(w.env_ref)
    os.kill(w.reg.pid, signal.SIGTERM)  # (the registry we started; the fixture's stop then finds it gone)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _answers(w.reg.host):
        time.sleep(0.1)
    assert not _answers(w.reg.host)
    with pod_with(w.lazy, w.env_ref, "gone") as (cri, cid):
        for _ in range(2):  # uncached (fetched from the store now), then cached
            code, out, err = cri.exec(cid, ["/usr/bin/python3", "-c", "import difflib, tarfile; print('read')"])
            assert (code, out) == (0, b"read\n"), err


def _answers(host: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}/v2/", timeout=2):
            return True
    except OSError:
        return False
