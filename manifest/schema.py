"""The environment manifest: schema, validation, canonical bytes and digest (pure).

    {"schema_version": 1,
     "kind": "environment",
     "layers": [{"blob": "b3:...", "size": 1234, "role": "base"},
                {"blob": "b3:...", "size": 567, "role": "toolkit"},
                {"blob": "b3:...", "size": 89, "role": "workspace"}],
     "config": {"entrypoint": [], "cmd": ["/bin/sh"], "env": ["PATH=/usr/bin:/bin"], "workdir": "/", "user": ""},
     "prefetch": {"b3:...": [0, 7, 3]},
     "annotations": {"org.example.task": "1234"}}

Layers are listed bottom first: exactly one base, then any number of toolkits, then at most one
workspace, which is the top. `prefetch` maps a layer's blob to chunk indexes in first-access
order. Every field is required (empty lists and objects included), so one environment has one
byte form (`canonical`), and its digest is the blake3 of those bytes, the id the store files it
under. A `Manifest` object is valid by construction: the constructor runs every rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from layerstore import digest as digestmod
from layerstore.errors import BadDigest

from . import canonical
from .canonical import kind_of
from .config import RuntimeConfig, check_utf8
from .errors import InvalidManifest

SCHEMA_VERSION = 1
KIND = "environment"
FIELDS = ("annotations", "config", "kind", "layers", "prefetch", "schema_version")
LAYER_FIELDS = ("blob", "role", "size")
BASE, TOOLKIT, WORKSPACE = "base", "toolkit", "workspace"
ROLES = (BASE, TOOLKIT, WORKSPACE)
# overlayfs stacks at most 500 lower layers (OVL_MAX_STACK).
MAX_LAYERS = 500
MAX_SIZE = (1 << 63) - 1
MAX_CHUNK_INDEX = (1 << 32) - 1  # chunk maps count entries in a u32
MAX_MANIFEST_BYTES = 16 << 20
MAX_ANNOTATION_KEY = 256
_ANNOTATION_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")


@dataclass(frozen=True)
class Layer:
    blob: str
    size: int
    role: str

    def to_json(self) -> dict[str, Any]:
        return {"blob": self.blob, "size": self.size, "role": self.role}


@dataclass(frozen=True, eq=True)
class Manifest:
    layers: tuple[Layer, ...]
    config: RuntimeConfig = field(default_factory=RuntimeConfig)
    prefetch: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    __hash__ = None  # type: ignore[assignment]  # holds dicts

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "layers", tuple(self.layers))
            object.__setattr__(self, "prefetch", {k: tuple(v) for k, v in dict(self.prefetch).items()})
            object.__setattr__(self, "annotations", dict(self.annotations))
        except (TypeError, ValueError):
            raise InvalidManifest("layers, prefetch or annotations have the wrong shape") from None
        check_manifest(self)

    # -- views ---------------------------------------------------------------------------
    @property
    def base(self) -> Layer:
        return self.layers[0]

    @property
    def toolkits(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.role == TOOLKIT)

    @property
    def workspace(self) -> Layer | None:
        return self.layers[-1] if self.layers[-1].role == WORKSPACE else None

    @property
    def blobs(self) -> tuple[str, ...]:
        """Layer blobs, bottom first."""
        return tuple(layer.blob for layer in self.layers)

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)

    # -- encodings -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "layers": [layer.to_json() for layer in self.layers],
            "config": self.config.to_json(),
            "prefetch": {blob: list(idx) for blob, idx in self.prefetch.items()},
            "annotations": dict(self.annotations),
        }

    def to_bytes(self) -> bytes:
        return canonical.dumps(self.to_json())

    def digest(self) -> str:
        """The manifest's id: what `Store.put_manifest(self.to_bytes())` returns."""
        return digestmod.of(self.to_bytes())

    @classmethod
    def from_json(cls, obj: Any, where: str = "manifest") -> Manifest:
        return parse_manifest(obj, where)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest", *, require_canonical: bool = True) -> Manifest:
        """Parse stored bytes. A stored manifest must be in canonical form: otherwise two byte
        forms (two digests) would name one environment."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise InvalidManifest(f"{where}: {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
        m = parse_manifest(canonical.loads(data, where), where)
        if require_canonical and m.to_bytes() != bytes(data):
            raise InvalidManifest(f"{where}: not in canonical form (sorted keys, no whitespace, UTF-8)")
        return m


def parse_manifest(obj: Any, where: str = "manifest") -> Manifest:
    """The JSON form (already decoded) to a `Manifest`, or one `InvalidManifest` that names the
    input (`where`) and then the field: "manifest b3:...: layers[1].size: want ..."."""
    try:
        return _parse_manifest(obj)
    except InvalidManifest as e:
        raise InvalidManifest(f"{where}: {e}") from None


def _parse_manifest(obj: Any) -> Manifest:
    if not isinstance(obj, Mapping):
        raise InvalidManifest(f"want an object, got {kind_of(obj)}")
    # The version comes first: a newer manifest may have fields this reader does not know.
    if "schema_version" not in obj:
        raise InvalidManifest("missing field 'schema_version'")
    version = obj["schema_version"]
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise InvalidManifest(f"unknown schema version {_short(version)} (this layerctl reads {SCHEMA_VERSION})")
    if obj.get("kind") != KIND:
        raise InvalidManifest(f"not an environment manifest (kind {_short(obj.get('kind'))}, want {KIND!r})")
    _check_fields(obj, FIELDS, "")
    return Manifest(layers=_parse_layers(obj["layers"], "layers"),
                    config=RuntimeConfig.from_json(obj["config"], "config"),
                    prefetch=_parse_prefetch(obj["prefetch"], "prefetch"),
                    annotations=_parse_annotations(obj["annotations"], "annotations"))


def check_manifest(m: Manifest) -> None:
    """Every cross-field rule; errors start with the field path ("layers[2]: ...")."""
    layers = m.layers
    if not layers:
        raise InvalidManifest("layers: empty (want exactly one base layer, first)")
    if len(layers) > MAX_LAYERS:
        raise InvalidManifest(f"layers: {len(layers)} layers, more than overlayfs stacks ({MAX_LAYERS})")
    seen: dict[str, int] = {}
    for i, layer in enumerate(layers):
        w = f"layers[{i}]"
        if not isinstance(layer, Layer):
            raise InvalidManifest(f"{w}: not a Layer")
        _check_digest(layer.blob, f"{w}.blob")
        if not isinstance(layer.size, int) or isinstance(layer.size, bool) or not 0 <= layer.size <= MAX_SIZE:
            raise InvalidManifest(f"{w}.size: want a non-negative integer, got {_short(layer.size)}")
        if layer.role not in ROLES:
            raise InvalidManifest(f"{w}.role: unknown role {layer.role!r} (want base, toolkit or workspace)")
        if layer.blob in seen:
            raise InvalidManifest(f"{w}: blob {layer.blob} is already layer {seen[layer.blob]}")
        seen[layer.blob] = i
        if i == 0:
            if layer.role != BASE:
                raise InvalidManifest(f"{w}: the first layer must be the base, got a {layer.role}")
        elif layer.role == BASE:
            raise InvalidManifest(f"{w}: a second base (exactly one base, first)")
        if layer.role == WORKSPACE and i != len(layers) - 1:
            raise InvalidManifest(f"{w}: the workspace must be the last (top) layer, "
                                  f"but layer {i + 1} is a {layers[i + 1].role}")
    if not isinstance(m.config, RuntimeConfig):
        raise InvalidManifest("config: not a RuntimeConfig")
    for blob, indexes in m.prefetch.items():
        w = f"prefetch[{blob!r}]"
        _check_digest(blob, w)
        if blob not in seen:
            raise InvalidManifest(f"{w}: blob is not a layer of this environment")
        if not indexes:
            raise InvalidManifest(f"{w}: empty list (leave the blob out instead)")
        dup: set[int] = set()
        for j, idx in enumerate(indexes):
            if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx <= MAX_CHUNK_INDEX:
                raise InvalidManifest(f"{w}[{j}]: want a chunk index (a non-negative integer), got {_short(idx)}")
            if idx in dup:
                raise InvalidManifest(f"{w}[{j}]: chunk {idx} is listed twice")
            dup.add(idx)
    for key, value in m.annotations.items():
        if not isinstance(key, str) or not _ANNOTATION_KEY.fullmatch(key) or len(key) > MAX_ANNOTATION_KEY:
            raise InvalidManifest(f"annotations: bad key {key!r} (want letters, digits and . _ / -, "
                                  f"at most {MAX_ANNOTATION_KEY})")
        if not isinstance(value, str):
            raise InvalidManifest(f"annotations[{key!r}]: want a string, got {kind_of(value)}")
        check_utf8(value, f"annotations[{key!r}]")


def check_against_chunk_maps(m: Manifest, sizes: Mapping[str, int], chunk_counts: Mapping[str, int]) -> None:
    """The rules that need the store: each layer's size is its chunk map's size and every
    prefetch index names a chunk of its blob. `sizes`/`chunk_counts` map blob -> value."""
    for i, layer in enumerate(m.layers):
        if layer.blob not in sizes:
            raise InvalidManifest(f"layers[{i}]: blob {layer.blob} has no chunk map")
        if sizes[layer.blob] != layer.size:
            raise InvalidManifest(f"layers[{i}]: size {layer.size} does not match the store's chunk map of "
                                  f"{layer.blob} ({sizes[layer.blob]} bytes)")
    for blob, indexes in m.prefetch.items():
        count = chunk_counts[blob]
        for j, idx in enumerate(indexes):
            if idx >= count:
                raise InvalidManifest(f"prefetch[{blob!r}][{j}]: chunk {idx} is out of range "
                                      f"(the blob has {count} chunks)")


def referenced_blobs(m: Manifest) -> frozenset[str]:
    """What an environment keeps alive in the store (for gc)."""
    return frozenset(m.blobs)


def _check_fields(obj: Mapping[str, Any], fields: tuple[str, ...], where: str) -> None:
    at = f"{where}: " if where else ""
    for name in fields:
        if name not in obj:
            raise InvalidManifest(f"{at}missing field {name!r}")
    extra = sorted(str(k) for k in set(obj) - set(fields))
    if extra:
        raise InvalidManifest(f"{at}unknown field {_short(extra[0])}")


def _check_digest(value: Any, where: str) -> None:
    try:
        digestmod.parse(value)
    except BadDigest:
        raise InvalidManifest(f"{where}: not a digest (want 'b3:' + 64 lowercase hex digits), "
                              f"got {_short(value)}") from None


def _parse_layers(value: Any, where: str) -> tuple[Layer, ...]:
    if not isinstance(value, list):
        raise InvalidManifest(f"{where}: want a list of layers, got {kind_of(value)}")
    out = []
    for i, item in enumerate(value):
        w = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidManifest(f"{w}: want an object, got {kind_of(item)}")
        _check_fields(item, LAYER_FIELDS, w)
        _check_digest(item["blob"], f"{w}.blob")
        if not isinstance(item["role"], str):
            raise InvalidManifest(f"{w}.role: want a string, got {kind_of(item['role'])}")
        size = item["size"]
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_SIZE:
            raise InvalidManifest(f"{w}.size: want a non-negative integer, got {_short(size)}")
        out.append(Layer(blob=item["blob"], size=size, role=item["role"]))
    return tuple(out)


def _parse_prefetch(value: Any, where: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, Mapping):
        raise InvalidManifest(f"{where}: want an object of blob -> chunk indexes, got {kind_of(value)}")
    out = {}
    for blob, indexes in value.items():
        w = f"{where}[{_short(blob)}]"
        _check_digest(blob, w)
        if not isinstance(indexes, list):
            raise InvalidManifest(f"{w}: want a list of chunk indexes, got {kind_of(indexes)}")
        for j, idx in enumerate(indexes):
            if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx <= MAX_CHUNK_INDEX:
                raise InvalidManifest(f"{w}[{j}]: want a chunk index (a non-negative integer), got {_short(idx)}")
        out[blob] = tuple(indexes)
    return out


def _parse_annotations(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise InvalidManifest(f"{where}: want an object of string -> string, got {kind_of(value)}")
    for key, v in value.items():
        if not isinstance(v, str):
            raise InvalidManifest(f"{where}[{_short(key)}]: want a string, got {kind_of(v)}")
    return dict(value)


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python prints
        return "a huge integer"
    return text if len(text) <= limit else text[: limit - 3] + "..."
