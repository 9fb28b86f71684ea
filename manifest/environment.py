"""Environments in a store: create, sign, list and resolve them (the I/O side of `manifest`).

A manifest is stored with `Store.put_manifest` (its id is the blake3 of its canonical bytes) and
named by a tag `name:tag`. Write order keeps every reader's view consistent: the manifest, then
its signature, then the tag; so a tag never points at a missing manifest and, once a tag appears,
a policy-checking reader already finds the signature.

Signatures are detached objects stored like manifests (`Store.put_manifest`) and found through a
reserved tag per (manifest, key):  sig/<manifest hex>:<public key hex>.  A key re-signing the same
manifest rewrites the same tag, so a manifest has at most one signature per key. Tag names `sig/...`
and `b3` (which would read as a digest) are reserved for this and refused for environments.

`resolve_environment` is what a runtime calls before it mounts anything: it resolves the reference,
reads the verified manifest, parses it, and applies the trust policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from layerstore import digest as digestmod
from layerstore import keys
from layerstore.errors import ConfigError, CorruptObject, LayerstoreError, NotFound

from .config import RuntimeConfig
from .errors import InvalidManifest
from .schema import BASE, MAX_MANIFEST_BYTES, TOOLKIT, WORKSPACE, Layer, Manifest, check_against_chunk_maps
from .signing import PrivateKey, PublicKey, Signature, TrustPolicy, check_trust, sign_manifest
from .trace import prefetch_from_trace

if TYPE_CHECKING:
    from layerstore.chunkmap import ChunkMap
    from layerstore.store import Store

SIG_TAG_NAME = "sig"
_RESERVED_NAMES = ("b3",)


@dataclass(frozen=True)
class Environment:
    """A resolved, parsed and (when a policy asked) trusted environment."""

    ref: str
    digest: str
    manifest: Manifest
    signed_by: tuple[PublicKey, ...] = ()

    @property
    def layers(self) -> tuple[Layer, ...]:
        """Bottom (base) first; overlayfs wants the reverse order in `lowerdir`."""
        return self.manifest.layers

    @property
    def config(self) -> RuntimeConfig:
        return self.manifest.config

    @property
    def prefetch(self) -> Mapping[str, tuple[int, ...]]:
        return self.manifest.prefetch


@dataclass(frozen=True)
class Created:
    manifest: str
    tag: str
    signed_by: PublicKey | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"manifest": self.manifest, "tag": self.tag}
        if self.signed_by is not None:
            out["signed_by"] = str(self.signed_by)
        return out


# -- references -------------------------------------------------------------------------------
def is_digest_ref(ref: str) -> bool:
    return ref.startswith(digestmod.PREFIX)


def check_environment_tag(ref: str) -> str:
    """A tag an environment may take: `name:tag`, and not one of the reserved names."""
    name, _tag = keys.parse_tag(ref)
    if name == SIG_TAG_NAME or name.startswith(SIG_TAG_NAME + "/") or name in _RESERVED_NAMES:
        raise ConfigError(f"tag name {name!r} is reserved (signatures use sig/..., digests b3:...)")
    return ref


def resolve_ref(store: Store, ref: str) -> str:
    """NAME:TAG or a manifest digest -> the manifest digest."""
    if is_digest_ref(ref):
        return digestmod.parse(ref)
    check_environment_tag(ref)
    return store.get_tag(ref)


def load_manifest(store: Store, digest: str) -> Manifest:
    """The parsed manifest `digest` (the store verifies the bytes against the digest)."""
    return Manifest.from_bytes(store.get_manifest(digest), f"manifest {digest}")


def list_environments(store: Store) -> dict[str, str]:
    """Environment tags -> manifest digests (signature tags left out)."""
    return {ref: m for ref, m in store.tags().items() if not ref.startswith(SIG_TAG_NAME + "/")}


# -- layers -------------------------------------------------------------------------------------
def layer_chunk_maps(store: Store, blobs: Iterable[str]) -> dict[str, ChunkMap]:
    out = {}
    for blob in blobs:
        digestmod.parse(blob)
        try:
            out[blob] = store.get_chunk_map(blob)
        except NotFound:
            raise NotFound(f"layer blob {blob} is not in store {store.url} (push it first)") from None
    return out


def check_layers(store: Store, manifest: Manifest) -> None:
    """Every layer is in the store with the manifest's size, every prefetch index in range."""
    maps = layer_chunk_maps(store, manifest.blobs)
    check_against_chunk_maps(manifest, {b: cm.size for b, cm in maps.items()},
                             {b: len(cm.chunks) for b, cm in maps.items()})


def build_manifest(store: Store, *, base: str, toolkits: Iterable[str] = (), workspace: str | None = None,
                   config: RuntimeConfig | None = None, trace: Mapping[str, list[int]] | None = None,
                   annotations: Mapping[str, str] | None = None) -> Manifest:
    """A manifest for these layers, with sizes from the store's chunk maps (every layer must be
    there) and prefetch hints from a trace (only the environment's own blobs are kept)."""
    roles = [(base, BASE), *((t, TOOLKIT) for t in toolkits)]
    if workspace is not None:
        roles.append((workspace, WORKSPACE))
    for blob, role in roles:
        try:
            digestmod.parse(blob)
        except LayerstoreError:
            raise ConfigError(f"--{role}: not a digest (want 'b3:' + 64 lowercase hex digits): {blob!r}") from None
    seen: dict[str, str] = {}
    for blob, role in roles:
        if blob in seen:
            raise InvalidManifest(f"blob {blob} is given twice (as {seen[blob]} and as {role})")
        seen[blob] = role
    store.protect("blobs", [b for b, _ in roles])  # held until the tag is set (docs/gc.md)
    maps = layer_chunk_maps(store, [b for b, _ in roles])
    layers = tuple(Layer(blob, maps[blob].size, role) for blob, role in roles)
    prefetch = prefetch_from_trace(trace, {b: len(cm.chunks) for b, cm in maps.items()}) if trace else {}
    manifest = Manifest(layers=layers, config=config or RuntimeConfig(), prefetch=prefetch,
                        annotations=dict(annotations or {}))
    check_against_chunk_maps(manifest, {b: cm.size for b, cm in maps.items()},
                             {b: len(cm.chunks) for b, cm in maps.items()})
    return manifest


def create_environment(store: Store, manifest: Manifest, tag: str, *, key: PrivateKey | None = None) -> Created:
    """Store `manifest`, its signature (with `key`), then point `tag` at it: in that order."""
    check_environment_tag(tag)
    data = manifest.to_bytes()
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidManifest(f"manifest: {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    digest = store.put_manifest(data)
    if digest != manifest.digest():  # the store and this package must agree on the id
        raise CorruptObject(f"store filed the manifest as {digest}, expected {manifest.digest()}")
    signer = None
    if key is not None:
        signer = put_signature(store, sign_manifest(digest, key))
    store.set_tag(tag, digest)
    return Created(digest, tag, signer)


# -- signatures ---------------------------------------------------------------------------------
def signature_tag(manifest: str, key: PublicKey) -> str:
    return f"{SIG_TAG_NAME}/{digestmod.hex_of(manifest)}:{key.hex}"


def put_signature(store: Store, sig: Signature) -> PublicKey:
    """Store a signature and its tag. Refuses one that does not verify."""
    if not sig.verify():
        raise InvalidManifest(f"signature by {sig.key} does not verify for manifest {sig.manifest}")
    # The manifest must be present: a signature of nothing would only be garbage.
    store.get_manifest(sig.manifest)
    obj = store.put_manifest(sig.to_bytes())
    store.set_tag(signature_tag(sig.manifest, sig.key), obj)
    return sig.key


def signatures(store: Store, manifest: str) -> tuple[list[Signature], int]:
    """The stored signatures of `manifest`, and how many stored ones are unreadable or belong
    elsewhere (tampered or corrupt; they never count)."""
    prefix = keys.tag_key(f"{SIG_TAG_NAME}/{digestmod.hex_of(manifest)}:x")[:-1]
    found: list[Signature] = []
    unreadable = 0
    for key in store.backend.list(prefix):
        ref = keys.tag_of_key(key)
        try:
            obj = store.get_tag(ref)
        except NotFound:
            continue  # deleted between list and load
        except LayerstoreError:
            unreadable += 1
            continue
        try:
            sig = Signature.from_bytes(store.get_manifest(obj), f"signature {obj}")
        except (InvalidManifest, CorruptObject, NotFound):
            unreadable += 1
            continue
        if sig.manifest != manifest or signature_tag(manifest, sig.key) != ref:
            unreadable += 1
            continue
        found.append(sig)
    return found, unreadable


def verified_signers(store: Store, manifest: str) -> tuple[PublicKey, ...]:
    """Keys with a cryptographically valid signature of `manifest` (trusted or not)."""
    sigs, _ = signatures(store, manifest)
    return tuple(sorted({s.key for s in sigs if s.verify()}, key=lambda k: k.raw))


# -- what a runtime calls ----------------------------------------------------------------------
def resolve_environment(store: Store, ref: str, policy: TrustPolicy | None = None, *,
                        check_layer_blobs: bool = False) -> Environment:
    """Resolve `ref` (NAME:TAG or b3:...) to a parsed environment, refusing it with
    `UntrustedManifest` when `policy` requires a signature it lacks. Call this before mounting
    anything. With `check_layer_blobs`, every layer must also be in the store with its size."""
    digest = resolve_ref(store, ref)
    manifest = load_manifest(store, digest)
    signed_by: tuple[PublicKey, ...] = ()
    if policy is not None:
        sigs, unreadable = signatures(store, digest)
        what = f"environment {ref}" + ("" if is_digest_ref(ref) else f" ({digest})")
        signed_by = check_trust(digest, sigs, policy, unreadable=unreadable, what=what)
    if check_layer_blobs:
        check_layers(store, manifest)
    return Environment(ref=ref, digest=digest, manifest=manifest, signed_by=signed_by)

