"""Pure units: keys, signature objects and the trust policy."""

from __future__ import annotations

import base64
import json

import pytest

from layerstore import digest as digestmod
from layerstore.errors import ConfigError, PermissionDenied
from manifest.errors import InvalidManifest, UntrustedManifest
from manifest.signing import (
    DOMAIN,
    PrivateKey,
    PublicKey,
    Signature,
    TrustPolicy,
    check_trust,
    sign_manifest,
    signing_message,
)

M = digestmod.of(b"manifest")
OTHER = digestmod.of(b"other manifest")


@pytest.fixture(scope="module")
def keys() -> tuple[PrivateKey, PrivateKey]:
    return PrivateKey.generate(), PrivateKey.generate()


def policy(*trusted: PrivateKey, require: bool = True) -> TrustPolicy:
    return TrustPolicy(require, frozenset(k.public_key() for k in trusted))


def test_public_key_text_forms(keys: tuple[PrivateKey, PrivateKey]) -> None:
    pub = keys[0].public_key()
    text = str(pub)
    assert text.startswith("ed25519:") and len(text) == len("ed25519:") + 44
    assert PublicKey.parse(text) == pub
    assert PublicKey.parse("ed25519:" + pub.hex) == pub
    assert PublicKey.parse("ed25519:" + pub.hex.upper()) == pub


@pytest.mark.parametrize("text", ["", "ed25519:", "rsa:AAAA", "ed25519:" + "0" * 63, "ed25519:!!!!",
                                  "ed25519:" + base64.b64encode(b"x" * 31).decode(), "ed25519:é", None, 5])
def test_bad_public_keys(text: object) -> None:
    with pytest.raises(ConfigError, match="want 'ed25519:' \\+ base64 or hex of 32 bytes"):
        PublicKey.parse(text)


def test_pem_round_trip(keys: tuple[PrivateKey, PrivateKey]) -> None:
    pem = keys[0].to_pem()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert PrivateKey.from_pem(pem).public_key() == keys[0].public_key()
    with pytest.raises(ConfigError, match="not an unencrypted PEM private key"):
        PrivateKey.from_pem(b"garbage")


def test_non_ed25519_pem_is_refused() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(ConfigError, match="not an ed25519 key"):
        PrivateKey.from_pem(pem)


def test_signature_covers_the_domain_and_digest(keys: tuple[PrivateKey, PrivateKey]) -> None:
    assert signing_message(M) == DOMAIN + M.encode()
    sig = sign_manifest(M, keys[0])
    assert sig.verify()
    assert not Signature(OTHER, sig.key, sig.signature).verify()
    assert not Signature(M, keys[1].public_key(), sig.signature).verify()
    flipped = bytes([sig.signature[0] ^ 1]) + sig.signature[1:]
    assert not Signature(M, sig.key, flipped).verify()
    # a bare signature of the digest (no domain) is not a manifest signature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    raw = Ed25519PrivateKey.generate()
    bare = Signature(M, PrivateKey(raw).public_key(), raw.sign(M.encode()))
    assert not bare.verify()


def test_signature_object_round_trip(keys: tuple[PrivateKey, PrivateKey]) -> None:
    sig = sign_manifest(M, keys[0])
    data = sig.to_bytes()
    assert Signature.from_bytes(data) == sig
    obj = json.loads(data)
    assert obj["kind"] == "signature" and obj["manifest"] == M and obj["key"] == str(keys[0].public_key())


@pytest.mark.parametrize("change, needle", [
    ({"schema_version": 2}, "unknown schema version 2"),
    ({"kind": "environment"}, "not a signature"),
    ({"manifest": "b3:12"}, "signature: manifest: not a digest"),
    ({"key": "ed25519:AAAA"}, "signature: key: want"),
    ({"signature": "AAAA"}, "signature: signature: want base64 of 64 bytes"),
    ({"signature": 7}, "want base64 of 64 bytes"),
    ({"extra": 1}, "unknown field 'extra'"),
])
def test_bad_signature_objects(keys: tuple[PrivateKey, PrivateKey], change: dict[str, object], needle: str) -> None:
    obj = sign_manifest(M, keys[0]).to_json()
    obj.update(change)
    with pytest.raises(InvalidManifest, match=needle.replace("(", r"\(")):
        Signature.from_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def test_signature_object_must_be_canonical(keys: tuple[PrivateKey, PrivateKey]) -> None:
    obj = sign_manifest(M, keys[0]).to_json()
    with pytest.raises(InvalidManifest, match="canonical"):
        Signature.from_bytes(json.dumps(obj, indent=1).encode())
    obj["key"] = "ed25519:" + keys[0].public_key().hex  # valid key, non-canonical spelling
    with pytest.raises(InvalidManifest, match="canonical"):
        Signature.from_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


# -- trust policy -------------------------------------------------------------------------------------
def test_policy_parsing(keys: tuple[PrivateKey, PrivateKey]) -> None:
    a, b = (k.public_key() for k in keys)
    doc = {"require_signature": True, "trusted_keys": [str(a), "ed25519:" + b.hex]}  # base64 and hex
    p = TrustPolicy.from_bytes(json.dumps(doc).encode())
    assert p.require_signature and p.trusted_keys == {a, b}
    assert TrustPolicy.from_json(p.to_json()) == p
    assert TrustPolicy.from_json({"require_signature": False}) == TrustPolicy(False)


@pytest.mark.parametrize("obj, needle", [
    ({}, "missing field 'require_signature'"),
    ({"require_signature": "yes"}, "require_signature: want true or false, got a string"),
    ({"require_signature": True}, "requires a signature but trusts no key"),
    ({"require_signature": True, "trusted_keys": []}, "trusts no key"),
    ({"require_signature": False, "trusted_keys": "ed25519:x"}, "trusted_keys: want a list"),
    ({"require_signature": False, "trusted_keys": ["nope"]}, "trusted_keys[0]: want 'ed25519:'"),
    ({"require_signature": False, "trust": []}, "unknown field 'trust'"),
    ([], "want an object, got a list"),
])
def test_bad_policies(obj: object, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        TrustPolicy.from_json(obj)
    assert needle in str(ei.value)


def test_bad_policy_bytes() -> None:
    with pytest.raises(ConfigError, match="not JSON"):
        TrustPolicy.from_bytes(b"{")


def test_trust_decisions(keys: tuple[PrivateKey, PrivateKey]) -> None:
    a, b = keys
    sa, sb = sign_manifest(M, a), sign_manifest(M, b)
    assert check_trust(M, [sa], policy(a)) == (a.public_key(),)
    assert check_trust(M, [sa, sb], policy(b)) == (b.public_key(),)
    assert set(check_trust(M, [sa, sb], policy(a, b))) == {a.public_key(), b.public_key()}
    # without require_signature nothing is refused, trusted signers are still reported
    assert check_trust(M, [], policy(a, require=False)) == ()
    assert check_trust(M, [sa], policy(a, require=False)) == (a.public_key(),)

    with pytest.raises(UntrustedManifest, match="is not signed, and the trust policy requires a signature"):
        check_trust(M, [], policy(a))
    with pytest.raises(UntrustedManifest, match=r"1 valid signature\(s\) by untrusted keys"):
        check_trust(M, [sb], policy(a))
    forged = Signature(M, a.public_key(), sb.signature)
    with pytest.raises(UntrustedManifest, match=r"no valid signature by a trusted key \(1 invalid"):
        check_trust(M, [forged], policy(a))
    with pytest.raises(UntrustedManifest, match="invalid"):
        check_trust(M, [sign_manifest(OTHER, a)], policy(a))  # a signature of another manifest
    with pytest.raises(UntrustedManifest, match=r"2 invalid"):
        check_trust(M, [], policy(a), unreadable=2)
    assert issubclass(UntrustedManifest, PermissionDenied)
