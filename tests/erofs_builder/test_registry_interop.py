"""Interop with a real OCI image tool (skopeo 1.9, Debian 12) through a token-auth registry: what
skopeo pushes (OCI media types from a layout; Docker v2 schema 2, recompressed layers, from a
docker archive) builds into exactly the layers of the local image, and skopeo pulls what our
client pushes, verifying every digest itself."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit.oci_registry import Registry, needs_registry, oci_registry
from testkit.registry_images import busybox_archive, busybox_layout, push_layout

from erofs_builder.sources.registry import DOCKER_MANIFEST, OCI_MANIFEST, Credentials, RegistryClient
from erofs_builder.workflow import build_and_push, resolve_source

pytestmark = [needs_registry,
              pytest.mark.skipif(shutil.which("skopeo") is None, reason="needs skopeo (.ci/install.d/skopeo.sh)")]


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Registry, Path]]:
    root = tmp_path_factory.mktemp("interop")
    busybox_layout(root / "layout", root / "work")
    busybox_archive(root / "archive.tar", root / "work2")
    with oci_registry(root / "registry", auth="token") as r:
        yield r, root


def skopeo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["skopeo", "--insecure-policy", *args], capture_output=True, text=True, timeout=120)


def blobs(src: str, monkeypatch: pytest.MonkeyPatch, docker_config: Path) -> list[str]:
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config))
    return [r.layer.blob for r in build_and_push(resolve_source(src, all_root=False), push=False)]


def test_images_skopeo_pushed_build_into_the_local_images_layers(reg: tuple[Registry, Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    r, root = reg
    creds = f"{r.user}:{r.password}"
    p = skopeo("copy", "--dest-tls-verify=false", "--dest-creds", creds, f"oci:{root}/layout:latest",
               f"docker://{r.ref('sk/oci', '1')}")
    assert p.returncode == 0, p.stderr
    p = skopeo("copy", "--dest-tls-verify=false", "--dest-creds", creds, f"docker-archive:{root}/archive.tar",
               f"docker://{r.ref('sk/docker', '1')}")
    assert p.returncode == 0, p.stderr
    with RegistryClient(r.host, auth=Credentials(r.user, r.password)) as c:
        assert c.get_manifest("sk/oci", "1")[1] == OCI_MANIFEST
        assert c.get_manifest("sk/docker", "1")[1] == DOCKER_MANIFEST  # gzip layers: other blob digests
    config = r.docker_config(root / "docker" / "config.json").parent
    local = blobs(f"oci:{root}/layout", monkeypatch, config)
    assert blobs(f"docker://{r.ref('sk/oci', '1')}", monkeypatch, config) == local
    assert blobs(f"docker://{r.ref('sk/docker', '1')}", monkeypatch, config) == local


def test_skopeo_pulls_what_our_client_pushes(reg: tuple[Registry, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    r, root = reg
    digest = push_layout(root / "layout", r.host, "ours/bb", "1", auth=Credentials(r.user, r.password))
    creds = f"{r.user}:{r.password}"
    p = skopeo("inspect", "--raw", "--tls-verify=false", "--creds", creds, f"docker://{r.ref('ours/bb', '1')}")
    assert p.returncode == 0, p.stderr
    assert "sha256:" + hashlib.sha256(p.stdout.encode()).hexdigest() == digest
    p = skopeo("copy", "--src-tls-verify=false", "--src-creds", creds, f"docker://{r.ref('ours/bb', '1')}",
               f"oci:{tmp_path}/pulled:x")
    assert p.returncode == 0, p.stderr  # skopeo checks every blob against its digest
    # (skopeo compresses the plain layer on the way: other blob digests, the same layers)
    config = r.docker_config(tmp_path / "docker" / "config.json").parent
    assert blobs(f"oci:{tmp_path}/pulled:x", monkeypatch, config) == blobs(f"oci:{root}/layout", monkeypatch, config)
