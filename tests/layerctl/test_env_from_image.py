"""`layerctl env create --from SRC`: a whole image (an OCI layout, a docker archive, an image in a
registry) becomes an environment in one command, with its runtime config; `layerctl run` of it
gives the image's entrypoint, env, workdir and output."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.archive_factory import ImageSpec, Layer, layer_tar, write_oci_layout
from testkit.cli_helpers import assert_clean_failure, layerctl
from testkit.oci_registry import Registry, needs_registry, oci_registry
from testkit.registry_images import EXPECTED_OUTPUT, busybox_archive, busybox_layout, push_layout
from testkit.shim_support import cleanup_node, needs_busybox, needs_root, needs_runc

from erofs_builder.image_env import image_roles

pytestmark = [needs_registry, needs_busybox]
CONFIG = {"entrypoint": ["/opt/tool/greet"], "cmd": ["from-cmd"],
          "env": ["PATH=/opt/tool:/bin", "GREETING=hello-from-image"], "workdir": "/work", "user": "nobody"}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """The testkit busybox image as an OCI layout, a docker archive and in a registry (pushed
    twice: `t/bb:1`, and `t/bad:1` whose first layer the test tampers with in the registry's
    storage, keeping its size)."""
    root = tmp_path_factory.mktemp("images")
    busybox_layout(root / "layout", root / "work")
    busybox_archive(root / "archive.tar", root / "work2")
    with oci_registry(root / "registry") as reg:
        digest = push_layout(root / "layout", reg.host, "t/bb", "1")
        push_layout(root / "layout", reg.host, "t/bad", "1")
        yield {"root": root, "registry": reg, "digest": digest}


def _store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    assert layerctl("store", "init", "--store", url).code == 0
    return url


def _from(url: str, src: str, tag: str, *extra: str, env: dict[str, str] | None = None) -> dict:
    r = layerctl("env", "create", "--store", url, "--from", src, "-t", tag, "--json", *extra, env=env)
    assert r.code == 0, r.err
    return dict(r.json())


def test_every_kind_of_image_source_gives_the_same_environment(images: dict, tmp_path: Path) -> None:
    url = _store(tmp_path)
    root, reg = images["root"], images["registry"]
    made = [_from(url, f"oci:{root}/layout", "a:1"), _from(url, f"docker-archive:{root}/archive.tar", "b:1"),
            _from(url, f"docker://{reg.ref('t/bb', '1')}", "c:1")]
    assert len({m["manifest"] for m in made}) == 1, made
    m = made[0]
    assert [layer["role"] for layer in m["layers"]] == ["base", "toolkit", "toolkit"]
    assert m["image_layers"] == 3 and m["dropped_duplicates"] == 0
    assert m["config"] == CONFIG
    shown = layerctl("env", "show", "--store", url, "c:1", "--json").json()
    assert shown["manifest"] == m["manifest"] and shown["environment"]["config"] == CONFIG
    # the layers are in the store: the environment checks out as a runtime would check it
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"require_signature": False, "trusted_keys": []}))
    assert layerctl("env", "verify", "--store", url, "--policy", str(policy), "a:1").code == 0


def test_running_again_stores_nothing_twice(images: dict, tmp_path: Path) -> None:
    """What a rerun after a crash does: the layers are there already; only a tag is new."""
    url = _store(tmp_path)
    src = f"docker://{images['registry'].ref('t/bb', '1')}"

    def objects() -> set[Path]:
        return {p for kind in ("chunks", "blobs", "manifests") for p in (Path(url) / kind).rglob("*") if p.is_file()}

    first = _from(url, src, "again:1")
    before = objects()
    assert _from(url, src, "again:2")["manifest"] == first["manifest"]
    assert objects() == before


def test_top_workspace_workspace_and_config_override(images: dict, tmp_path: Path) -> None:
    url = _store(tmp_path)
    src = f"oci:{images['root']}/layout"
    m = _from(url, src, "w:1", "--top-workspace")
    assert [layer["role"] for layer in m["layers"]] == ["base", "toolkit", "workspace"]
    ws = tmp_path / "ws"
    (ws / "task").mkdir(parents=True)
    (ws / "task" / "notes").write_text("mine\n")
    blob = layerctl("build", str(ws), "--push", "--store", url, "--json").json()["blob"]
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"cmd": ["/bin/sh"], "workdir": "/task"}))
    m = _from(url, src, "w:2", "--workspace", blob, "--config", str(cfg), "--annotation", "org.example.task=17")
    assert [(layer["role"], layer["blob"] == blob) for layer in m["layers"]] == \
        [("base", False), ("toolkit", False), ("toolkit", False), ("workspace", True)]
    assert m["config"]["cmd"] == ["/bin/sh"] and m["config"]["workdir"] == "/task" and m["config"]["env"] == []
    shown = layerctl("env", "show", "--store", url, "w:2", "--json").json()
    assert shown["environment"]["annotations"] == {"org.example.task": "17"}


def test_a_layer_repeated_in_the_image_is_kept_once_on_top(tmp_path: Path) -> None:
    a = layer_tar([("dir", "etc", 0o755), ("file", "etc/a", b"a\n")])
    b = layer_tar([("dir", "etc", 0o755), ("file", "etc/.wh.a", b""), ("file", "etc/b", b"b\n")])
    write_oci_layout(tmp_path / "layout", ImageSpec([Layer(a), Layer(b), Layer(a)]))
    url = _store(tmp_path)
    m = _from(url, f"oci:{tmp_path}/layout", "dup:1")
    assert m["image_layers"] == 3 and m["dropped_duplicates"] == 1
    assert [layer["role"] for layer in m["layers"]] == ["base", "toolkit"]
    # b is now the base and a on top of it: etc/a is there (deleted by b, added back by the second a)
    assert image_roles(["x", "y", "x"]) == ([("y", "base"), ("x", "toolkit")], 1)
    assert image_roles(["x", "y", "z"], top_workspace=True)[0][-1] == ("z", "workspace")


def test_refusals_are_one_line(images: dict, tmp_path: Path) -> None:
    url = _store(tmp_path)
    src = f"oci:{images['root']}/layout"
    args = ("env", "create", "--store", url, "-t", "x:1")
    assert_clean_failure(layerctl(*args, "--from", src, "--base", "b3:" + "0" * 64), "not both")
    assert_clean_failure(layerctl(*args), "Missing option '--base' (or --from SRC")
    assert_clean_failure(layerctl(*args, "--from", src, "--toolkit", "b3:" + "0" * 64), "--toolkit goes with --base")
    assert_clean_failure(layerctl(*args, "--from", str(tmp_path)), "want an image")
    assert_clean_failure(layerctl(*args, "--from", src, "--top-workspace", "--workspace", "b3:" + "0" * 64),
                         "give one")
    assert_clean_failure(layerctl(*args, "--from", "docker://busybox:latest"), "no default registry")
    assert layerctl("env", "ls", "--store", url, "--json").json() == []


def test_a_registry_serving_a_tampered_layer_publishes_nothing(images: dict, tmp_path: Path) -> None:
    reg: Registry = images["registry"]
    layout = images["root"] / "layout"
    manifest_digest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    manifest = json.loads((layout / "blobs/sha256" / manifest_digest[7:]).read_bytes())
    hexd = manifest["layers"][1]["digest"][7:]
    data = reg.root / "storage/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
    good = data.read_bytes()
    data.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])  # same size, one byte changed
    url = _store(tmp_path)
    try:
        r = layerctl("env", "create", "--store", url, "--from", f"docker://{reg.ref('t/bad', '1')}", "-t", "bad:1")
    finally:
        data.write_bytes(good)
    assert_clean_failure(r, f"blob sha256:{hexd}: digest mismatch")  # the download's check, before the tar reader
    assert r.code == 2
    assert layerctl("env", "ls", "--store", url, "--json").json() == []
    stored = [p for kind in ("chunks", "blobs", "manifests") for p in (Path(url) / kind).rglob("*") if p.is_file()]
    assert stored == []  # nothing of the image reached the store: every layer is verified first


def test_registry_credentials_from_a_docker_config(images: dict, tmp_path: Path) -> None:
    with oci_registry(tmp_path / "reg", auth="token") as reg:
        from erofs_builder.sources.registry import Credentials

        push_layout(images["root"] / "layout", reg.host, "t/private", "1", auth=Credentials(reg.user, reg.password))
        url = _store(tmp_path)
        src = f"docker://{reg.ref('t/private', '1')}"
        r = layerctl("env", "create", "--store", url, "--from", src, "-t", "p:1",
                     env={"DOCKER_CONFIG": str(tmp_path / "no-config")})
        assert_clean_failure(r, "refused")
        assert r.code == 6
        reg.docker_config(tmp_path / "docker" / "config.json")
        m = _from(url, src, "p:1", env={"DOCKER_CONFIG": str(tmp_path / "docker")})
        assert m["config"] == CONFIG


@needs_root
@needs_runc
def test_run_of_an_image_environment_gives_the_images_config(images: dict, tmp_path: Path) -> None:
    url = _store(tmp_path)
    _from(url, f"docker://{images['registry'].ref('t/bb', '1')}", "img:1")
    node = tmp_path / "node"
    try:
        args = ("run", "--store", url, "--node-dir", str(node), "img:1")
        r = layerctl(*args)
        assert (r.code, r.out) == (0, EXPECTED_OUTPUT), r.err
        r = layerctl(*args, "--", "given", "args")  # a command replaces Cmd, not the entrypoint
        assert (r.code, r.out.splitlines()[0]) == (0, "hello-from-image in /work as 65534 args: given args"), r.err
    finally:
        cleanup_node(node, tmp_path)


def test_build_from_a_registry(images: dict, tmp_path: Path) -> None:
    url = _store(tmp_path)
    src = f"docker://{images['registry'].ref('t/bb', '1')}"
    r = layerctl("build", src, "--push", "--store", url, "--output", str(tmp_path / "out"),
                 "--config-out", str(tmp_path / "cfg.json"), "--json")
    assert r.code == 0, r.err
    local = layerctl("build", f"oci:{images['root']}/layout", "--json").json()
    assert [x["blob"] for x in r.json()] == [x["blob"] for x in local]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(x["blob"][3:] + ".erofs" for x in local)
    assert json.loads((tmp_path / "cfg.json").read_text()) == CONFIG
    r = layerctl("build", f"docker://{images['registry'].ref('t/bb', 'nope')}", "--json")
    assert_clean_failure(r, "not found")
    assert r.code == 3


class _StallingProxy:
    """A loopback HTTP proxy in front of the registry that holds the request for `stall_on` (a
    path suffix) until the test is done with it: a fixed point at which to kill the client."""

    def __init__(self, upstream: str, stall_on: str) -> None:
        import http.server
        import threading
        import urllib.request

        self.reached, self.release = threading.Event(), threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.endswith(stall_on):
                    proxy.reached.set()
                    proxy.release.wait(60)
                    return
                req = urllib.request.Request(f"http://{upstream}{self.path}",
                                             headers={k: v for k, v in self.headers.items() if k.lower() == "accept"})
                try:
                    with urllib.request.urlopen(req, timeout=30) as r:
                        body, status, headers = r.read(), r.status, r.headers
                except urllib.error.HTTPError as e:
                    body, status, headers = e.read(), e.code, e.headers
                self.send_response(status)
                for k in ("Content-Type", "Docker-Content-Digest"):
                    if headers.get(k):
                        self.send_header(k, headers[k])
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _StallingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


def test_kill_9_half_way_then_again(images: dict, tmp_path: Path) -> None:
    """kill -9 while the last layer downloads (two layers built, nothing pushed yet): no tag, no
    download left behind; the same command again creates the environment."""
    import signal
    import subprocess

    from testkit.cli_helpers import LAYERCTL

    reg: Registry = images["registry"]
    layout = images["root"] / "layout"
    mdigest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    last = json.loads((layout / "blobs/sha256" / mdigest[7:]).read_bytes())["layers"][-1]["digest"]
    url = _store(tmp_path)
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    with _StallingProxy(reg.host, last) as proxy:
        env = {**os.environ, "TMPDIR": str(tmp)}
        env.pop("LAYERSTORE_STORE", None)
        proc = subprocess.Popen([LAYERCTL, "env", "create", "--store", url, "--from", f"docker://{proxy.host}/t/bb:1",
                                 "-t", "crash:1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert proxy.reached.wait(120), "the client never asked for the last layer"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert layerctl("env", "ls", "--store", url, "--json").json() == []
    # the downloads were anonymous temp files: gone. What is left is the build's staging directory
    # (workflow.Staging: the layers built so far), which nothing sweeps after a kill -9 yet.
    left = list(tmp.iterdir())
    assert [p.name.startswith("layerctl-build-") and p.is_dir() for p in left] == [True], left
    names = {p.name for p in left[0].iterdir()}
    assert {"layer-0.erofs", "layer-1.erofs"} <= names and all(n.lstrip(".").startswith("layer-") for n in names)
    m = _from(url, f"docker://{reg.ref('t/bb', '1')}", "crash:1")
    assert [layer["role"] for layer in m["layers"]] == ["base", "toolkit", "toolkit"]
