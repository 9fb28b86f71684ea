"""Environments in a real (local) store, in process: create, resolve, sign, trust."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from layerstore import keys as storekeys
from layerstore.errors import ConfigError, NotFound
from layerstore.store import Store
from manifest.config import RuntimeConfig
from manifest.environment import (
    build_manifest,
    check_layers,
    create_environment,
    list_environments,
    put_signature,
    resolve_environment,
    signature_tag,
    signatures,
    verified_signers,
)
from manifest.errors import InvalidManifest, UntrustedManifest
from manifest.schema import Layer, Manifest
from manifest.signing import PrivateKey, Signature, TrustPolicy, sign_manifest


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(str(tmp_path / "store"))
    s.init()
    yield s
    s.close()


def blob(store: Store, tmp_path: Path, name: str, size: int, chunk_size: int = 4096) -> str:
    p = tmp_path / name
    p.write_bytes((name.encode() * (size // len(name) + 1))[:size])
    return store.put_blob(p, chunk_size=chunk_size).blob


@pytest.fixture
def layers(store: Store, tmp_path: Path) -> tuple[str, str, str]:
    return (blob(store, tmp_path, "base", 10_000), blob(store, tmp_path, "tool", 5_000),
            blob(store, tmp_path, "work", 100))


@pytest.fixture(scope="module")
def key() -> PrivateKey:
    return PrivateKey.generate()


def test_build_and_resolve(store: Store, layers: tuple[str, str, str]) -> None:
    b, t, w = layers
    cfg = RuntimeConfig(cmd=("/bin/sh",))
    m = build_manifest(store, base=b, toolkits=[t], workspace=w, config=cfg,
                       trace={b: [2, 0, 2], "b3:" + "0" * 64: [5]}, annotations={"k": "v"})
    assert [(x.role, x.size) for x in m.layers] == [("base", 10_000), ("toolkit", 5_000), ("workspace", 100)]
    assert m.prefetch == {b: (2, 0)}
    created = create_environment(store, m, "py:v1")
    assert created.manifest == m.digest() and created.to_json() == {"manifest": m.digest(), "tag": "py:v1"}
    assert store.get_tag("py:v1") == m.digest()
    env = resolve_environment(store, "py:v1")
    assert env.digest == m.digest() and env.manifest == m and env.config == cfg and env.signed_by == ()
    assert resolve_environment(store, m.digest()).manifest == m
    assert list_environments(store) == {"py:v1": m.digest()}


def test_missing_blob_and_bad_digests(store: Store, layers: tuple[str, str, str]) -> None:
    b, t, _ = layers
    absent = "b3:" + "a" * 64
    with pytest.raises(NotFound, match=f"layer blob {absent} is not in store"):
        build_manifest(store, base=b, toolkits=[absent])
    with pytest.raises(ConfigError, match="--toolkit: not a digest"):
        build_manifest(store, base=b, toolkits=["sha256:abc"])
    with pytest.raises(InvalidManifest, match="given twice"):
        build_manifest(store, base=b, toolkits=[t, t])
    with pytest.raises(InvalidManifest, match="entry 0 is chunk 99, but the blob has 3 chunks"):
        build_manifest(store, base=b, trace={b: [99]})


def test_reserved_tags(store: Store, layers: tuple[str, str, str]) -> None:
    m = build_manifest(store, base=layers[0])
    for tag in ("sig/abc:x", "sig:x", "b3:" + "0" * 64):
        with pytest.raises(ConfigError, match="reserved"):
            create_environment(store, m, tag)
    with pytest.raises(ConfigError, match="not a tag reference"):
        create_environment(store, m, "NoUpper:x")


def test_resolve_errors(store: Store, layers: tuple[str, str, str]) -> None:
    with pytest.raises(NotFound, match="tag nope:v1 is not in store"):
        resolve_environment(store, "nope:v1")
    with pytest.raises(NotFound, match="manifest b3:0+ is not in store"):
        resolve_environment(store, "b3:" + "0" * 64)
    with pytest.raises(ConfigError, match="not a digest"):
        resolve_environment(store, "b3:xyz")
    # a stored object that is not an environment (here, a signature) is refused clearly
    m = build_manifest(store, base=layers[0])
    create_environment(store, m, "a:b")
    sig = PrivateKey.generate()
    put_signature(store, sign_manifest(m.digest(), sig))
    sig_obj = store.get_tag(signature_tag(m.digest(), sig.public_key()))
    with pytest.raises(InvalidManifest, match="not an environment manifest"):
        resolve_environment(store, sig_obj)


def test_layers_checked_when_asked(store: Store, layers: tuple[str, str, str], tmp_path: Path) -> None:
    b = layers[0]
    forged = Manifest(layers=(Layer(b, 10_001, "base"),))
    store.put_manifest(forged.to_bytes())
    store.set_tag("forged:v1", forged.digest())
    resolve_environment(store, "forged:v1")
    with pytest.raises(InvalidManifest, match=r"size 10001 does not match the store's chunk map .* \(10000 bytes\)"):
        resolve_environment(store, "forged:v1", check_layer_blobs=True)
    gone = Manifest(layers=(Layer("b3:" + "1" * 64, 1, "base"),))
    with pytest.raises(NotFound, match="is not in store"):
        check_layers(store, gone)


def test_signed_environment_passes_policy(store: Store, layers: tuple[str, str, str], key: PrivateKey) -> None:
    m = build_manifest(store, base=layers[0], toolkits=[layers[1]])
    created = create_environment(store, m, "py:signed", key=key)
    assert created.signed_by == key.public_key()
    assert store.get_tag(signature_tag(m.digest(), key.public_key()))
    strict = TrustPolicy(True, frozenset({key.public_key()}))
    env = resolve_environment(store, "py:signed", strict)
    assert env.signed_by == (key.public_key(),)
    assert verified_signers(store, m.digest()) == (key.public_key(),)
    # signature tags are not environments
    assert list_environments(store) == {"py:signed": m.digest()}
    # re-creating with the same key is idempotent
    create_environment(store, m, "py:signed2", key=key)
    assert len(signatures(store, m.digest())[0]) == 1


def test_unsigned_and_untrusted_refused(store: Store, layers: tuple[str, str, str], key: PrivateKey) -> None:
    strict = TrustPolicy(True, frozenset({key.public_key()}))
    m = build_manifest(store, base=layers[0])
    create_environment(store, m, "py:unsigned")
    with pytest.raises(UntrustedManifest, match=r"environment py:unsigned \(b3:.*\) is not signed"):
        resolve_environment(store, "py:unsigned", strict)
    resolve_environment(store, "py:unsigned", TrustPolicy(False))  # not required: passes
    stranger = PrivateKey.generate()
    put_signature(store, sign_manifest(m.digest(), stranger))
    with pytest.raises(UntrustedManifest, match="1 valid signature.s. by untrusted keys"):
        resolve_environment(store, "py:unsigned", strict)
    put_signature(store, sign_manifest(m.digest(), key))
    assert resolve_environment(store, "py:unsigned", strict).signed_by == (key.public_key(),)


def test_tampered_signatures_never_count(store: Store, layers: tuple[str, str, str], key: PrivateKey) -> None:
    strict = TrustPolicy(True, frozenset({key.public_key()}))
    m1 = build_manifest(store, base=layers[0])
    m2 = build_manifest(store, base=layers[1])
    create_environment(store, m1, "env:one", key=key)
    create_environment(store, m2, "env:two")
    # copy m1's valid signature to m2's slot: it is a signature of another manifest
    sig1 = store.get_tag(signature_tag(m1.digest(), key.public_key()))
    store.set_tag(signature_tag(m2.digest(), key.public_key()), sig1)
    with pytest.raises(UntrustedManifest, match="1 invalid"):
        resolve_environment(store, "env:two", strict)
    # a forged signature object (right fields, wrong bytes)
    good = Signature.from_bytes(store.get_manifest(sig1))
    forged = Signature(m2.digest(), key.public_key(), good.signature)
    with pytest.raises(InvalidManifest, match="does not verify"):
        put_signature(store, forged)
    store.set_tag(signature_tag(m2.digest(), key.public_key()), store.put_manifest(forged.to_bytes()))
    with pytest.raises(UntrustedManifest, match="1 invalid"):
        resolve_environment(store, "env:two", strict)
    # an environment manifest where a signature should be
    store.set_tag(signature_tag(m2.digest(), key.public_key()), m1.digest())
    with pytest.raises(UntrustedManifest, match="1 invalid"):
        resolve_environment(store, "env:two", strict)
    # a corrupt tag value
    store.backend.replace(storekeys.tag_key(signature_tag(m2.digest(), key.public_key())), b"junk\n")
    with pytest.raises(UntrustedManifest, match="1 invalid"):
        resolve_environment(store, "env:two", strict)
    assert resolve_environment(store, "env:one", strict).signed_by == (key.public_key(),)


def test_put_signature_needs_the_manifest(store: Store, key: PrivateKey) -> None:
    with pytest.raises(NotFound, match="manifest b3:2+ is not in store"):
        put_signature(store, sign_manifest("b3:" + "2" * 64, key))


def test_references_for_gc(store: Store, layers: tuple[str, str, str], key: PrivateKey) -> None:
    from manifest.refs import references

    m = build_manifest(store, base=layers[0], toolkits=[layers[1]])
    create_environment(store, m, "gc:v1", key=key)
    r = references(store.get_manifest(m.digest()))
    assert r.kind == "environment" and r.blobs == {layers[0], layers[1]} and not r.manifests
    sig = store.get_tag(signature_tag(m.digest(), key.public_key()))
    r = references(store.get_manifest(sig))
    assert r.kind == "signature" and r.manifests == {m.digest()} and not r.blobs
    assert references(b'{"kind":"environment","schema_version":9}').kind == "unknown"
    assert references(b"\xff").kind == "unknown"


def test_load_policy_from_environment(tmp_path: Path, key: PrivateKey, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from manifest.files import POLICY_ENV, load_policy

    monkeypatch.delenv(POLICY_ENV, raising=False)
    assert load_policy() is None
    p = tmp_path / "policy.json"
    p.write_text(json.dumps({"require_signature": True, "trusted_keys": [str(key.public_key())]}))
    monkeypatch.setenv(POLICY_ENV, str(p))
    policy = load_policy()
    assert policy is not None and policy.trusted_keys == {key.public_key()}
    with pytest.raises(NotFound, match="trust policy .*: no such file"):
        load_policy(tmp_path / "nope.json")
