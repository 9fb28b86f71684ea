"""The node's trust policy (NODE/policy.json) is a floor: a caller's policy (`--policy`,
$LAYERSTORE_TRUST_POLICY, `-o policy=`) combines with it and can only tighten it. Checked at the
shim's one place (Shim.for_node) and in the mount helper; everything here is refused before
anything is mounted, so no daemon runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerstore.store import Store
from manifest.environment import build_manifest, create_environment
from manifest.errors import UntrustedManifest
from manifest.files import POLICY_ENV
from manifest.signing import PrivateKey
from runtime_shim.mount_helper import EXIT_FAILURE, mount_main
from runtime_shim.node.shim import Shim
from runtime_shim.nodestate.paths import NODE_DIR_ENV

NODE_KEY, OTHER_KEY = PrivateKey.generate(), PrivateKey.generate()


def write_policy(path: Path, *keys: PrivateKey, require: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"require_signature": require, "trusted_keys": [str(k.public_key()) for k in keys]}))
    return path


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.delenv(POLICY_ENV, raising=False)
    url = str(tmp_path / "store")
    s = Store.open(url)
    s.init()
    (tmp_path / "base").write_bytes(b"b" * 5000)
    base = s.put_blob(tmp_path / "base").blob
    m = build_manifest(s, base=base)
    create_environment(s, m, "e:unsigned")
    create_environment(s, build_manifest(s, base=base, annotations={"k": "node"}), "e:node", key=NODE_KEY)
    create_environment(s, build_manifest(s, base=base, annotations={"k": "other"}), "e:other", key=OTHER_KEY)
    both = build_manifest(s, base=base, annotations={"k": "both"})
    create_environment(s, both, "e:both", key=NODE_KEY)
    create_environment(s, both, "e:both", key=OTHER_KEY)
    s.close()
    yield url


@pytest.fixture
def node(tmp_path: Path) -> Path:
    node = tmp_path / "node"
    write_policy(node / "policy.json", NODE_KEY)
    return node


def _resolves(node: Path, store: str, ref: str, policy: Path | None = None) -> bool:
    with Shim.for_node(node, store, auto_recover=False, policy=policy) as shim:
        try:
            shim.resolve(ref)
        except UntrustedManifest:
            return False
        return True


@pytest.mark.parametrize("caller", ["none-required", "another-key", "another-key-reported"])
def test_a_permissive_caller_policy_cannot_loosen_the_node(tmp_path: Path, store: str, node: Path,
                                                           caller: str, monkeypatch: pytest.MonkeyPatch) -> None:
    loose = {"none-required": write_policy(tmp_path / "loose.json", require=False),
             "another-key": write_policy(tmp_path / "loose.json", OTHER_KEY),
             "another-key-reported": write_policy(tmp_path / "loose.json", OTHER_KEY, require=False)}[caller]
    for ref in ("e:unsigned", "e:other"):
        assert not _resolves(node, store, ref, loose)  # --policy / -o policy=
        monkeypatch.setenv(POLICY_ENV, str(loose))
        assert not _resolves(node, store, ref)  # $LAYERSTORE_TRUST_POLICY
        monkeypatch.delenv(POLICY_ENV)
    assert not _resolves(node, store, "e:unsigned")
    assert _resolves(node, store, "e:node", None if caller == "another-key" else loose)


def test_a_stricter_caller_policy_is_honoured(tmp_path: Path, store: str, node: Path) -> None:
    strict = write_policy(tmp_path / "strict.json", OTHER_KEY)
    assert _resolves(node, store, "e:node")
    assert not _resolves(node, store, "e:node", strict)  # the caller also wants OTHER_KEY's signature
    assert not _resolves(node, store, "e:other", strict)  # ... and the node still wants NODE_KEY's
    assert _resolves(node, store, "e:both", strict)
    bare = tmp_path / "bare-node"  # a node without a policy: the caller's applies as it is
    assert _resolves(bare, store, "e:unsigned") and not _resolves(bare, store, "e:unsigned", strict)
    assert _resolves(bare, store, "e:other", strict)


def test_a_broken_node_policy_fails_closed(tmp_path: Path, store: str, node: Path) -> None:
    from layerstore.errors import ConfigError

    (node / "policy.json").write_text("{")
    with pytest.raises(ConfigError):
        _resolves(node, store, "e:unsigned", write_policy(tmp_path / "loose.json", require=False))


def test_mount_helper_options_cannot_loosen_the_node(tmp_path: Path, store: str, node: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(NODE_DIR_ENV, str(node))
    # A sandbox id the shim refuses right after resolving: code that let the environment through
    # fails there, before anything is mounted (no daemon is started by this test either way).
    opts = f"sandbox=-never-valid,store={store}"
    loose = write_policy(tmp_path / "loose.json", require=False)
    target = tmp_path / "t"
    assert mount_main(["e:unsigned", str(target), "-o", f"{opts},policy={loose}"]) == EXIT_FAILURE
    assert "is not signed" in capsys.readouterr().err
    # another node directory without the node's policy is no way around it either
    weak = tmp_path / "weak-node"
    write_policy(weak / "policy.json", OTHER_KEY)
    for other in (tmp_path / "empty-node", weak):
        assert mount_main(["e:other", str(target), "-o", f"{opts},node_dir={other}"]) == EXIT_FAILURE
        assert "trust policy is weaker than the node's" in capsys.readouterr().err
        assert not (other / "state").exists()  # refused before the node was even set up
    assert not target.exists()
