"""OCI image layouts and `docker save` archives as lists of layers plus a runtime config.

`oci:PATH[:REF]` is an OCI image layout directory (oci-layout, index.json, blobs/<alg>/<hex>);
REF is a tag (the `org.opencontainers.image.ref.name` annotation in index.json) or a manifest
digest, and may be left out when the layout holds one image. An image index (multi-platform)
resolves to this machine's platform, or to its only image.

`docker-archive:PATH[:REF]` is the uncompressed tar that `docker save` writes (manifest.json,
the config, one tar per layer; old and OCI-style member names); REF picks one of its RepoTags.

Every blob is verified against its digest while it is streamed: manifests and configs by their
descriptor digest, layers by the descriptor digest (compressed) and the config's diff_id
(uncompressed). A layer that fails its digest fails the build, even when the mismatch is only
known at the layer's end: the builder publishes nothing until every entry is consumed.

OCI whiteouts become overlayfs ones (see `whiteouts`), so the layers can be stacked directly.

What a hostile image can make the reader hold is bounded: JSON documents by kind (index,
manifest, config; a descriptor's size is checked against the limit and the file before anything
is read), JSON nesting, the number of images in an index and of layers in an image, and the
members of a docker archive (with Python's tarfile never reading an extended header larger than
the tar reader allows).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from layerstore.errors import BadInput, LayerstoreError, NotFound

from ..tree import Data, Entry, Kind, check_path
from .image_config import runtime_config
from .source_tar import BLOCK, MAX_META_SIZE, OPAQUE_XATTR, PathIndex, Reader, open_decompressed, show, tar_entries

MAX_INDEX_JSON = 4 << 20  # index.json, image indexes, docker's manifest.json
MAX_MANIFEST_JSON = 4 << 20  # an image manifest (registries refuse larger ones too)
MAX_CONFIG_JSON = 8 << 20  # an image config (its history can be long)
MAX_INDEX_ENTRIES = 4096  # images listed in one index
MAX_LAYERS = 500  # layers of one image (overlayfs stacks at most 500)
MAX_ARCHIVE_MEMBERS = 1 << 16  # members of a docker save archive
MAX_ARCHIVE_HEADERS = 256 << 20  # bytes of tar headers Python's tarfile may read to list one
REF_ANNOTATION = "org.opencontainers.image.ref.name"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd", "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar", "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
)
_DIGEST = re.compile(r"(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})")
_WH = b".wh."
_WH_META = b".wh..wh."
_OPAQUE_MARKER = b".wh..wh..opq"


@dataclass
class OciLayer:
    """One layer of an image; `entries()` streams it (once per call) as overlayfs-ready entries."""

    name: str  # for messages
    digest: str | None  # of the stored (possibly compressed) blob
    diff_id: str | None  # of the uncompressed tar
    size: int  # stored size
    media_type: str
    opener: Callable[[], BinaryIO] = field(repr=False)

    def entries(self, progress: Callable[[int], None] | None = None) -> Iterator[tuple[Entry, Data | None]]:
        with self.opener() as f:
            outer = _Verified(f, self.digest, progress)
            raw, _codec = open_decompressed(outer, name=self.name)
            inner = _Verified(raw, self.diff_id)
            try:
                yield from whiteouts(tar_entries(inner, name=self.name), name=self.name)
            except BadInput as e:
                # A corrupt blob usually breaks the tar or the compression first; say what it is.
                try:
                    outer.drain()
                    self._check(outer, None)
                except BadInput as digest_error:
                    raise digest_error from e
                raise
            outer.drain()
            self._check(outer, inner)

    def _check(self, outer: _Verified, inner: _Verified | None) -> None:
        if self.digest and outer.hexdigest() != self.digest:
            raise BadInput(f"{self.name}: digest mismatch: content hashes to {outer.hexdigest()}, "
                           f"expected {self.digest}")
        if self.digest and outer.count != self.size:
            raise BadInput(f"{self.name}: size mismatch: {outer.count} bytes, descriptor says {self.size}")
        if inner is not None and self.diff_id and inner.hexdigest() != self.diff_id:
            raise BadInput(f"{self.name}: diff_id mismatch: uncompressed content hashes to "
                           f"{inner.hexdigest()}, config says {self.diff_id}")


@dataclass
class OciImage:
    source: str
    layers: list[OciLayer]  # base first
    config: dict[str, Any]  # the runtime config (image_config.runtime_config)
    image_config: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)


class _Verified:
    """A reader that hashes (and counts) what passes through it."""

    def __init__(self, raw: Reader, digest: str | None, progress: Callable[[int], None] | None = None) -> None:
        self.raw, self.progress, self.count = raw, progress, 0
        self.alg = digest.split(":", 1)[0] if digest else "sha256"
        self.hash = hashlib.new(self.alg)

    def read(self, n: int = -1, /) -> bytes:
        data = self.raw.read(n)
        self.hash.update(data)
        self.count += len(data)
        if self.progress and data:
            self.progress(len(data))
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def hexdigest(self) -> str:
        return f"{self.alg}:{self.hash.hexdigest()}"


# -- whiteouts --------------------------------------------------------------------------------
def whiteouts(entries: Iterator[tuple[Entry, Data | None]], *, name: str) -> Iterator[tuple[Entry, Data | None]]:
    """OCI whiteouts as overlayfs ones.

    `DIR/.wh.NAME` becomes a whiteout DIR/NAME (a char device 0:0, mode 0); `DIR/.wh..wh..opq`
    makes DIR opaque (xattr trusted.overlay.opaque=y); other `.wh..wh.*` names (AUFS metadata)
    are dropped. Directory entries are held back to the end of the layer, so that a directory's
    one explicit entry carries the opaque xattr whether the marker came before or after it.
    Overlayfs xattrs in the layer itself are refused: OCI layers say this with whiteout files.
    """
    dirs: dict[bytes, Entry] = {}
    opaque: set[bytes] = set()
    markers: set[bytes] = set()  # original paths of whiteout files: no hard link may point at one
    index = PathIndex()
    whited: set[int] = set()  # whiteout paths (nodes of `index`), which nothing else in the layer may use
    used: set[int] = set()  # every other path and its ancestors
    for entry, data in entries:
        label = f"{name}: member {show(entry.path or b'.')}"
        for key in entry.xattrs:
            if key.startswith(b"trusted.overlay."):
                raise BadInput(f"{label}: overlayfs xattr {key.decode(errors='replace')!r} in an OCI layer")
        base, parent = entry.name, entry.parent
        if base.startswith(_WH):
            if entry.kind is Kind.DIR:
                raise BadInput(f"{label}: a whiteout that is a directory")
            markers.add(entry.path)
            if base == _OPAQUE_MARKER:
                opaque.add(parent)
                continue
            if base.startswith(_WH_META):
                continue
            target = parent + b"/" + base[len(_WH):] if parent else base[len(_WH):]
            try:
                check_path(target)
            except BadInput:
                raise BadInput(f"{label}: bad whiteout name") from None
            node = index.prefixes(target)[-1]
            if node in used or node in whited:
                raise BadInput(f"{label}: whiteout of {show(target)}, which this layer also holds")
            whited.add(node)
            yield Entry(path=target, kind=Kind.CHR, mode=0, mtime=entry.mtime, mtime_nsec=entry.mtime_nsec,
                        rdev=(0, 0)), None
            continue
        if entry.hardlink is not None and entry.hardlink in markers:
            raise BadInput(f"{label}: hard link to whiteout file {show(entry.hardlink)}")
        _claim(entry.path, index, whited, used, label)
        if entry.kind is Kind.DIR:
            dirs[entry.path] = entry
            continue
        yield entry, data
    for path in sorted(opaque - dirs.keys()):
        _claim(path, index, whited, used, f"{name}: opaque marker in {show(path or b'.')}")
        dirs[path] = Entry(path=path, kind=Kind.DIR, mode=0o755)
    for path, entry in dirs.items():
        if path in opaque:
            entry.xattrs = {**entry.xattrs, OPAQUE_XATTR: b"y"}
        yield entry, None


def _claim(path: bytes, index: PathIndex, whited: set[int], used: set[int], label: str) -> None:
    """Mark `path` and its ancestors used; none of them may be whited out (linear in the path)."""
    nodes = index.prefixes(path)
    for i, node in enumerate(nodes):
        if node in whited:
            raise BadInput(f"{label}: {show(b'/'.join(path.split(b'/')[:i + 1]))} is whited out in this same layer")
    used.update(nodes)


# -- sources ----------------------------------------------------------------------------------
def image_layers(spec: str) -> OciImage:
    """The layers and runtime config of `oci:PATH[:REF]` or `docker-archive:PATH[:REF]`."""
    if spec.startswith("oci:"):
        path, ref = _split_ref(spec[len("oci:"):])
        return _OciLayout(path, spec).image(ref)
    if spec.startswith("docker-archive:"):
        path, ref = _split_ref(spec[len("docker-archive:"):])
        return _DockerArchive(path, spec).image(ref)
    raise BadInput(f"{spec}: not an oci: or docker-archive: source")


def _split_ref(rest: str) -> tuple[Path, str | None]:
    """PATH[:REF]; REF may hold ':' itself (a digest, a repo:tag), so PATH is the longest prefix
    ending before a ':' that exists."""
    if not rest:
        raise BadInput("missing path in image source")
    if os.path.exists(rest):
        return Path(rest), None
    cuts = [i for i, c in enumerate(rest) if c == ":" and os.path.exists(rest[:i])]
    if not cuts or not rest[cuts[-1] + 1:]:
        raise NotFound(f"{rest}: no such file or directory")
    return Path(rest[:cuts[-1]]), rest[cuts[-1] + 1:]


def _digest(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise BadInput(f"{what}: bad digest {str(value)[:100]!r}")
    return value


def _json(raw: bytes, what: str, digest: str | None = None) -> dict[str, Any]:
    if digest:
        alg, hexd = digest.split(":", 1)
        if hashlib.new(alg, raw).hexdigest() != hexd:
            raise BadInput(f"{what}: digest mismatch (expected {digest})")
    return _object(_loads(raw, what), what)


def _loads(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadInput(f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise BadInput(f"{what}: not JSON") from None


def _object(doc: Any, what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise BadInput(f"{what}: not a JSON object")
    return doc


def _size(desc: dict[str, Any], what: str, limit: int | None = None) -> int:
    """A descriptor's size: a non-negative integer, at most `limit` when given."""
    size = desc.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadInput(f"{what}: bad size {str(size)[:40]!r}")
    if limit is not None and size > limit:
        raise BadInput(f"{what}: descriptor size {size} is over the limit of {limit} bytes")
    return size


def _obj(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """A sub-object of a descriptor, {} when absent or not an object."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _host_platform() -> tuple[str, str]:
    machine = platform.machine().lower()
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}.get(machine, machine)
    return "linux", arch


def _layers_and_diff_ids(cfg: dict[str, Any], count: int, what: str) -> list[str]:
    if count > MAX_LAYERS:
        raise BadInput(f"{what}: {count} layers (at most {MAX_LAYERS})")
    rootfs = cfg.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != count:
        raise BadInput(f"{what}: config lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} "
                       f"diff_ids for {count} layers")
    return [_digest(d, f"{what}: rootfs.diff_ids") for d in diff_ids]


class _OciLayout:
    def __init__(self, root: Path, spec: str) -> None:
        self.root, self.spec = root, spec
        if not (root / "index.json").is_file():
            raise BadInput(f"{spec}: not an OCI image layout (no index.json in {root})")
        layout = _json(self._read(root / "oci-layout", "oci-layout"), f"{spec}: oci-layout") \
            if (root / "oci-layout").exists() else {}
        if layout and not str(layout.get("imageLayoutVersion", "")).startswith("1."):
            raise BadInput(f"{spec}: unsupported imageLayoutVersion {layout.get('imageLayoutVersion')!r}")

    def _read(self, path: Path, what: str, limit: int = MAX_INDEX_JSON, size: int | None = None) -> bytes:
        """A small file, at most `limit` bytes; with `size` (a descriptor's), exactly that many,
        checked against the file before it is read."""
        try:
            with open(path, "rb") as f:
                if size is not None and os.fstat(f.fileno()).st_size != size:
                    raise BadInput(f"{self.spec}: {what} is {os.fstat(f.fileno()).st_size} bytes, "
                                   f"its descriptor says {size}")
                raw = f.read(limit + 1)
        except FileNotFoundError:
            raise NotFound(f"{self.spec}: {what} is missing") from None
        except IsADirectoryError:
            raise BadInput(f"{self.spec}: {what} is a directory") from None
        except OSError as e:
            raise BadInput(f"{self.spec}: cannot read {what}: {e.strerror}") from None
        if len(raw) > limit:
            raise BadInput(f"{self.spec}: {what} is larger than {limit} bytes")
        return raw

    def _blob_path(self, digest: str) -> Path:
        alg, hexd = digest.split(":", 1)
        return self.root / "blobs" / alg / hexd

    def _blob_json(self, desc: dict[str, Any], what: str, limit: int) -> dict[str, Any]:
        digest = _digest(desc.get("digest"), f"{self.spec}: {what}")
        size = _size(desc, f"{self.spec}: {what} {digest}", limit)
        return _json(self._read(self._blob_path(digest), f"{what} {digest}", limit, size),
                     f"{self.spec}: {what} {digest}", digest)

    def image(self, ref: str | None) -> OciImage:
        index = _json(self._read(self.root / "index.json", "index.json"), f"{self.spec}: index.json")
        desc = self._select(index, ref)
        for _ in range(4):  # nested indexes (multi-platform), a few levels at most
            if desc.get("mediaType") not in INDEX_TYPES:
                break
            desc = self._platform(self._blob_json(desc, "image index", MAX_INDEX_JSON))
        if desc.get("mediaType") not in (*MANIFEST_TYPES, None):
            raise BadInput(f"{self.spec}: unsupported manifest media type {desc.get('mediaType')!r}")
        manifest = self._blob_json(desc, "manifest", MAX_MANIFEST_JSON)
        if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
            raise BadInput(f"{self.spec}: {desc.get('digest')} is an image index, not a manifest")
        cfg_desc, layer_descs = manifest.get("config"), manifest.get("layers")
        if not isinstance(cfg_desc, dict) or not isinstance(layer_descs, list):
            raise BadInput(f"{self.spec}: manifest {desc.get('digest')} has no config or layers")
        if len(layer_descs) > MAX_LAYERS:
            raise BadInput(f"{self.spec}: manifest {desc.get('digest')} lists {len(layer_descs)} layers "
                           f"(at most {MAX_LAYERS})")
        cfg = self._blob_json(cfg_desc, "image config", MAX_CONFIG_JSON)
        diff_ids = _layers_and_diff_ids(cfg, len(layer_descs), f"{self.spec}: image config")
        layers = []
        for i, (ld, diff_id) in enumerate(zip(layer_descs, diff_ids, strict=True)):
            if not isinstance(ld, dict):
                raise BadInput(f"{self.spec}: layer {i} descriptor is not an object")
            digest = _digest(ld.get("digest"), f"{self.spec}: layer {i}")
            media = ld.get("mediaType", "")
            if media not in LAYER_TYPES:
                raise BadInput(f"{self.spec}: layer {i} ({digest}): unsupported media type {media!r}")
            size = _size(ld, f"{self.spec}: layer {i} ({digest})")
            path = self._blob_path(digest)
            if not path.is_file():
                raise NotFound(f"{self.spec}: layer {i} blob {digest} is missing")
            if path.stat().st_size != size:
                raise BadInput(f"{self.spec}: layer {i} ({digest}): the blob is {path.stat().st_size} bytes, "
                               f"its descriptor says {size}")
            layers.append(OciLayer(name=f"{self.spec}: layer {i} ({digest[:19]})", digest=digest, diff_id=diff_id,
                                   size=size, media_type=media, opener=functools.partial(open, path, "rb")))
        return OciImage(self.spec, layers, runtime_config(cfg, f"{self.spec}: image config"), cfg)

    def _select(self, index: dict[str, Any], ref: str | None) -> dict[str, Any]:
        descs = index.get("manifests")
        if not isinstance(descs, list) or not all(isinstance(d, dict) for d in descs):
            raise BadInput(f"{self.spec}: index.json has no manifest list")
        if len(descs) > MAX_INDEX_ENTRIES:
            raise BadInput(f"{self.spec}: index.json lists {len(descs)} images (at most {MAX_INDEX_ENTRIES})")
        refs = sorted({str(_obj(d, "annotations").get(REF_ANNOTATION)) for d in descs
                       if _obj(d, "annotations").get(REF_ANNOTATION)})
        if ref is None:
            if len(descs) == 1:
                return descs[0]
            raise BadInput(f"{self.spec}: the layout holds {len(descs)} images; pick one with oci:PATH:REF "
                           f"(refs: {', '.join(refs) or 'none, use a digest'})")
        if _DIGEST.fullmatch(ref):
            found = [d for d in descs if d.get("digest") == ref]
        else:
            found = [d for d in descs if _obj(d, "annotations").get(REF_ANNOTATION) == ref]
        if not found:
            raise NotFound(f"{self.spec}: no image {ref!r} in index.json (refs: {', '.join(refs) or 'none'})")
        if len({d.get("digest") for d in found}) > 1:
            raise BadInput(f"{self.spec}: ref {ref!r} names several images")
        return found[0]

    def _platform(self, index: dict[str, Any]) -> dict[str, Any]:
        listed = index.get("manifests")
        if not isinstance(listed, list) or len(listed) > MAX_INDEX_ENTRIES:
            raise BadInput(f"{self.spec}: image index without a list of at most {MAX_INDEX_ENTRIES} manifests")
        descs = [d for d in listed if isinstance(d, dict)]
        os_name, arch = _host_platform()
        real = [d for d in descs if _obj(d, "platform").get("os") != "unknown"]  # skip attestations
        for d in real:
            p = _obj(d, "platform")
            if p.get("os") == os_name and p.get("architecture") == arch:
                return d
        if len(real) == 1:
            return real[0]
        raise BadInput(f"{self.spec}: image index has no manifest for {os_name}/{arch}")


class _Member:
    """A byte range of the archive file, read as a stream of its own."""

    def __init__(self, path: Path, offset: int, size: int) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        self.f.seek(offset)
        self.left = size

    def read(self, n: int = -1, /) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data

    def __enter__(self) -> _Member:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


class _HeaderReads:
    """The archive file as Python's tarfile lists it: member data is skipped by seeking, so every
    read is a header or an extended header's content; each is bounded like the tar reader's
    (tarfile itself would read a pax header of any size into memory), and so is their total."""

    def __init__(self, f: BinaryIO, spec: str) -> None:
        self.f, self.spec, self.total = f, spec, 0
        self.name = getattr(f, "name", spec)

    def read(self, n: int = -1, /) -> bytes:
        if n < 0 or n > MAX_META_SIZE + BLOCK:
            raise BadInput(f"{self.spec}: a tar header of more than {MAX_META_SIZE} bytes")
        self.total += n
        if self.total > MAX_ARCHIVE_HEADERS:
            raise BadInput(f"{self.spec}: more than {MAX_ARCHIVE_HEADERS} bytes of tar headers")
        return self.f.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()


# What Python's tarfile may raise on a hostile archive besides its own errors.
_TARFILE_ERRORS = (tarfile.TarError, OSError, EOFError, ValueError, OverflowError, RecursionError)


class _DockerArchive:
    def __init__(self, path: Path, spec: str) -> None:
        self.path, self.spec = path, spec
        self.members: dict[str, tarfile.TarInfo] = {}
        try:
            with open(path, "rb") as f:
                magic = f.read(6)
                if magic[:2] == b"\x1f\x8b" or magic[:4] == b"\x28\xb5\x2f\xfd" or magic[:3] == b"BZh" \
                        or magic == b"\xfd7zXZ\x00":
                    raise BadInput(f"{spec}: compressed archive; docker-archive needs the plain tar "
                                   "`docker save` writes (decompress it first)")
                f.seek(0)
                with tarfile.open(fileobj=_HeaderReads(f, spec), mode="r:") as tf:  # type: ignore[call-overload]
                    for info in tf:
                        self.members[os.path.normpath(info.name).lstrip("/")] = info
                        if len(tf.members) > MAX_ARCHIVE_MEMBERS:
                            raise BadInput(f"{spec}: more than {MAX_ARCHIVE_MEMBERS} members (not a docker "
                                           "save archive)")
        except IsADirectoryError:
            raise BadInput(f"{spec}: is a directory, not a docker save archive") from None
        except _TARFILE_ERRORS as e:
            if isinstance(e, LayerstoreError):
                raise
            raise BadInput(f"{spec}: not a readable tar archive: {str(e)[:200]}") from None

    def _info(self, name: str, what: str) -> tarfile.TarInfo:
        key = os.path.normpath(name).lstrip("/")
        for _ in range(8):  # `docker save` stores a repeated layer as a symlink to the first copy
            info = self.members.get(key)
            if info is None:
                raise NotFound(f"{self.spec}: {what} {name!r} is missing from the archive")
            if info.issym():
                key = os.path.normpath(os.path.join(os.path.dirname(key), info.linkname)).lstrip("/")
            elif info.islnk():
                key = os.path.normpath(info.linkname).lstrip("/")
            elif info.isreg():
                return info
            else:
                break
        raise BadInput(f"{self.spec}: {what} {name!r} is not a regular file")

    def _read_json(self, name: str, what: str, limit: int) -> bytes:
        info = self._info(name, what)
        if info.size > limit:
            raise BadInput(f"{self.spec}: {what} is larger than {limit} bytes")
        with _Member(self.path, info.offset_data, info.size) as m:
            return m.read()

    def image(self, ref: str | None) -> OciImage:
        if "manifest.json" not in self.members:
            raise BadInput(f"{self.spec}: no manifest.json in the archive (not a `docker save` archive)")
        doc = _loads(self._read_json("manifest.json", "manifest.json", MAX_INDEX_JSON), f"{self.spec}: manifest.json")
        if not isinstance(doc, list) or not doc or not all(isinstance(d, dict) for d in doc):
            raise BadInput(f"{self.spec}: manifest.json is not a list of images")
        if len(doc) > MAX_INDEX_ENTRIES:
            raise BadInput(f"{self.spec}: manifest.json lists {len(doc)} images (at most {MAX_INDEX_ENTRIES})")
        tags = sorted(t for d in doc for t in d.get("RepoTags") or [] if isinstance(t, str))
        if ref is None:
            if len(doc) != 1:
                raise BadInput(f"{self.spec}: the archive holds {len(doc)} images; pick one with "
                               f"docker-archive:PATH:REF (tags: {', '.join(tags) or 'none'})")
            entry = doc[0]
        else:
            found = [d for d in doc if ref in (d.get("RepoTags") or [])]
            if not found:
                raise NotFound(f"{self.spec}: no image tagged {ref!r} (tags: {', '.join(tags) or 'none'})")
            entry = found[0]
        cfg_name, layer_names = entry.get("Config"), entry.get("Layers")
        if not isinstance(cfg_name, str) or not isinstance(layer_names, list) \
                or not all(isinstance(n, str) for n in layer_names):
            raise BadInput(f"{self.spec}: manifest.json entry has no Config or Layers")
        if len(layer_names) > MAX_LAYERS:
            raise BadInput(f"{self.spec}: manifest.json lists {len(layer_names)} layers (at most {MAX_LAYERS})")
        cfg = _json(self._read_json(cfg_name, "image config", MAX_CONFIG_JSON), f"{self.spec}: image config",
                    _name_digest(cfg_name))
        diff_ids = _layers_and_diff_ids(cfg, len(layer_names), f"{self.spec}: image config")
        layers = []
        for i, (lname, diff_id) in enumerate(zip(layer_names, diff_ids, strict=True)):
            info = self._info(lname, f"layer {i}")
            off, size = info.offset_data, info.size
            layers.append(OciLayer(name=f"{self.spec}: layer {i} ({lname})", digest=_name_digest(lname),
                                   diff_id=diff_id, size=size, media_type="application/x-tar",
                                   opener=lambda o=off, s=size: _Member(self.path, o, s)))  # type: ignore[misc]
        return OciImage(self.spec, layers, runtime_config(cfg, f"{self.spec}: image config"), cfg)


def _name_digest(name: str) -> str | None:
    """The digest a member name states: `blobs/sha256/<hex>` or `<hex>.json`."""
    m = re.fullmatch(r"(?:\./)?blobs/(sha256|sha512)/([0-9a-f]{64,128})", name)
    if m:
        return f"{m[1]}:{m[2]}"
    m = re.fullmatch(r"(?:\./)?([0-9a-f]{64})\.json", name)
    return f"sha256:{m[1]}" if m else None
