"""EROFS on-disk structures (pure): superblock, inodes, xattrs, dirents.

Only what an uncompressed image with 4 KiB blocks needs. Field layouts follow the format
description in erofs-utils' `include/erofs_fs.h` and the kernel's `fs/erofs/erofs_fs.h`;
the encoders here are our own. Everything is little-endian.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from layerstore.errors import BadInput

BLOCK_BITS = 12
BLOCK_SIZE = 1 << BLOCK_BITS
SUPER_OFFSET = 1024
MAGIC = 0xE0F5E1E2
NAME_LEN = 255
ISLOT = 32  # nid granularity: an inode's position is meta_blkaddr * BLOCK_SIZE + nid * 32
NULL_ADDR = 0xFFFFFFFF  # a hole in a chunk-based file's block map

FEATURE_INCOMPAT_CHUNKED_FILE = 0x4
FEATURE_INCOMPAT_DEVICE_TABLE = 0x8  # extra devices (flatten.py's multi-device image)

# i_format: bit 0 version (compact/extended), bits 1-3 data layout
LAYOUT_FLAT_PLAIN = 0
LAYOUT_FLAT_INLINE = 2
LAYOUT_CHUNK_BASED = 4
VERSION_COMPACT = 0
VERSION_EXTENDED = 1
COMPACT_SIZE = 32
EXTENDED_SIZE = 64
INO_OFFSET = 20  # where i_ino sits, in both forms
CHUNK_BLKBITS_MASK = 0x1F
CHUNK_INDEXES = 0x20  # chunk format: 8-byte chunk indexes (device id, block) instead of block addresses

# dirent file types (the kernel's FT_* values)
FT_UNKNOWN, FT_REG, FT_DIR, FT_CHR, FT_BLK, FT_FIFO, FT_SOCK, FT_SYMLINK = range(8)
DIRENT_SIZE = 12

# xattr name indexes: the stored name is the part after the prefix
XATTR_PREFIXES: tuple[tuple[bytes, int, bool], ...] = (
    # (prefix, index, whole-name): the ACL names are stored with an empty suffix
    (b"system.posix_acl_access", 2, True),
    (b"system.posix_acl_default", 3, True),
    (b"user.", 1, False),
    (b"trusted.", 4, False),
    (b"security.", 6, False),
)
XATTR_IBODY_HEADER = 12
XATTR_ENTRY_HEADER = 4
# The on-disk structures (erofs_fs.h), shared by the writer and the image reader (read.py).
MAX_SHARED_PER_INODE = 128

SUPERBLOCK = struct.Struct("<IIIBBHQQIIII16s16sIH42x")
COMPACT_INODE = struct.Struct("<HHHHIIIIHHI")
EXTENDED_INODE = struct.Struct("<HHHHQIIIIQII16x")
DIRENT = struct.Struct("<QHBx")
XATTR_ENTRY = struct.Struct("<BBH")
CHUNK_INDEX = struct.Struct("<HHI")  # advise, device id, block address
_IBODY = struct.Struct("<IB7x")


assert SUPERBLOCK.size == 128 and COMPACT_INODE.size == 32 and EXTENDED_INODE.size == 64 and DIRENT.size == 12


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def blocks_of(n: int) -> int:
    return (n + BLOCK_SIZE - 1) >> BLOCK_BITS


def pack_superblock(*, root_nid: int, inos: int, build_time: int, build_time_nsec: int, blocks: int,
                    meta_blkaddr: int, xattr_blkaddr: int, uuid: bytes, feature_incompat: int) -> bytes:
    if not 0 <= root_nid < 1 << 16:
        raise BadInput(f"root nid {root_nid} does not fit the superblock")
    return SUPERBLOCK.pack(MAGIC, 0, 0, BLOCK_BITS, 0, root_nid, inos, build_time, build_time_nsec, blocks,
                       meta_blkaddr, xattr_blkaddr, uuid, b"", feature_incompat, 0)


def encode_dev(major: int, minor: int) -> int:
    """Linux `new_encode_dev`: the 32-bit device number the kernel decodes."""
    if not (0 <= major < 1 << 12 and 0 <= minor < 1 << 20):
        raise BadInput(f"device number {major}:{minor} out of range")
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


# -- xattrs ---------------------------------------------------------------------------------
def split_xattr_name(name: bytes) -> tuple[int, bytes]:
    """(name index, stored suffix) for a full xattr name; BadInput if EROFS cannot store it."""
    for prefix, index, whole in XATTR_PREFIXES:
        if whole:
            if name == prefix:
                return index, b""
        elif name.startswith(prefix) and len(name) > len(prefix):
            suffix = name[len(prefix):]
            if len(suffix) > NAME_LEN:
                raise BadInput(f"xattr name {name[:60]!r}... is too long")
            return index, suffix
    raise BadInput(f"xattr {name!r} has no EROFS name prefix (user., trusted., security., system.posix_acl_*)")


def xattr_entry(index: int, suffix: bytes, value: bytes) -> bytes:
    if len(value) > 0xFFFF:
        raise BadInput(f"xattr value of {len(value)} bytes is too large")
    raw = XATTR_ENTRY.pack(len(suffix), index, len(value)) + suffix + value
    return raw + b"\0" * (align(len(raw), 4) - len(raw))


def xattr_ibody(shared_ids: Sequence[int], inline: Sequence[bytes]) -> bytes:
    """The inode's xattr body: header, shared xattr ids, inline entries. Empty if no xattrs."""
    if not shared_ids and not inline:
        return b""
    out = bytearray(_IBODY.pack(0, len(shared_ids)))
    for sid in shared_ids:
        out += struct.pack("<I", sid)
    for e in inline:
        out += e
    return bytes(out)


def xattr_icount(ibody_len: int) -> int:
    if ibody_len == 0:
        return 0
    count = (ibody_len - XATTR_IBODY_HEADER) // 4 + 1
    if count > 0xFFFF:
        raise BadInput("too many inline xattr bytes for one inode")
    return count


# -- directories ----------------------------------------------------------------------------
def split_dirents(names: Sequence[bytes]) -> list[int]:
    """How many of the (sorted) names go into each directory block, in order."""
    counts: list[int] = []
    used = n = 0
    for name in names:
        need = DIRENT_SIZE + len(name)
        if n and used + need > BLOCK_SIZE:
            counts.append(n)
            used = n = 0
        used += need
        n += 1
    if n:
        counts.append(n)
    return counts


def dir_size(names: Sequence[bytes]) -> int:
    """The directory's i_size: full blocks then the used part of the last one."""
    counts = split_dirents(names)
    last = counts[-1]
    used = sum(DIRENT_SIZE + len(nm) for nm in names[len(names) - last:])
    return (len(counts) - 1) * BLOCK_SIZE + used


def pack_dir(entries: Sequence[tuple[bytes, int, int]]) -> bytes:
    """Directory data for sorted (name, nid, file type) triples. Every block but the last is
    zero-padded to the block size; names are not NUL-terminated."""
    out = bytearray()
    names = [e[0] for e in entries]
    i = 0
    for count in split_dirents(names):
        block = entries[i:i + count]
        i += count
        nameoff = DIRENT_SIZE * count
        heads = bytearray()
        tails = bytearray()
        for name, nid, ftype in block:
            heads += DIRENT.pack(nid, nameoff + len(tails), ftype)
            tails += name
        blk = heads + tails
        if i < len(entries):
            blk += b"\0" * (BLOCK_SIZE - len(blk))
        out += blk
    return bytes(out)
