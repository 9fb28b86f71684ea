"""Tar streams as layer entries, read sequentially and never extracted to disk.

The parser is our own rather than `tarfile`'s: in stream mode `tarfile` treats a corrupt header
after the first member as the end of the archive, so a damaged layer would build "successfully"
with members missing. Here every header must check out, the archive must end with its
end-of-archive block, and the (decompressed) stream is read to its end so that gzip CRCs and
zstd frame ends are verified too.

Formats: ustar, v7, GNU (long names and links, old and pax sparse files) and pax (path, linkpath,
size, uid, gid, fractional mtime, `SCHILY.xattr.*`, `LIBARCHIVE.xattr.*`, `RHT.security.selinux`).
Compression, detected by magic (decompress.py): none, gzip, zstd, xz, bzip2.

What a hostile archive can make the reader hold is bounded (the constants below): a member's
name, its extended headers (their total size, at most one of each kind per member), the pax
records of one header, the global pax keys, sparse maps and the number of members. Paths are
interned in a `PathIndex`, so checking a member costs time and memory linear in its name's
length, however deep it is (keeping every prefix as a byte string would cost the square).

Normalisation: leading '/' are stripped (absolute members become relative), '.' and empty
components ('./' prefixes, '//') are dropped. Everything else that is odd is refused with a
`BadInput` naming the archive and the member; see docs/image-inputs.md for the list.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import unquote_to_bytes

from layerstore.errors import BadInput

from ..tree import NAME_MAX, Data, Entry, Hole, Kind
from .decompress import DECODE_ERRORS, READ_SIZE, Reader, open_decompressed

__all__ = ["OPAQUE_XATTR", "PathIndex", "Reader", "open_decompressed", "show", "tar_entries"]

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
MAX_FILE_SIZE = 1 << 40  # 1 TiB: anything larger in a layer is a corrupt size field
MAX_META_SIZE = 8 << 20  # one member's extended headers (pax, GNU long names) together
PATH_MAX = 4096  # a member name, link target or symlink target must be shorter (Linux's PATH_MAX)
MAX_PAX_RECORDS = 4096  # records in one pax header
MAX_GLOBAL_KEYS = 256  # pax global header keys in force at once
MAX_GLOBAL_SIZE = 1 << 20  # their keys and values together
MAX_GLOBAL_HEADERS = 4096  # pax global headers and volume labels in one archive
MAX_SPARSE_SEGMENTS = 1 << 18  # data segments of one sparse file
MAX_MEMBERS = 1 << 22  # members of one archive
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536

_XATTR_NAMESPACES = (b"user.", b"trusted.", b"security.", b"system.posix_acl_access", b"system.posix_acl_default")
_OVERLAY_XATTR = b"trusted.overlay."
OPAQUE_XATTR = b"trusted.overlay.opaque"

_TYPES = {
    b"0": Kind.REG, b"\0": Kind.REG, b"7": Kind.REG, b"2": Kind.SYMLINK, b"3": Kind.CHR, b"4": Kind.BLK,
    b"5": Kind.DIR, b"6": Kind.FIFO, b"D": Kind.DIR, b"S": Kind.REG,
}
_TYPE_NAMES = {Kind.REG: "regular file", Kind.DIR: "directory", Kind.SYMLINK: "symlink", Kind.CHR: "char device",
               Kind.BLK: "block device", Kind.FIFO: "fifo", Kind.SOCK: "socket"}
_MTIME_RE = re.compile(rb"(-?)(\d+)(?:\.(\d*))?")


def show(path: bytes) -> str:
    """A member name for messages: quoted, undecodable bytes escaped, long names cut."""
    text = path.decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= 200 else text[:200] + "...")


# -- low-level input --------------------------------------------------------------------------
class _Input:
    """The tar byte stream with its offset; every read failure becomes a `BadInput`."""

    def __init__(self, raw: Reader, name: str, codec: str) -> None:
        self.raw, self.name, self.codec, self.offset = raw, name, codec, 0

    def read(self, n: int) -> bytes:
        """Up to `n` bytes (fewer only at the end of the stream)."""
        out = b""
        while len(out) < n:
            try:
                more = self.raw.read(min(n - len(out), READ_SIZE))
            except DECODE_ERRORS as e:
                raise BadInput(f"{self.name}: corrupt {self.codec} stream at tar offset "
                               f"{self.offset + len(out)}: {e}") from None
            if not more:
                break
            out = more if not out else out + more
        self.offset += len(out)
        return out

    def exact(self, n: int, what: str) -> bytes:
        out = self.read(n)
        if len(out) != n:
            raise BadInput(f"{self.name}: {what}: truncated archive (stream ends at offset {self.offset})")
        return out

    def skip(self, n: int, what: str) -> None:
        while n > 0:
            step = min(n, READ_SIZE)
            self.exact(step, what)
            n -= step

    def drain(self) -> None:
        while self.read(READ_SIZE):
            pass


# -- headers ----------------------------------------------------------------------------------
def _num(field: bytes, what: str) -> int:
    """An octal or base-256 numeric header field."""
    if field and field[0] & 0x80:
        if field[0] == 0x80:
            return int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:
            return int.from_bytes(field, "big", signed=True)
        raise ValueError(f"bad base-256 {what} field")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.strip(b"01234567"):
        raise ValueError(f"bad {what} field {text[:20]!r}")
    return int(text, 8)


def _str(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


@dataclass
class _Header:
    name: bytes
    mode: int
    uid: int
    gid: int
    size: int
    mtime: int
    typeflag: bytes
    linkname: bytes
    devmajor: int
    devminor: int
    gnu: bool
    raw: bytes

    @classmethod
    def parse(cls, block: bytes) -> _Header:
        stored = _num(block[148:156], "checksum")
        unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
        signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b & 0x80)
        if stored not in (unsigned, signed):
            raise ValueError(f"bad header checksum (stored {stored}, computed {unsigned})")
        magic = block[257:265]
        gnu = magic == b"ustar  \0"
        name = _str(block[0:100])
        if magic[:6] == b"ustar\0" and block[345] != 0:
            name = _str(block[345:500]) + b"/" + name
        return cls(
            name=name, mode=_num(block[100:108], "mode"), uid=_num(block[108:116], "uid"),
            gid=_num(block[116:124], "gid"), size=_num(block[124:136], "size"),
            mtime=_num(block[136:148], "mtime"), typeflag=block[156:157], linkname=_str(block[157:257]),
            devmajor=_num(block[329:337], "devmajor") if block[329] else 0,
            devminor=_num(block[337:345], "devminor") if block[337] else 0,
            gnu=gnu, raw=block,
        )


def _parse_pax(data: bytes, what: str) -> list[tuple[str, bytes]]:
    records: list[tuple[str, bytes]] = []
    pos = 0
    while pos < len(data):
        if data.find(b"\0", pos) == pos and not data[pos:].strip(b"\0"):
            break  # NUL padding counted in the size by some writers
        if len(records) >= MAX_PAX_RECORDS:
            raise BadInput(f"{what}: more than {MAX_PAX_RECORDS} pax records in one header")
        sp = data.find(b" ", pos, pos + 24)
        if sp < 0 or not data[pos:sp].isdigit():
            raise BadInput(f"{what}: malformed pax record at byte {pos}")
        length = int(data[pos:sp])
        rec = data[pos:pos + length]
        if length <= sp - pos + 1 or len(rec) != length or not rec.endswith(b"\n"):
            raise BadInput(f"{what}: malformed pax record at byte {pos}")
        key, eq, value = rec[sp - pos + 1:-1].partition(b"=")
        if not eq or not key:
            raise BadInput(f"{what}: malformed pax record at byte {pos}")
        try:
            records.append((key.decode("utf-8"), value))
        except UnicodeDecodeError:
            raise BadInput(f"{what}: pax keyword is not UTF-8") from None
        pos += length
    return records


def _pax_int(value: bytes, key: str, lo: int, hi: int) -> int:
    if not value.isdigit() or not lo <= int(value) <= hi:
        raise ValueError(f"bad pax {key} {value[:30]!r}")
    return int(value)


def _pax_mtime(value: bytes) -> tuple[int, int]:
    m = _MTIME_RE.fullmatch(value)
    if not m:
        raise ValueError(f"bad pax mtime {value[:40]!r}")
    sec, nsec = int(m[2]), int((m[3] or b"0")[:9].ljust(9, b"0"))
    if m[1]:
        sec, nsec = (-sec - 1, 1_000_000_000 - nsec) if nsec else (-sec, 0)
    return sec, nsec


# -- the member stream ------------------------------------------------------------------------
class _MemberData:
    """A member's content, readable once and only while the parser is still at this member."""

    def __init__(self, src: _Input, label: str, stored: int, pad: int, segments: list[tuple[int, int]] | None,
                 size: int) -> None:
        self.src, self.label, self.remaining, self.pad = src, label, stored, pad
        self.segments, self.size = segments, size
        self.started = self.closed = False

    def __iter__(self) -> Iterator[bytes | Hole]:
        if self.started:
            raise BadInput(f"{self.label}: content read twice")
        if self.closed:
            raise BadInput(f"{self.label}: content read after the archive moved on")
        self.started = True
        return self._blocks()

    def _read(self, n: int) -> Iterator[bytes]:
        while n > 0:
            if self.closed:
                raise BadInput(f"{self.label}: content read after the archive moved on")
            step = min(n, READ_SIZE)
            buf = self.src.exact(step, f"{self.label}: content")
            self.remaining -= step
            n -= step
            yield buf

    def _blocks(self) -> Iterator[bytes | Hole]:
        if self.segments is None:
            yield from self._read(self.remaining)
            return
        pos = 0
        for off, length in self.segments:
            if off > pos:
                yield Hole(off - pos)
            yield from self._read(length)
            pos = off + length
        if self.size > pos:
            yield Hole(self.size - pos)

    def finish(self) -> None:
        self.closed = True
        self.src.skip(self.remaining + self.pad, f"{self.label}: content")
        self.remaining = self.pad = 0


class _Parser:
    def __init__(self, src: _Input, name: str) -> None:
        self.src, self.name = src, name
        self.paths = PathIndex()
        self.kinds: dict[int, Kind] = {}  # explicit entries by node; hard links carry their target's kind
        self.links: dict[bytes, bytes] = {}  # hard link -> the original it points at
        self.parents: set[int] = set()  # every ancestor of an entry (by node), used as a directory
        self.global_pax: dict[str, bytes] = {}
        self.global_size = 0  # bytes of keys and values in global_pax
        self.global_headers = self.members = 0
        self.last = "the start of the archive"

    def fail(self, what: str, why: str) -> BadInput:
        return BadInput(f"{self.name}: {what}: {why}")

    def entries(self) -> Iterator[tuple[Entry, Data | None]]:
        records: list[tuple[str, bytes]] = []
        longname = longlink = None
        data: _MemberData | None = None
        pending: set[bytes] = set()  # kinds of extended header seen for the coming member
        pending_size = 0
        while True:
            if data is not None:
                data.finish()
                data = None
            where = f"header at offset {self.src.offset} (after {self.last})"
            block = self.src.read(BLOCK)
            if not block:
                raise self.fail(where, "truncated archive: no end-of-archive block")
            if len(block) < BLOCK:
                raise self.fail(where, "truncated header")
            if block == ZERO_BLOCK:
                if records or longname is not None or longlink is not None:
                    raise self.fail(where, "extended header not followed by a member")
                self.src.drain()  # the second end block, record padding, and compression trailers
                return
            try:
                h = _Header.parse(block)
            except ValueError as e:
                raise self.fail(where, f"corrupt header: {e}") from None
            t = h.typeflag
            if t in (b"x", b"X", b"g", b"L", b"K"):
                if not 0 <= h.size <= MAX_META_SIZE:
                    raise self.fail(where, f"extended header of absurd size {h.size} "
                                           f"(the limit is {MAX_META_SIZE} bytes)")
                if t == b"g":
                    self._count_global(where)
                else:
                    kind = b"x" if t == b"X" else t
                    if kind in pending:
                        raise self.fail(where, f"repeated extended header ({t.decode()!r} twice before one member)")
                    pending.add(kind)
                    pending_size += h.size
                    if pending_size > MAX_META_SIZE:
                        raise self.fail(where, f"extended headers of one member over {MAX_META_SIZE} bytes")
                raw = self.src.exact(h.size, f"{where}: extended header")
                self.src.skip(-h.size % BLOCK, f"{where}: extended header")
                if t in (b"x", b"X"):
                    records += _parse_pax(raw, f"{self.name}: {where}")
                elif t == b"g":
                    self._set_global(_parse_pax(raw, f"{self.name}: {where}"), where)
                elif t == b"L":
                    longname = _str(raw)
                else:
                    longlink = _str(raw)
                continue
            if t == b"V":  # a volume label names the archive, not a member
                self._count_global(where)
                self.src.skip(h.size + (-h.size % BLOCK), f"{where}: volume label")
                records, longname, longlink = [], None, None
                pending, pending_size = set(), 0
                continue
            self.members += 1
            if self.members > MAX_MEMBERS:
                raise self.fail(where, f"more than {MAX_MEMBERS} members")
            entry, data = self._member(h, records, longname, longlink)
            records, longname, longlink = [], None, None
            pending, pending_size = set(), 0
            self.last = f"member {show(entry.path or b'.')}"
            yield entry, (data if entry.kind is Kind.REG and entry.hardlink is None else None)

    def _count_global(self, where: str) -> None:
        self.global_headers += 1
        if self.global_headers > MAX_GLOBAL_HEADERS:
            raise self.fail(where, f"more than {MAX_GLOBAL_HEADERS} global headers and volume labels")

    def _set_global(self, records: list[tuple[str, bytes]], where: str) -> None:
        """Apply a global header; the keys in force stay within MAX_GLOBAL_KEYS/MAX_GLOBAL_SIZE
        (each member copies them, so they must stay small)."""
        for key, value in records:
            if key in ("path", "linkpath", "size") or key.startswith("GNU.sparse."):
                continue
            old = self.global_pax.pop(key, None)
            if old is not None:
                self.global_size -= len(key) + len(old)
            if value:
                self.global_pax[key] = value
                self.global_size += len(key) + len(value)
        if len(self.global_pax) > MAX_GLOBAL_KEYS or self.global_size > MAX_GLOBAL_SIZE:
            raise self.fail(where, f"global pax keys over the limit ({len(self.global_pax)} keys, "
                                   f"{self.global_size} bytes; at most {MAX_GLOBAL_KEYS} keys and "
                                   f"{MAX_GLOBAL_SIZE} bytes)")

    # -- one member ---------------------------------------------------------------------------
    def _member(self, h: _Header, records: list[tuple[str, bytes]], longname: bytes | None,
                longlink: bytes | None) -> tuple[Entry, _MemberData | None]:
        pax = dict(self.global_pax)
        sparse_pairs: list[bytes] = []
        for key, value in records:
            if key in ("GNU.sparse.offset", "GNU.sparse.numbytes"):
                sparse_pairs.append(value)
            if value:
                pax[key] = value
            else:
                pax.pop(key, None)
        raw_path = pax.get("GNU.sparse.name") or pax.get("path") or longname or h.name
        label = f"member {show(raw_path)}"
        try:
            path = self._normalise(raw_path)
            plain = raw_path[2:] if raw_path.startswith(b"./") else raw_path
            if path != plain.rstrip(b"/"):
                label += f" (as {show(path or b'.')})"
            return self._build(h, pax, sparse_pairs, raw_path, path, longlink, label)
        except ValueError as e:
            raise self.fail(label, str(e)) from None

    def _build(self, h: _Header, pax: dict[str, bytes], sparse_pairs: list[bytes], raw_path: bytes, path: bytes,
               longlink: bytes | None, label: str) -> tuple[Entry, _MemberData | None]:
        t = h.typeflag
        size = _pax_int(pax["size"], "size", 0, MAX_FILE_SIZE) if "size" in pax else h.size
        if not 0 <= size <= MAX_FILE_SIZE:
            raise ValueError(f"absurd size {size}")
        if t not in _TYPES and t != b"1":
            raise ValueError(f"unknown member type {t!r}")
        if t in (b"0", b"\0", b"7") and raw_path.endswith(b"/"):
            if size:
                raise ValueError("a regular file whose name ends with '/'")
            t = b"5"

        mode = h.mode & 0o7777
        uid = _pax_int(pax["uid"], "uid", 0, 2**32 - 1) if "uid" in pax else h.uid
        gid = _pax_int(pax["gid"], "gid", 0, 2**32 - 1) if "gid" in pax else h.gid
        if not (0 <= uid < 2**32 and 0 <= gid < 2**32):
            raise ValueError(f"uid/gid out of range ({uid}/{gid})")
        mtime, mtime_nsec = _pax_mtime(pax["mtime"]) if "mtime" in pax else (h.mtime, 0)
        if mtime < 0:
            mtime, mtime_nsec = 0, 0  # before 1970: clamped, EROFS stores unsigned times
        xattrs = self._xattrs(pax)

        if t == b"1":
            if size:
                raise ValueError(f"hard link with {size} bytes of content")
            target = self._normalise(pax.get("linkpath") or longlink or h.linkname)
            target = self.links.get(target, target)
            node = self.paths.find(target)
            kind = None if node is None else self.kinds.get(node)
            if kind is None:
                raise ValueError(f"hard link to missing target {show(target)}")
            if kind is Kind.DIR:
                raise ValueError(f"hard link to directory {show(target)}")
            self._claim(path, kind)
            self.links[path] = target
            return Entry(path=path, kind=kind, hardlink=target), None

        kind = _TYPES[t]
        entry = Entry(path=path, kind=kind, mode=mode, uid=uid, gid=gid, mtime=mtime, mtime_nsec=mtime_nsec,
                      xattrs=xattrs)
        data: _MemberData | None = None
        if t == b"D":  # GNU dumpdir: the content lists the directory, it is not a file
            data = _MemberData(self.src, label, size, -size % BLOCK, None, 0)
        elif kind is Kind.REG:
            stored, segments, entry.size = self._layout(h, pax, sparse_pairs, size, label)
            data = _MemberData(self.src, label, stored, -size % BLOCK, segments, entry.size)
        elif size:
            raise ValueError(f"{_TYPE_NAMES[kind]} with {size} bytes of content")
        if kind is Kind.SYMLINK:
            target = pax.get("linkpath") or longlink or h.linkname
            if not target or b"\0" in target or len(target) >= PATH_MAX:
                raise ValueError(f"bad symlink target {show(target)}")
            entry.symlink = target
        elif kind in (Kind.CHR, Kind.BLK):
            major = _pax_int(pax["SCHILY.devmajor"], "devmajor", 0, 2**12 - 1) if "SCHILY.devmajor" in pax \
                else h.devmajor
            minor = _pax_int(pax["SCHILY.devminor"], "devminor", 0, 2**20 - 1) if "SCHILY.devminor" in pax \
                else h.devminor
            if not (0 <= major < 2**12 and 0 <= minor < 2**20):
                raise ValueError(f"device number {major}:{minor} out of range")
            entry.rdev = (major, minor)
        if path == b"" and kind is not Kind.DIR:
            raise ValueError(f"the root is a {_TYPE_NAMES[kind]}")
        self._claim(path, kind)
        return entry, data

    def _layout(self, h: _Header, pax: dict[str, bytes], pairs: list[bytes], size: int,
                label: str) -> tuple[int, list[tuple[int, int]] | None, int]:
        """(stored bytes, sparse segments or None, apparent size) of a regular file."""
        nums: list[int]
        if h.typeflag == b"S":
            nums, ext = [], h.raw[482]
            realsize = _num(h.raw[483:495], "realsize")
            self._gnu_sparse(h.raw[386:482], nums)
            while ext:
                if len(nums) > 2 * MAX_SPARSE_SEGMENTS:
                    raise ValueError(f"sparse map of more than {MAX_SPARSE_SEGMENTS} segments")
                block = self.src.exact(BLOCK, f"{label}: sparse header")
                self._gnu_sparse(block[:504], nums)
                ext = block[504]
            stored = size
        elif pax.get("GNU.sparse.major") == b"1":
            if pax.get("GNU.sparse.minor") != b"0":
                raise ValueError("unsupported pax sparse format version")
            realsize = _pax_int(pax.get("GNU.sparse.realsize", b""), "GNU.sparse.realsize", 0, MAX_FILE_SIZE)
            buf, used = b"", 0
            nums, count = [], None
            while count is None or len(nums) < 2 * count:
                if b"\n" not in buf:
                    if used >= MAX_META_SIZE or used >= size:
                        raise ValueError("bad sparse map")
                    buf += self.src.exact(BLOCK, f"{label}: sparse map")
                    used += BLOCK
                    continue
                line, buf = buf.split(b"\n", 1)
                if not line.isdigit():
                    raise ValueError("bad sparse map")
                if count is None:
                    count = int(line)
                    if count > MAX_SPARSE_SEGMENTS:
                        raise ValueError(f"sparse map of more than {MAX_SPARSE_SEGMENTS} segments")
                else:
                    nums.append(int(line))
            stored = size - used
        elif "GNU.sparse.map" in pax or pairs:
            realsize = _pax_int(pax.get("GNU.sparse.size", b""), "GNU.sparse.size", 0, MAX_FILE_SIZE)
            text = pax["GNU.sparse.map"].split(b",", 2 * MAX_SPARSE_SEGMENTS) if "GNU.sparse.map" in pax else pairs
            if len(text) > 2 * MAX_SPARSE_SEGMENTS:
                raise ValueError(f"sparse map of more than {MAX_SPARSE_SEGMENTS} segments")
            if any(not x.isdigit() for x in text) or len(text) % 2:
                raise ValueError("bad sparse map")
            nums, stored = [int(x) for x in text], size
        else:
            return size, None, size
        segments = [(off, n) for off, n in zip(nums[::2], nums[1::2], strict=True) if n]
        pos = 0
        for off, n in segments:
            if off < pos or off + n > realsize:
                raise ValueError("sparse map out of order or past the end of the file")
            pos = off + n
        if sum(n for _, n in segments) != stored or not 0 <= realsize <= MAX_FILE_SIZE:
            raise ValueError("sparse map does not match the stored size")
        return stored, segments, realsize

    @staticmethod
    def _gnu_sparse(area: bytes, nums: list[int]) -> None:
        for i in range(0, len(area) - 23, 24):
            if not area[i:i + 24].strip(b"\0"):
                continue
            nums += [_num(area[i:i + 12], "sparse offset"), _num(area[i + 12:i + 24], "sparse size")]

    def _xattrs(self, pax: dict[str, bytes]) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        for key, value in pax.items():
            if key.startswith("SCHILY.xattr."):
                name = key[len("SCHILY.xattr."):].encode()
            elif key.startswith("LIBARCHIVE.xattr."):
                name = unquote_to_bytes(key[len("LIBARCHIVE.xattr."):])
                try:
                    value = base64.b64decode(value + b"=" * (-len(value) % 4), validate=True)
                except binascii.Error:
                    raise ValueError(f"xattr {name!r}: bad base64 value") from None
            elif key == "RHT.security.selinux":
                name = b"security.selinux"
            else:
                continue
            if not name or b"\0" in name or len(name) > XATTR_NAME_MAX or not name.startswith(_XATTR_NAMESPACES):
                raise ValueError(f"bad xattr name {name[:80]!r}")
            if name.startswith(_OVERLAY_XATTR) and name != OPAQUE_XATTR:
                raise ValueError(f"overlayfs xattr {name!r} is not allowed in a layer")
            if len(value) > XATTR_SIZE_MAX:
                raise ValueError(f"xattr {name!r}: value of {len(value)} bytes is too large")
            out[name] = value
        return out

    # -- paths --------------------------------------------------------------------------------
    def _normalise(self, raw: bytes) -> bytes:
        if b"\0" in raw:
            raise ValueError("name contains NUL")
        if len(raw) >= PATH_MAX:
            raise ValueError(f"a name of {len(raw)} bytes (the limit is {PATH_MAX - 1})")
        comps = [c for c in raw.split(b"/") if c not in (b"", b".")]
        if b".." in comps:
            raise ValueError("'..' component")
        for c in comps:
            if len(c) > NAME_MAX:
                raise ValueError(f"a name is longer than {NAME_MAX} bytes")
        return b"/".join(comps)

    def _claim(self, path: bytes, kind: Kind) -> None:
        nodes = self.paths.prefixes(path)
        node = nodes[-1] if nodes else PathIndex.ROOT
        if node in self.kinds:
            raise ValueError("duplicate entry")
        if kind is not Kind.DIR and node in self.parents:
            raise ValueError(f"is a {_TYPE_NAMES[kind]} but an earlier member uses it as a directory")
        for i, anc in enumerate(nodes[:-1]):
            akind = self.kinds.get(anc)
            if akind is not None and akind is not Kind.DIR:
                why = "a symlink" if akind is Kind.SYMLINK else f"a {_TYPE_NAMES[akind]}"
                raise ValueError(f"would be written through {show(b'/'.join(path.split(b'/')[:i + 1]))}, "
                                 f"which is {why}")
        self.parents.update(nodes[:-1])
        self.kinds[node] = kind


class PathIndex:
    """Interned layer paths: one int per path, given to each prefix of a path as it is seen, so
    that facts about prefixes (used as a directory, whited out) can be kept by node at a cost
    linear in a path's length. Keeping every prefix as a byte string instead costs the square of
    the depth (a name of 2,000 one-letter components has 2,000 prefixes of 2,000 bytes on average)."""

    ROOT = 0  # the root directory, b""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, bytes], int] = {}

    def prefixes(self, path: bytes) -> list[int]:
        """The nodes of `path`'s prefixes, shortest first ([] for the root), made as needed."""
        out: list[int] = []
        node = self.ROOT
        for comp in path.split(b"/") if path else ():
            key = (node, comp)
            nxt = self._ids.get(key)
            if nxt is None:
                nxt = self._ids[key] = len(self._ids) + 1
            out.append(nxt)
            node = nxt
        return out

    def find(self, path: bytes) -> int | None:
        """The node of `path`, None when no path seen so far has it as a prefix."""
        node: int | None = self.ROOT
        for comp in path.split(b"/") if path else ():
            node = self._ids.get((node, comp))  # type: ignore[arg-type]
            if node is None:
                return None
        return node


def tar_entries(stream: BinaryIO | Reader, *, name: str) -> Iterator[tuple[Entry, Data | None]]:
    """The entries of a tar stream, in archive order, content read straight from the stream.

    Each file's data must be consumed (or dropped) before the next entry is requested; it is
    skipped when not consumed. Raises `BadInput` naming `name` and the member for anything
    refused. The stream is read to its end.
    """
    raw, codec = open_decompressed(stream, name=name)
    yield from _Parser(_Input(raw, name, codec), name).entries()
