"""Keep a parent image's blocks for a file that changed (see docs/erofs-builder.md).

A changed file often keeps most of its blocks at the same offsets (an edit near the end, an
append). When a build has a parent, the writer stores the new version as one run as usual,
then `keep_blocks` compares it block by block with the parent's version of the same path. The
blocks that are equal stay where the parent has them; the others are moved down over the
kept ones, so that only they remain in the new run; the file becomes chunk-based, with the
largest chunk size whose chunks each map to contiguous blocks.

Both versions are read from the image being written: the parent's data area is copied into it
at the same offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import blake3

from . import format as fmt

BS = fmt.BLOCK_SIZE
WINDOW = 256  # blocks read at a time
MAX_CHUNK_BITS = 20  # 4 GiB chunks


@dataclass(frozen=True)
class Kept:
    chunkbits: int
    blockmap: list[int]  # the image block of each chunk
    end: int  # where the new run now ends (the image's write position)
    digest: bytes  # blake3 of the blocks left in the new run


def keep_blocks(f: BinaryIO, start: int, nblocks: int, old: Sequence[int], tail: bytes = b"") -> Kept | None:
    """For the `nblocks` blocks just written at `start` in `f`: keep every block equal to the
    parent's at the same index (`old`: image blocks, NULL_ADDR for holes). None if no block
    matches (`f` is then left at the end of the run). Otherwise the blocks not kept are moved
    down from `start`, followed by `tail` (the file's inline tail, which a chunk-based file
    stores in a block of its own), and `f` is left at the new end."""
    f.flush()
    same = _matching(f, start, nblocks, old)
    if not same:
        f.seek(start + nblocks * BS)
        return None
    cursor = start
    h = blake3.blake3()
    blocks: list[int] = []
    i = 0
    while i < nblocks:
        if i in same:
            blocks.append(same[i])
            i += 1
            continue
        j = i
        while j < nblocks and j not in same and j - i < WINDOW:
            j += 1
        f.seek(start + i * BS)
        data = f.read((j - i) * BS)
        if cursor != start + i * BS:
            f.seek(cursor)
            f.write(data)
        h.update(data)
        blocks.extend(range(cursor // BS, cursor // BS + j - i))
        cursor += (j - i) * BS
        i = j
    if tail:
        block = tail + bytes(-len(tail) % BS)
        f.seek(cursor)
        f.write(block)
        h.update(block)
        blocks.append(cursor // BS)
        cursor += BS
    f.seek(cursor)
    bits = chunk_bits(blocks)
    return Kept(chunkbits=bits, blockmap=blocks[::1 << bits], end=cursor, digest=h.digest())


def _matching(f: BinaryIO, start: int, nblocks: int, old: Sequence[int]) -> dict[int, int]:
    same: dict[int, int] = {}
    n = min(nblocks, len(old))
    for w in range(0, n, WINDOW):
        m = min(WINDOW, n - w)
        f.seek(start + w * BS)
        new = f.read(m * BS)
        i = w
        while i < w + m:
            if old[i] == fmt.NULL_ADDR:
                i += 1
                continue
            j = i + 1
            while j < w + m and old[j] == old[j - 1] + 1:
                j += 1
            f.seek(old[i] * BS)
            prev = f.read((j - i) * BS)
            for k in range(i, j):
                a, b = (k - w) * BS, (k - i) * BS
                if new[a:a + BS] == prev[b:b + BS]:
                    same[k] = old[k]
            i = j
    return same


def chunk_bits(blocks: Sequence[int]) -> int:
    """The largest chunk size (as blkbits) at which every chunk maps to contiguous blocks:
    every break in contiguity must fall on a chunk boundary."""
    bits = min(MAX_CHUNK_BITS, max(0, (len(blocks) - 1).bit_length()))
    for i in range(1, len(blocks)):
        if blocks[i] != blocks[i - 1] + 1:
            bits = min(bits, (i & -i).bit_length() - 1)
            if not bits:
                break
    return bits
