"""Fixtures for the image-input tests: source trees, tar archives (Python's tarfile, GNU tar, and
hand-made headers for malformed cases), OCI image layouts, `docker save` archives, and a reference
applier that unpacks OCI layers with OCI semantics into a directory."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

MTIME = 1_700_000_000
LONG = "long-" + "n" * 120  # past ustar's 100-byte name field
DEEP = "/".join(["d" * 60] * 5)  # past ustar's 155-byte prefix
ODD_NAME = b"caf\xe9-latin1"  # not UTF-8


# -- source trees -----------------------------------------------------------------------------
def make_tree(root: Path, *, devices: bool = True, xattrs: bool = True, odd_names: bool = True,
              sparse: bool = True, long_names: bool = True) -> Path:
    """A tree with every kind of entry a layer holds, integer mtimes, varied owners and modes."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "etc").mkdir()
    (root / "etc/hostname").write_text("sandbox\n")
    (root / "etc/empty").write_bytes(b"")
    (root / "bin").mkdir(mode=0o755)
    (root / "bin/tool").write_bytes(b"\x7fELF" + bytes(range(256)) * 50)
    os.chmod(root / "bin/tool", 0o4755)
    (root / "bin/big").write_bytes(os.urandom(300_000) + b"tail")
    os.link(root / "bin/tool", root / "bin/tool-link")
    os.symlink("tool", root / "bin/sym")
    os.symlink("/etc/hostname", root / "abs-sym")
    os.symlink("missing/target", root / "dangling")
    (root / "tmp").mkdir()
    os.chmod(root / "tmp", 0o1777)
    (root / "home/user/.config").mkdir(parents=True)
    (root / "home/user/.config/settings").write_text("x=1\n")
    os.chown(root / "home/user/.config/settings", 1000, 1000)
    os.chown(root / "home/user/.config", 1000, 1000)
    os.chown(root / "home/user", 1000, 1000)
    if long_names:
        (root / LONG).write_text("long name\n")
        (root / DEEP).mkdir(parents=True)
        (root / DEEP / "leaf").write_text("deep\n")
    os.mkfifo(root / "fifo")
    if devices:
        os.mknod(root / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        os.mknod(root / "loop9", 0o660 | stat.S_IFBLK, os.makedev(7, 9))
    if odd_names:
        (root / os.fsdecode(ODD_NAME)).write_text("latin-1\n")
        (root / "sp ace & ünïcode").write_text("u\n")
    if xattrs:
        os.setxattr(root / "etc/hostname", "user.note", b"hello")
        os.setxattr(root / "bin/tool", "user.bin", b"\x00\xff\x01")
        os.setxattr(root / "etc", "user.dir", b"d")
    if sparse:
        with open(root / "sparse", "wb") as f:
            f.truncate(8 << 20)
            f.seek(3 << 20)
            f.write(b"island")
            f.seek((8 << 20) - 3)
            f.write(b"end")
    set_mtimes(root)
    return root


def set_mtimes(root: Path, mtime: int = MTIME) -> None:
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), (mtime, mtime), follow_symlinks=False)
    os.utime(root, (mtime, mtime))


# -- tar archives -----------------------------------------------------------------------------
def tar_with_tarfile(src: Path, fmt: int) -> bytes:
    """`src` as a tar written by Python's tarfile (sorted; xattrs as pax records in PAX format)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for path in [src, *sorted(src.rglob("*"))]:
            arc = "." if path == src else "./" + os.fsdecode(path.relative_to(src))
            info = tf.gettarinfo(str(path), arcname=arc)
            info.mtime = int(info.mtime)
            if fmt == tarfile.PAX_FORMAT and not path.is_symlink():
                for name in os.listxattr(path, follow_symlinks=False):
                    value = os.getxattr(path, name, follow_symlinks=False)
                    info.pax_headers["SCHILY.xattr." + name] = value.decode("utf-8", "surrogateescape")
            if info.isreg():
                with open(path, "rb") as f:
                    tf.addfile(info, f)
            else:
                tf.addfile(info)
    return buf.getvalue()


def tar_with_gnu_tar(src: Path, out: Path, fmt: str) -> Path:
    """`src` archived by GNU tar in `fmt` (gnu, oldgnu, posix, ustar, v7)."""
    extra = ["--xattrs", "--xattrs-include=*"] if fmt == "posix" else []
    if fmt not in ("ustar", "v7"):
        extra.append("--sparse")
    subprocess.run(["tar", f"--format={fmt}", "--numeric-owner", "--sort=name", *extra,
                    "-C", str(src), "-cf", str(out), "."], check=True, capture_output=True)
    return out


def compress(data: bytes, codec: str) -> bytes:
    if codec == "gzip":
        return gzip.compress(data, mtime=0)
    if codec == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    assert codec == "none"
    return data


# -- hand-made archives -----------------------------------------------------------------------
def _octal(n: int, width: int) -> bytes:
    return f"{n:0{width - 1}o}".encode() + b"\0"


def header(name: bytes | str, *, size: int = 0, typeflag: bytes = b"0", linkname: bytes | str = b"",
           mode: int = 0o644, uid: int = 0, gid: int = 0, mtime: int = MTIME, devmajor: int = 0,
           devminor: int = 0, size_field: bytes | None = None, checksum_delta: int = 0,
           magic: bytes = b"ustar\x0000") -> bytes:
    """One ustar header block; `size_field` overrides the encoded size (e.g. base-256 negatives)."""
    name = os.fsencode(name)
    linkname = os.fsencode(linkname)
    block = bytearray(512)
    block[0:len(name[:100])] = name[:100]
    block[100:108] = _octal(mode, 8)
    block[108:116] = _octal(uid, 8)
    block[116:124] = _octal(gid, 8)
    block[124:136] = size_field if size_field is not None else _octal(size, 12)
    block[136:148] = _octal(mtime, 12)
    block[156:157] = typeflag
    block[157:157 + len(linkname[:100])] = linkname[:100]
    block[257:265] = magic
    block[329:337] = _octal(devmajor, 8)
    block[337:345] = _octal(devminor, 8)
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block) + checksum_delta:06o}".encode() + b"\0 "
    return bytes(block)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def pax(records: dict[str, bytes | str], typeflag: bytes = b"x") -> bytes:
    """A pax extended header (with its data) applying to the next member."""
    body = b""
    for key, value in records.items():
        v = value.encode() if isinstance(value, str) else value
        rec = b" " + key.encode() + b"=" + v + b"\n"
        n = len(rec) + 1
        while len(str(n).encode()) + len(rec) != n:
            n += 1
        body += str(n).encode() + rec
    return header("PaxHeader", size=len(body), typeflag=typeflag) + pad(body)


def member(name: bytes | str, data: bytes = b"", **kw: object) -> bytes:
    """A regular file member (or any type via typeflag=...), header plus padded content."""
    return header(name, size=len(data), **kw) + pad(data)  # type: ignore[arg-type]


def end() -> bytes:
    return bytes(1024)


def raw_tar(*parts: bytes, eof: bool = True) -> bytes:
    return b"".join(parts) + (end() if eof else b"")


# -- OCI images -------------------------------------------------------------------------------
@dataclass
class Layer:
    """One layer: its uncompressed tar and how it is stored."""

    tar: bytes
    codec: str = "gzip"

    @property
    def blob(self) -> bytes:
        return compress(self.tar, self.codec)

    @property
    def media_type(self) -> str:
        suffix = {"gzip": "+gzip", "zstd": "+zstd", "none": ""}[self.codec]
        return "application/vnd.oci.image.layer.v1.tar" + suffix


@dataclass
class ImageSpec:
    layers: list[Layer]
    config: dict[str, object] = field(default_factory=lambda: {
        "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo hi"], "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
        "WorkingDir": "/home/user", "User": "1000:1000"})


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_config_doc(spec: ImageSpec, diff_ids: list[str | None] | None = None) -> bytes:
    """The image config; `diff_ids` overrides some diff_ids (None keeps the true one)."""
    ids = [_sha(layer.tar) for layer in spec.layers]
    for i, override in enumerate(diff_ids or []):
        ids[i] = override or ids[i]
    return json.dumps({
        "architecture": "amd64", "os": "linux", "config": spec.config,
        "rootfs": {"type": "layers", "diff_ids": ids},
    }, sort_keys=True).encode()


def write_oci_layout(root: Path, spec: ImageSpec, ref: str | None = "latest",
                     extra_refs: Iterable[str] = (), diff_ids: list[str | None] | None = None) -> dict[str, str]:
    """Write an OCI image layout; returns {"manifest": digest, "config": digest, "layers": ...}."""
    blobs = root / "blobs/sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        digest = _sha(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest

    config = image_config_doc(spec, diff_ids)
    layer_descs = []
    for layer in spec.layers:
        blob = layer.blob
        layer_descs.append({"mediaType": layer.media_type, "digest": put(blob), "size": len(blob)})
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(config),
                   "size": len(config)},
        "layers": layer_descs,
    }).encode()
    mdigest = put(manifest)
    descs = []
    for r in ([ref] if ref else []) + list(extra_refs):
        descs.append({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest,
                      "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": r}})
    if not descs:
        descs.append({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest,
                      "size": len(manifest)})
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": descs}))
    return {"manifest": mdigest, "config": _sha(config), "layers": ",".join(d["digest"] for d in layer_descs)}


def write_docker_archive(path: Path, spec: ImageSpec, tag: str = "example/image:latest") -> Path:
    """A `docker save` archive (legacy layout: <id>/layer.tar, <config-hex>.json, manifest.json).
    A layer repeated in the image is stored once and linked by a symlink, as Docker does."""
    config = image_config_doc(spec)
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    files: list[tuple[str, bytes | str]] = []
    names, seen = [], {}
    for i, layer in enumerate(spec.layers):
        ident = hashlib.sha256(f"layer-{i}".encode() + layer.tar).hexdigest()
        name = f"{ident}/layer.tar"
        if layer.tar in seen:
            files.append((name, "../" + seen[layer.tar]))
        else:
            seen[layer.tar] = name
            files.append((name, layer.tar))
        names.append(name)
    files.append((config_name, config))
    files.append(("manifest.json", json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": names}])
                  .encode()))
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        dirs: set[str] = set()
        for name, content in files:
            d = os.path.dirname(name)
            if d and d not in dirs:
                dirs.add(d)
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tf.addfile(info)
            else:
                info.size = len(content)
                tf.addfile(info, io.BytesIO(content))
    return path


# -- a layer tar from a list of member descriptions -------------------------------------------
def layer_tar(members: Iterable[tuple[str, str, object]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar of members given as (kind, name, value): ("dir", name, mode), ("file", name, bytes),
    ("symlink", name, target), ("link", name, target), ("xfile", name, (bytes, {xattr: value}))."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for kind, name, value in members:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid = MTIME, 0, 0
            data = None
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, int(value)  # type: ignore[call-overload]
            elif kind in ("file", "xfile"):
                content, xattrs = (value, {}) if kind == "file" else value  # type: ignore[misc]
                info.size, info.mode = len(content), 0o644
                for k, v in xattrs.items():
                    info.pax_headers["SCHILY.xattr." + k] = v.decode("utf-8", "surrogateescape")
                data = io.BytesIO(content)
            elif kind == "symlink":
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, str(value), 0o777
            elif kind == "link":
                info.type, info.linkname = tarfile.LNKTYPE, str(value)
            else:
                raise AssertionError(kind)
            tf.addfile(info, data)
    return buf.getvalue()


# -- reference: apply layers with OCI semantics -----------------------------------------------
def apply_layers(dest: Path, tars: Iterable[bytes]) -> Path:
    """Unpack OCI layer tars in order into `dest`: whiteouts delete what lower layers put there,
    an opaque marker empties its directory of lower content, later entries replace earlier ones.
    Written with tarfile, independently of the builder's reader."""
    dest.mkdir(parents=True, exist_ok=True)
    meta: dict[str, tarfile.TarInfo] = {}
    for data in tars:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            members = tf.getmembers()
            for m in members:  # whiteouts first: they only touch lower layers
                name = os.path.normpath(m.name)
                base, parent = os.path.basename(name), os.path.dirname(name)
                if base == ".wh..wh..opq":
                    target = dest / parent
                    for child in list(target.iterdir()) if target.is_dir() else []:
                        _remove(child)
                        _forget(meta, os.path.relpath(child, dest))
                elif base.startswith(".wh."):
                    victim = dest / parent / base[4:]
                    if victim.exists() or victim.is_symlink():
                        _remove(victim)
                        _forget(meta, os.path.relpath(victim, dest))
            for m in members:
                name = os.path.normpath(m.name)
                if os.path.basename(name).startswith(".wh."):
                    continue
                target = dest / name
                if name != "." and (target.exists() or target.is_symlink()) \
                        and not (m.isdir() and target.is_dir() and not target.is_symlink()):
                    _remove(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                if m.isdir():
                    target.mkdir(exist_ok=True)
                elif m.isreg():
                    with open(target, "wb") as f:
                        shutil.copyfileobj(tf.extractfile(m), f)  # type: ignore[misc]
                elif m.issym():
                    os.symlink(m.linkname, target)
                elif m.islnk():
                    os.link(dest / os.path.normpath(m.linkname), target)
                    continue
                elif m.ischr() or m.isblk():
                    kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
                    os.mknod(target, kind | 0o600, os.makedev(m.devmajor, m.devminor))
                elif m.isfifo():
                    os.mkfifo(target)
                if not m.issym():
                    for name_x in os.listxattr(target):
                        os.removexattr(target, name_x)
                    for k, v in m.pax_headers.items():
                        if k.startswith("SCHILY.xattr."):
                            os.setxattr(target, k[13:], v.encode("utf-8", "surrogateescape"))
                meta[name] = m
    for name in sorted(meta, key=lambda n: -n.count("/")):
        m, target = meta[name], dest / name
        os.chown(target, m.uid, m.gid, follow_symlinks=False)
        if not m.issym():
            os.chmod(target, m.mode)
        os.utime(target, (m.mtime, m.mtime), follow_symlinks=False)
    return dest


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def _forget(meta: dict[str, tarfile.TarInfo], name: str) -> None:
    for key in [k for k in meta if k == name or k.startswith(name + "/")]:
        del meta[key]


# -- hostile shapes ---------------------------------------------------------------------------
def deep_path(depth: int, prefix: str = "") -> str:
    """A path of `depth` one-letter components (the worst case for per-prefix work)."""
    return prefix + "/".join(["a"] * depth)


def deep_members(count: int, depth: int) -> bytes:
    """`count` files, each `depth` directories deep under its own top directory, with no
    directory entries: every member brings `depth` new implicit directories."""
    return raw_tar(*(pax({"path": deep_path(depth, f"t{i}/")}) + member(f"f{i}", b"") for i in range(count)))


def rewrite_oci_manifest(root: Path, edit: object) -> None:
    """Apply `edit(manifest_dict)` to an OCI layout's only image manifest and re-address it."""
    index = json.loads((root / "index.json").read_text())
    desc = index["manifests"][0]
    blobs = root / "blobs/sha256"
    manifest = json.loads((blobs / desc["digest"].split(":")[1]).read_bytes())
    edit(manifest)  # type: ignore[operator]
    data = json.dumps(manifest).encode()
    desc["digest"], desc["size"] = _sha(data), len(data)
    (blobs / desc["digest"].split(":")[1]).write_bytes(data)
    (root / "index.json").write_text(json.dumps(index))
