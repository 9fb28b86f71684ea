"""Fuzzing the parsers that read untrusted bytes: tar streams, OCI image layouts and docker save
archives, chunk objects, chunk maps and the manifest package's documents (manifests,
signatures, trust policies, prefetch traces). Shared by the suite (tests/test_fuzz_parsers.py,
a few hundred examples each) and `bench/fuzz.py` (100,000+ each).

Every target takes bytes and may only raise a `LayerstoreError`; anything else is a finding.
Inputs are random bytes or mutations (bit flips, overwrites with boundary values, truncation,
extension, insertion) of valid objects built through the public encoders, so a format change
behind those encoders does not break the fuzzer. Tar mutations may have their header checksums
recomputed, which gets them past the first check and into the parser proper.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from erofs_builder.sources.source_oci import image_layers
from erofs_builder.sources.source_tar import tar_entries
from layerstore import chunkobj
from layerstore import digest as digestmod
from layerstore.chunkmap import ChunkMap, ChunkRef, blob_id
from layerstore.errors import LayerstoreError
from manifest.config import RuntimeConfig
from manifest.schema import Layer, Manifest
from manifest.signing import PrivateKey, Signature, TrustPolicy, sign_manifest
from manifest.trace import parse_trace

from . import archive_factory as af

BOUNDARY = [b"\x00", b"\xff", b"\x80", b"7", b"0", b"/", b".", b"\n", b" ", b"=", b"9" * 12, b"7" * 11,
            b"\xff" * 8, b"\x80" + b"\x00" * 7 + b"\xff" * 4, b"../", b"x", b"{", b"[", b"\"", b"-1"]
OPS = ("flip", "set", "boundary", "truncate", "extend", "insert", "delete")


def mutate(data: bytes, ops: list[tuple[str, int, bytes]]) -> bytes:
    buf = bytearray(data)
    for op, pos, extra in ops:
        n = len(buf)
        at = pos % (n + 1)
        if op == "flip" and n:
            buf[pos % n] ^= 1 << (extra[0] % 8)
        elif op == "set" and n:
            buf[pos % n] = extra[0]
        elif op == "boundary":
            value = BOUNDARY[extra[0] % len(BOUNDARY)]
            buf[at:at + len(value)] = value
        elif op == "truncate":
            del buf[at:]
        elif op == "extend":
            buf += extra * (1 + extra[0] % 64)
        elif op == "insert":
            buf[at:at] = extra
        elif op == "delete":
            del buf[at:at + 1 + extra[0] % 600]
    return bytes(buf)


def fix_tar_checksums(data: bytes) -> bytes:
    """Recompute the checksum of every 512-byte block that carries a ustar magic."""
    buf = bytearray(data)
    for off in range(0, len(buf) - 511, 512):
        if buf[off + 257:off + 262] == b"ustar":
            buf[off + 148:off + 156] = b" " * 8
            buf[off + 148:off + 156] = f"{sum(buf[off:off + 512]):06o}".encode() + b"\0 "
    return bytes(buf)


def inputs(seeds: list[bytes], tar: bool = False) -> st.SearchStrategy[bytes]:
    """Random bytes, or a seed with 1-8 mutations (tar: checksums fixed half the time)."""
    op = st.tuples(st.sampled_from(OPS), st.integers(0, 1 << 32), st.binary(min_size=1, max_size=24))
    mutated = st.builds(mutate, st.sampled_from(seeds), st.lists(op, min_size=1, max_size=8))
    if tar:
        mutated = st.tuples(mutated, st.booleans()).map(lambda t: fix_tar_checksums(t[0]) if t[1] else t[0])
    return st.one_of(st.binary(max_size=2048), mutated, mutated, mutated)


# -- seeds (valid objects, built through the public encoders) ---------------------------------
def tar_seeds() -> list[bytes]:
    members = [("dir", ".", 0o755), ("dir", "etc", 0o755), ("file", "etc/hostname", b"sandbox\n"),
               ("symlink", "etc/link", "hostname"), ("link", "etc/hard", "etc/hostname"),
               ("xfile", "etc/x", (b"data" * 40, {"user.note": b"hi"})), ("file", af.LONG, b"long")]
    pax = af.layer_tar(members)
    gnu = af.layer_tar(members, fmt=tarfile.GNU_FORMAT)
    ustar = af.layer_tar(members[:5] + [("file", "p" * 140 + "/leaf", b"deep")], fmt=tarfile.USTAR_FORMAT)
    sparse = af.raw_tar(af.pax({"GNU.sparse.map": "0,4,10,4", "GNU.sparse.size": "20", "GNU.sparse.name": "sp"}),
                        af.member("x", b"abcdwxyz"),
                        af.pax({"SCHILY.devmajor": "1", "SCHILY.devminor": "3", "mtime": "12.5"}),
                        af.header("null", typeflag=b"3"), af.pax({"comment": "c"}, typeflag=b"g"),
                        af.member("././@LongLink", b"named\0", typeflag=b"L"), af.member("n", b"!"))
    return [pax, gnu, ustar, sparse, gzip.compress(pax, mtime=0), af.compress(gnu, "zstd")]


def chunk_seeds() -> list[tuple[str, bytes]]:
    return [chunkobj.encode(p) for p in (b"", b"x", b"abc" * 3000, bytes(range(256)) * 4)]


def chunk_map_seeds() -> list[tuple[str, bytes]]:
    refs = [ChunkRef(0, 4096, digestmod.of(b"a"), 1), ChunkRef(4096, 100, digestmod.of(b"b"), 0)]
    out = []
    for r in ([], refs[:1], refs):
        cm = ChunkMap.build(r)
        out.append((cm.blob, cm.encode()))
    return out


KEY = PrivateKey.generate()


def manifest_seeds() -> list[bytes]:
    b1, b2 = digestmod.of(b"base"), digestmod.of(b"tool")
    m = Manifest(layers=(Layer(b1, 10, "base"), Layer(b2, 5, "toolkit")),
                 config=RuntimeConfig(entrypoint=("/bin/sh", "-c"), cmd=("echo hi",), env=("A=b",), workdir="/src",
                                      user="1000:1000"),
                 prefetch={b1: (1, 0)}, annotations={"org.example/k": "v"})
    sig = sign_manifest(m.digest(), KEY)
    policy = TrustPolicy(True, frozenset({KEY.public_key()}))
    trace = json.dumps({"version": 1, "blobs": {b1: [0, 3, 1]}}).encode()
    return [m.to_bytes(), sig.to_bytes(), json.dumps(policy.to_json()).encode(), trace]


# -- targets ----------------------------------------------------------------------------------
def parse_tar(data: bytes) -> None:
    for _entry, content in tar_entries(io.BytesIO(data), name="fuzz.tar"):
        for _ in content or ():
            pass


def parse_chunk_object(data: bytes, expected: str) -> None:
    chunkobj.decode(data, expected)
    chunkobj.check(data, expected)


def parse_chunk_map(data: bytes, blob: str) -> None:
    ChunkMap.decode(data, blob).check()


def chunk_map_from_refs(refs: list[tuple[int, int, int]], size_delta: int) -> None:
    """A map built from arbitrary (offset, length, flags), named by its own id: decoding gets past
    the id check into the structure checks."""
    chunks = tuple(ChunkRef(o, n, digestmod.of(b"%d" % i), f) for i, (o, n, f) in enumerate(refs))
    size = max((c.offset + c.length for c in chunks), default=0) + size_delta
    if not 0 <= size < 1 << 64:
        return
    cm = ChunkMap(blob=blob_id(size, chunks), size=size, chunks=chunks)
    ChunkMap.decode(cm.encode(), cm.blob)


def parse_manifest_doc(data: bytes) -> None:
    """The manifest package's documents: one input through every reader."""
    for parse in (Manifest.from_bytes, Signature.from_bytes, TrustPolicy.from_bytes, parse_trace):
        with contextlib.suppress(LayerstoreError):
            parse(data)


@dataclass
class OciTarget:
    """OCI layouts and docker archives in a scratch directory, rewritten for each input: the
    input replaces one document (index.json, or the manifest or config re-addressed so the
    digests still match) or a layer blob, or is a whole docker save archive."""

    root: Path

    @classmethod
    def create(cls) -> OciTarget:
        return cls(Path(tempfile.mkdtemp(prefix="fuzz-oci-")))

    def seeds(self) -> list[bytes]:
        spec = af.ImageSpec([af.Layer(af.layer_tar([("dir", ".", 0o755), ("file", "ok", b"fine"),
                                                    ("file", ".wh.gone", b"")]), "gzip"),
                             af.Layer(af.layer_tar([("dir", "d", 0o755), ("file", "d/.wh..wh..opq", b"")]), "none")])
        layout = self.root / "seed-layout"
        af.write_oci_layout(layout, spec)
        index = json.loads((layout / "index.json").read_text())
        manifest = (layout / "blobs/sha256" / index["manifests"][0]["digest"].split(":")[1]).read_bytes()
        config = af.image_config_doc(spec)
        archive = af.write_docker_archive(self.root / "seed.tar", spec).read_bytes()
        self.files = {str(p.relative_to(layout)): p.read_bytes() for p in layout.rglob("*") if p.is_file()}
        return [b"I" + (layout / "index.json").read_bytes(), b"M" + manifest, b"C" + config,
                b"L" + spec.layers[1].blob, b"D" + archive]

    def __call__(self, data: bytes) -> None:
        kind, body = data[:1], data[1:]
        if kind == b"D":
            path = self.root / "archive.tar"
            path.write_bytes(body)
            self._consume(f"docker-archive:{path}")
            return
        layout = self.root / "layout"
        if layout.exists():
            shutil.rmtree(layout)
        for rel, content in self.files.items():  # the seed layout, from memory (no recompression)
            (layout / rel).parent.mkdir(parents=True, exist_ok=True)
            (layout / rel).write_bytes(content)
        blobs = layout / "blobs/sha256"
        index = json.loads((layout / "index.json").read_text())
        if kind == b"I":
            (layout / "index.json").write_bytes(body)
        elif kind in (b"M", b"C", b"L"):
            mdesc = index["manifests"][0]
            manifest = json.loads((blobs / mdesc["digest"].split(":")[1]).read_bytes())
            desc = manifest["config"] if kind == b"C" else manifest["layers"][-1] if kind == b"L" else None
            if desc is not None:
                desc["digest"], desc["size"] = self._put(blobs, body)
                mbytes = json.dumps(manifest).encode()
            else:
                mbytes = body
            mdesc["digest"], mdesc["size"] = self._put(blobs, mbytes)
            (layout / "index.json").write_text(json.dumps(index))
        else:
            return
        self._consume(f"oci:{layout}")

    @staticmethod
    def _put(blobs: Path, data: bytes) -> tuple[str, int]:
        import hashlib

        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest, len(data)

    @staticmethod
    def _consume(spec: str) -> None:
        for layer in image_layers(spec).layers:
            parse_tar_entries(layer.entries())


def parse_tar_entries(entries: object) -> None:
    for _entry, content in entries:  # type: ignore[attr-defined]
        for _ in content or ():
            pass


@dataclass
class Target:
    name: str
    strategy: st.SearchStrategy[object]
    run: Callable[[object], None]


def targets(oci: OciTarget) -> list[Target]:
    """The parsers, each with the inputs it is fed."""
    chunks = chunk_seeds()
    maps = chunk_map_seeds()
    u32 = st.integers(0, (1 << 32) - 1)
    refs = st.lists(st.tuples(st.integers(0, 1 << 40), u32, u32), max_size=6)
    return [
        Target("tar", inputs(tar_seeds(), tar=True), parse_tar),  # type: ignore[arg-type]
        Target("oci", inputs(oci.seeds()), oci),  # type: ignore[arg-type]
        Target("chunk_object", st.tuples(st.sampled_from([c[0] for c in chunks]), inputs([c[1] for c in chunks])),
               lambda t: parse_chunk_object(t[1], t[0])),  # type: ignore[index]
        Target("chunk_map", st.one_of(
            st.tuples(st.sampled_from([m[0] for m in maps]), inputs([m[1] for m in maps])).map(lambda t: ("bytes", t)),
            st.tuples(refs, st.integers(-5, 5)).map(lambda t: ("refs", t))),
            lambda t: parse_chunk_map(t[1][1], t[1][0]) if t[0] == "bytes"  # type: ignore[index]
            else chunk_map_from_refs(*t[1])),  # type: ignore[index]
        Target("manifest", inputs(manifest_seeds()), parse_manifest_doc),  # type: ignore[arg-type]
    ]


def run_one(target: Target, value: object) -> BaseException | None:
    """None when `value` parsed or was refused with a LayerstoreError; else the exception."""
    try:
        target.run(value)
    except LayerstoreError:
        return None
    except Exception as e:  # noqa: BLE001 - any other exception type is what the fuzzer looks for
        return e
    return None
