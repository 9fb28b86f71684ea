"""ed25519 signatures over manifest digests, and the trust policy that decides what may run (pure).

A signature covers the manifest's digest (the blake3 of its canonical bytes, which the store
verifies on every read) under a domain prefix, so it can never be mistaken for a signature of
anything else:  ed25519_sign(key, b"layerstore-environment-manifest-v1\\x00" + b"b3:<hex>").

It is stored as a small detached object, itself canonical JSON:

    {"schema_version": 1, "kind": "signature", "manifest": "b3:...",
     "key": "ed25519:<base64 of the 32-byte public key>", "signature": "<base64 of 64 bytes>"}

A trust policy is a JSON file:  {"require_signature": true, "trusted_keys": ["ed25519:...", ...]}
(keys in base64 or 64 hex digits). With `require_signature`, a manifest passes only with at least
one valid signature by a trusted key; signatures by other keys and invalid ones never count.
Without it every manifest passes and the valid trusted signers are only reported.

Policies combine (`TrustPolicy.combine`, used to put a caller's policy on top of the node's):
the result accepts exactly the manifests that both accept, so a caller can tighten a node's
policy and never loosen it. A combined policy may need more than one signature (one by a key
each policy trusts); it has no file form.

`cryptography` is imported only when a key is used, so commands that never sign stay quick.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from layerstore import digest as digestmod
from layerstore.errors import BadDigest, ConfigError

from . import canonical
from .canonical import kind_of
from .errors import InvalidManifest, UntrustedManifest

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

KEY_PREFIX = "ed25519:"
DOMAIN = b"layerstore-environment-manifest-v1\x00"
SIG_SCHEMA_VERSION = 1
SIG_KIND = "signature"
SIG_FIELDS = ("key", "kind", "manifest", "schema_version", "signature")
POLICY_FIELDS = ("require_signature", "trusted_keys")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def signing_message(manifest: str) -> bytes:
    return DOMAIN + digestmod.parse(manifest).encode("ascii")


@dataclass(frozen=True)
class PublicKey:
    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != 32:
            raise ConfigError("an ed25519 public key is 32 bytes")

    @classmethod
    def parse(cls, text: Any, where: str = "public key") -> PublicKey:
        """`ed25519:` + base64 (44 characters) or 64 hex digits."""
        if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
            raise ConfigError(f"{where}: want 'ed25519:' + base64 or hex of 32 bytes, got {_short(text)}")
        body = text[len(KEY_PREFIX):]
        if _HEX64.fullmatch(body):
            return cls(bytes.fromhex(body))
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != 32:
            raise ConfigError(f"{where}: want 'ed25519:' + base64 or hex of 32 bytes, got {_short(text)}")
        return cls(raw)

    def __str__(self) -> str:
        return KEY_PREFIX + base64.b64encode(self.raw).decode("ascii")

    @property
    def hex(self) -> str:
        return self.raw.hex()

    def verify(self, message: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except (InvalidSignature, ValueError):
            return False
        return True


class PrivateKey:
    """An ed25519 signing key; stored as unencrypted PKCS#8 PEM (protect the file, mode 0600)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> PrivateKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, data: bytes, where: str = "key file") -> PrivateKey:
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise ConfigError(f"{where}: not an unencrypted PEM private key (make one with "
                              f"`layerctl env keygen`)") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{where}: not an ed25519 key")
        return cls(key)

    def to_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())

    def public_key(self) -> PublicKey:
        from cryptography.hazmat.primitives import serialization

        return PublicKey(self._key.public_key().public_bytes(serialization.Encoding.Raw,
                                                             serialization.PublicFormat.Raw))

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


@dataclass(frozen=True)
class Signature:
    manifest: str
    key: PublicKey
    signature: bytes

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SIG_SCHEMA_VERSION, "kind": SIG_KIND, "manifest": self.manifest,
                "key": str(self.key), "signature": base64.b64encode(self.signature).decode("ascii")}

    def to_bytes(self) -> bytes:
        return canonical.dumps(self.to_json())

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "signature") -> Signature:
        obj = canonical.loads(data, where)
        if not isinstance(obj, Mapping):
            raise InvalidManifest(f"{where}: want an object, got {kind_of(obj)}")
        if obj.get("schema_version") != SIG_SCHEMA_VERSION or isinstance(obj.get("schema_version"), bool):
            raise InvalidManifest(f"{where}: unknown schema version {_short(obj.get('schema_version'))}")
        if obj.get("kind") != SIG_KIND:
            raise InvalidManifest(f"{where}: not a signature (kind {_short(obj.get('kind'))})")
        missing = [f for f in SIG_FIELDS if f not in obj]
        extra = sorted(set(obj) - set(SIG_FIELDS))
        if missing or extra:
            raise InvalidManifest(f"{where}: " + (f"missing field {missing[0]!r}" if missing
                                                  else f"unknown field {extra[0]!r}"))
        try:
            manifest = digestmod.parse(obj["manifest"])
        except BadDigest:
            raise InvalidManifest(f"{where}: manifest: not a digest") from None
        try:
            key = PublicKey.parse(obj["key"], f"{where}: key")
        except ConfigError as e:
            raise InvalidManifest(str(e)) from None
        sig = obj["signature"]
        try:
            raw = base64.b64decode(sig, validate=True) if isinstance(sig, str) else b""
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != 64:
            raise InvalidManifest(f"{where}: signature: want base64 of 64 bytes")
        out = cls(manifest, key, raw)
        if out.to_bytes() != bytes(data):
            raise InvalidManifest(f"{where}: not in canonical form")
        return out

    def verify(self) -> bool:
        """Cryptographically valid for its manifest (says nothing about trust)."""
        return self.key.verify(signing_message(self.manifest), self.signature)


def sign_manifest(manifest: str, key: PrivateKey) -> Signature:
    return Signature(digestmod.parse(manifest), key.public_key(), key.sign(signing_message(manifest)))


KeySet = frozenset[PublicKey]


@dataclass(frozen=True)
class TrustPolicy:
    """What may run. `require_signature`: a valid signature by one of `trusted_keys` is needed;
    without it every manifest passes and `trusted_keys` are only reported (`signed_by`).

    `also_required` is set only by `combine`: further key sets, each of which must also have
    signed (with `require_signature` true). A policy read from a file never has it.
    """

    require_signature: bool
    trusted_keys: KeySet = frozenset()
    also_required: tuple[KeySet, ...] = ()

    @classmethod
    def from_json(cls, obj: Any, where: str = "trust policy") -> TrustPolicy:
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{where}: want an object, got {kind_of(obj)}")
        extra = sorted(str(k) for k in set(obj) - set(POLICY_FIELDS))
        if extra:
            raise ConfigError(f"{where}: unknown field {extra[0]!r} (fields: {', '.join(POLICY_FIELDS)})")
        if "require_signature" not in obj:
            raise ConfigError(f"{where}: missing field 'require_signature'")
        require = obj["require_signature"]
        if not isinstance(require, bool):
            raise ConfigError(f"{where}: require_signature: want true or false, got {kind_of(require)}")
        keys = obj.get("trusted_keys", [])
        if not isinstance(keys, list):
            raise ConfigError(f"{where}: trusted_keys: want a list of keys, got {kind_of(keys)}")
        trusted = frozenset(PublicKey.parse(k, f"{where}: trusted_keys[{i}]") for i, k in enumerate(keys))
        if require and not trusted:
            raise ConfigError(f"{where}: requires a signature but trusts no key (add trusted_keys)")
        return cls(require, trusted)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "trust policy") -> TrustPolicy:
        try:
            obj = canonical.loads(data, where)
        except InvalidManifest as e:
            raise ConfigError(str(e)) from None
        return cls.from_json(obj, where)

    def to_json(self) -> dict[str, Any]:
        """The file form; a combined policy adds `also_required` (which no file may hold)."""
        out: dict[str, Any] = {"require_signature": self.require_signature,
                               "trusted_keys": _key_list(self.trusted_keys)}
        if self.also_required:
            out["also_required"] = [_key_list(s) for s in self.also_required]
        return out

    @property
    def requirements(self) -> tuple[KeySet, ...]:
        """The key sets that must each have a valid signature (empty: nothing is required)."""
        if not self.require_signature:
            return ()
        return _minimal((self.trusted_keys, *self.also_required))

    def accepts(self, signers: Iterable[PublicKey]) -> bool:
        """Whether manifests validly signed by exactly `signers` pass."""
        have = frozenset(signers)
        return all(have & keys for keys in self.requirements)

    def combine(self, other: TrustPolicy | None) -> TrustPolicy:
        """The policy that accepts a manifest exactly when both `self` and `other` do.

        Signatures are required if either policy requires them; every key set either policy
        requires must have signed (one signature can meet several sets when its key is in each);
        the reported keys are both policies' keys. Commutative, associative and idempotent;
        `None` (no policy) changes nothing. The result is in a normal form, so combining a
        policy with itself gives the policy back.
        """
        if other is None:
            return self
        keys = self.trusted_keys | other.trusted_keys
        required = _minimal((*self.requirements, *other.requirements))
        if not required:
            return TrustPolicy(False, keys)
        also = () if required == (keys,) else required
        return TrustPolicy(True, keys, also)


    def at_least_as_strict_as(self, other: TrustPolicy | None) -> bool:
        """Whether every manifest this policy accepts, `other` accepts too."""
        return other is None or self.combine(other).requirements == self.requirements


def combine_policies(*policies: TrustPolicy | None) -> TrustPolicy | None:
    """All of `policies` at once (see `TrustPolicy.combine`); None when none is given."""
    out: TrustPolicy | None = None
    for p in policies:
        if p is not None:
            out = p if out is None else out.combine(p)
    return out


def _minimal(sets: Iterable[KeySet]) -> tuple[KeySet, ...]:
    """The sets that no smaller one implies (a signature by a key of S also meets any superset of
    S), without repeats, in a fixed order."""
    unique = set(sets)
    kept = {s for s in unique if not any(t < s for t in unique)}
    return tuple(sorted(kept, key=lambda s: sorted(k.raw for k in s)))


def _key_list(keys: KeySet) -> list[str]:
    return sorted(str(k) for k in keys)


def check_trust(manifest: str, signatures: Iterable[Signature], policy: TrustPolicy, *,
                unreadable: int = 0, what: str | None = None) -> tuple[PublicKey, ...]:
    """The trusted keys with a valid signature of `manifest`, or `UntrustedManifest` when the policy
    requires one and there is none (or, for a combined policy, when one of the key sets it
    requires has none). `unreadable` counts stored signatures that did not even parse; it only
    makes the error clearer."""
    what = what or f"manifest {manifest}"
    valid: list[PublicKey] = []
    invalid = unreadable
    for sig in signatures:
        if sig.manifest == manifest and sig.verify():
            valid.append(sig.key)
        else:
            invalid += 1
    trusted = tuple(sorted({k for k in valid if k in policy.trusted_keys}, key=lambda k: k.raw))
    if policy.require_signature and not trusted:
        if not valid and not invalid:
            raise UntrustedManifest(f"{what} is not signed, and the trust policy requires a signature")
        parts = []
        if valid:
            parts.append(f"{len(valid)} valid signature(s) by untrusted keys")
        if invalid:
            parts.append(f"{invalid} invalid signature(s)")
        raise UntrustedManifest(f"{what} has no valid signature by a trusted key ({', '.join(parts)})")
    unmet = [keys for keys in policy.requirements if not keys & set(valid)]
    if unmet:
        wanted = ", ".join(_key_list(unmet[0]))
        raise UntrustedManifest(f"{what} is not signed by a key every trust policy in force trusts "
                                f"(it needs a valid signature by one of: {_short(wanted, 200)})")
    return trusted


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = repr(value)
    except ValueError:
        return "a huge integer"
    return text if len(text) <= limit else text[: limit - 3] + "..."
