"""Pure units: digests, keys, chunk objects and chunk maps."""

from __future__ import annotations

import struct

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerstore import chunkmap, chunkobj, keys
from layerstore import digest as digestmod
from layerstore.chunkmap import METADATA, ChunkMap, ChunkRef, blob_id
from layerstore.errors import BadDigest, BadKey, ConfigError, CorruptObject

D1 = digestmod.of(b"one")
D2 = digestmod.of(b"two")


class TestDigest:
    def test_known_value(self) -> None:
        # blake3("") from the reference test vectors
        assert digestmod.of(b"") == "b3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"

    @pytest.mark.parametrize(
        "bad",
        ["", "b3:", "B3:" + "0" * 64, "b3:" + "0" * 63, "b3:" + "0" * 65, "b3:" + "A" * 64,
         "sha256:" + "0" * 64, "b3:" + "g" * 64, " b3:" + "0" * 64, "b3:" + "0" * 64 + "\n"],
    )
    def test_parse_rejects(self, bad: str) -> None:
        with pytest.raises(BadDigest, match="not a digest"):
            digestmod.parse(bad)

    def test_parse_rejects_non_strings(self) -> None:
        with pytest.raises(BadDigest):
            digestmod.parse(None)  # type: ignore[arg-type]

    def test_raw_round_trip(self) -> None:
        assert digestmod.from_raw(digestmod.raw_of(D1)) == D1

    def test_hasher_matches_one_shot(self) -> None:
        h = digestmod.Hasher()
        h.update(b"on")
        h.update(b"e")
        assert h.digest() == D1

    def test_big_buffers_hash_the_same_threaded(self) -> None:
        data = bytes(range(256)) * (40 << 12)  # 40 MiB: takes the threaded path
        h = digestmod.Hasher()
        h.update(data)
        assert digestmod.of(data) == h.digest()


class TestKeys:
    def test_object_key_fans_out(self) -> None:
        key = keys.object_key("chunks", D1)
        h = digestmod.hex_of(D1)
        assert key == f"chunks/{h[:2]}/{h[2:4]}/{h}"
        assert keys.digest_of_key(key) == ("chunks", D1)

    @pytest.mark.parametrize("bad", ["", "/a", "a/", "a//b", "..", "a/../b", ".tmp-x", "a/.hidden",
                                     "a b", "a\0b", "x" * 300, "é"])
    def test_validate_rejects(self, bad: str) -> None:
        with pytest.raises(BadKey):
            keys.validate(bad)

    def test_wrong_fanout_is_not_an_object_key(self) -> None:
        h = digestmod.hex_of(D1)
        with pytest.raises(BadKey):
            keys.digest_of_key(f"chunks/00/00/{h}" if not h.startswith("00") else f"chunks/11/11/{h}")

    @pytest.mark.parametrize("prefix", ["", "chunks/", "chunks/ab", "tags/", "c"])
    def test_prefixes(self, prefix: str) -> None:
        assert keys.validate_prefix(prefix) == prefix

    @pytest.mark.parametrize("prefix", ["/", "a//", "../", "a/../b", ".tmp", "a b"])
    def test_bad_prefixes(self, prefix: str) -> None:
        with pytest.raises(BadKey):
            keys.validate_prefix(prefix)

    @pytest.mark.parametrize("ref", ["python:3.11", "team/env:v1", "a:latest", "a.b-c_d:X_1.0"])
    def test_tags(self, ref: str) -> None:
        assert keys.tag_of_key(keys.tag_key(ref)) == ref

    @pytest.mark.parametrize("ref", ["python", ":v1", "Python:v1", "a:", "a:-x", "a/:v", "a:b/c", "../x:1"])
    def test_bad_tags(self, ref: str) -> None:
        with pytest.raises(ConfigError, match="not a tag reference"):
            keys.parse_tag(ref)


class TestChunkObject:
    @pytest.mark.parametrize("payload", [b"", b"x", b"abc" * 10000, bytes(range(256)) * 4096])
    def test_round_trip(self, payload: bytes) -> None:
        ident, obj = chunkobj.encode(payload)
        assert ident == digestmod.of(payload)
        assert chunkobj.decode(obj, ident) == payload

    def test_compressible_payload_is_compressed(self) -> None:
        _, obj = chunkobj.encode(b"a" * 100000)
        assert len(obj) < 1000 and obj[5] == chunkobj.COMP_ZSTD

    def test_incompressible_payload_is_raw(self) -> None:
        import os

        payload = os.urandom(5000)
        _, obj = chunkobj.encode(payload)
        assert obj[5] == chunkobj.COMP_NONE and len(obj) == chunkobj.HEADER_SIZE + 5000

    def test_wrong_id(self) -> None:
        _, obj = chunkobj.encode(b"one")
        with pytest.raises(CorruptObject, match="hashes to"):
            chunkobj.decode(obj, D2)

    @pytest.mark.parametrize(
        "mutate",
        [
            lambda o: o[:-1],
            lambda o: o + b"\0",
            lambda o: o[:8],
            lambda o: b"XXXX" + o[4:],
            lambda o: o[:4] + b"\x09" + o[5:],
            lambda o: o[:5] + b"\x07" + o[6:],
            lambda o: o[:6] + b"\x01\x00" + o[8:],
            lambda o: o[:8] + struct.pack("<Q", 1 << 40) + o[16:],
            lambda o: o[:8] + struct.pack("<Q", 12) + o[16:],
            lambda o: o[:20] + bytes([o[20] ^ 0xFF]) + o[21:],
        ],
    )
    def test_malformed_objects(self, mutate) -> None:  # noqa: ANN001
        payload = b"layerstore " * 200
        ident, obj = chunkobj.encode(payload)
        with pytest.raises(CorruptObject):
            chunkobj.decode(mutate(obj), ident)

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=200))
    def test_any_bytes_decode_to_payload_or_corrupt(self, junk: bytes) -> None:
        try:
            out = chunkobj.decode(junk, D1)
        except CorruptObject:
            return
        assert out == b"one"

    @settings(max_examples=100, deadline=None)
    @given(st.binary(max_size=4096), st.integers(min_value=0, max_value=4095), st.integers(0, 255))
    def test_any_single_byte_change_is_caught(self, payload: bytes, pos: int, xor: int) -> None:
        ident, obj = chunkobj.encode(payload)
        pos %= len(obj)
        bad = bytearray(obj)
        bad[pos] ^= xor
        if bytes(bad) == obj:
            return
        with pytest.raises(CorruptObject):
            chunkobj.decode(bytes(bad), ident)


class TestPutChunkObject:
    """`Store.put_chunk_object`: objects the caller encoded, checked cheaply before storing."""

    @pytest.fixture
    def store(self, tmp_path):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
        from layerstore.store import Store

        with Store.open(str(tmp_path / "store")) as s:
            s.init()
            yield s

    def test_stores_the_object_as_is_and_is_idempotent(self, store) -> None:  # noqa: ANN001
        payload = b"layerstore " * 5000
        ident, obj = chunkobj.encode(payload)
        first = store.put_chunk_object(ident, obj, len(payload))
        assert (first.chunks, first.new_chunks, first.new_bytes, first.stored_bytes) == (1, 1, len(payload), len(obj))
        assert store.backend.load(store.chunk_key(ident)) == obj
        assert store.get_chunk(ident) == payload
        again = store.put_chunk_object(ident, obj)
        assert (again.chunks, again.new_chunks, again.new_bytes) == (1, 0, 0)
        # and the payload route sees it as present, so nothing is compressed twice
        assert store.put_chunk(payload)[1].new_chunks == 0

    def test_raw_object(self, store) -> None:  # noqa: ANN001
        import os

        payload = os.urandom(3000)
        ident, obj = chunkobj.encode(payload)
        assert obj[5] == chunkobj.COMP_NONE
        assert store.put_chunk_object(ident, obj).new_chunks == 1
        assert store.get_chunk(ident) == payload

    @pytest.mark.parametrize(
        "mutate",
        [
            lambda o: o[:8],  # truncated header
            lambda o: b"XXXX" + o[4:],  # magic
            lambda o: o[:4] + b"\x09" + o[5:],  # version
            lambda o: o[:5] + b"\x07" + o[6:],  # compression id
            lambda o: o[:6] + b"\x01\x00" + o[8:],  # reserved bits
            lambda o: o[:8] + struct.pack("<Q", 1 << 40) + o[16:],  # absurd length
            lambda o: o[:8] + struct.pack("<Q", 12) + o[16:],  # length the frame does not declare
            lambda o: o[:16] + b"\0\0\0\0" + o[20:],  # not a zstd frame
        ],
    )
    def test_bad_object_is_refused_and_nothing_stored(self, store, mutate) -> None:  # noqa: ANN001
        payload = b"layerstore " * 2000
        ident, obj = chunkobj.encode(payload)
        with pytest.raises(CorruptObject):
            store.put_chunk_object(ident, mutate(obj))
        assert not store.has_chunk(ident)

    def test_length_mismatch_is_refused(self, store) -> None:  # noqa: ANN001
        payload = b"abc" * 5000
        ident, obj = chunkobj.encode(payload)
        with pytest.raises(CorruptObject, match="header says"):
            store.put_chunk_object(ident, obj, len(payload) - 1)
        assert not store.has_chunk(ident)

    def test_digest_mismatch_of_a_raw_object_is_refused(self, store) -> None:  # noqa: ANN001
        import os

        _, obj = chunkobj.encode(os.urandom(2000))
        with pytest.raises(CorruptObject, match="hashes to"):
            store.put_chunk_object(D1, obj)
        assert not store.has_chunk(D1)

    def test_digest_mismatch_of_a_zstd_object_is_refused_with_verify(self, store) -> None:  # noqa: ANN001
        _, obj = chunkobj.encode(b"other " * 1000)
        assert obj[5] == chunkobj.COMP_ZSTD
        with pytest.raises(CorruptObject, match="hashes to"):
            store.put_chunk_object(D1, obj, verify=True)
        assert not store.has_chunk(D1)

    def test_bad_digest_string_is_refused(self, store) -> None:  # noqa: ANN001
        ident, obj = chunkobj.encode(b"x")
        with pytest.raises(BadDigest):
            store.put_chunk_object(ident.upper(), obj)

    def test_put_chunk_objects_in_order(self, store) -> None:  # noqa: ANN001
        pairs = [chunkobj.encode(str(i).encode() * (i + 1)) for i in range(50)]
        stats = list(store.put_chunk_objects(pairs + pairs[:5]))
        assert [s.new_chunks for s in stats] == [1] * 50 + [0] * 5
        for ident, _obj in pairs:
            assert store.has_chunk(ident)

    def test_objects_made_in_threads_decode(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        payloads = [bytes([i]) * 70000 + bytes(range(256)) * i for i in range(40)]
        with ThreadPoolExecutor(4) as pool:
            objs = list(pool.map(chunkobj.pack, payloads))
        for p, o in zip(payloads, objs, strict=True):
            assert chunkobj.decode(o, digestmod.of(p)) == p
            assert chunkobj.check(o, digestmod.of(p), len(p)) == len(p)


def _map(lengths: list[int], flags: list[int] | None = None) -> ChunkMap:
    refs, off = [], 0
    for i, n in enumerate(lengths):
        refs.append(ChunkRef(off, n, digestmod.of(str(i).encode()), (flags or [0] * len(lengths))[i]))
        off += n
    return ChunkMap.build(refs)


class TestChunkMap:
    def test_round_trip(self) -> None:
        cm = _map([4096, 100, 1 << 20], [METADATA, 0, 0])
        back = ChunkMap.decode(cm.encode(), cm.blob)
        assert back == cm and back.metadata_chunks() == [cm.chunks[0]]

    def test_empty_blob(self) -> None:
        cm = ChunkMap.build([])
        assert ChunkMap.decode(cm.encode(), cm.blob).size == 0
        assert list(cm.span(0, 10)) == []

    def test_span(self) -> None:
        cm = _map([10, 10, 10])
        assert list(cm.span(0, 1)) == [0]
        assert list(cm.span(9, 2)) == [0, 1]
        assert list(cm.span(10, 10)) == [1]
        assert list(cm.span(5, 100)) == [0, 1, 2]
        assert list(cm.span(30, 5)) == []

    def test_gaps_and_overlaps_are_refused(self) -> None:
        a = ChunkRef(0, 10, D1)
        with pytest.raises(CorruptObject, match="starts at"):
            ChunkMap.build([a, ChunkRef(11, 5, D2)])
        with pytest.raises(CorruptObject, match="starts at"):
            ChunkMap.build([a, ChunkRef(9, 5, D2)])
        with pytest.raises(CorruptObject, match="length"):
            ChunkMap.build([ChunkRef(0, 0, D2)])

    def test_decode_for_another_blob(self) -> None:
        """A valid map of another blob stored under this blob's key (a swapped map)."""
        cm = _map([10])
        with pytest.raises(CorruptObject, match="does not belong to blob"):
            ChunkMap.decode(cm.encode(), D2)
        with pytest.raises(CorruptObject, match="does not belong to blob"):
            ChunkMap.decode(_map([10, 5]).encode(), cm.blob)

    def test_blob_id_is_the_chunk_lists(self) -> None:
        """The id is blake3 over a domain prefix, the size, the count and every entry (offset,
        length, flags, digest); same list, same id; the known value pins the encoding."""
        refs = [ChunkRef(0, 4096, D1, METADATA), ChunkRef(4096, 10, D2)]
        body = b"".join(struct.pack("<QII32s", r.offset, r.length, r.flags, digestmod.raw_of(r.digest))
                        for r in refs)
        want = digestmod.PREFIX + blake3.blake3(
            b"layerstore chunk list v2\0" + struct.pack("<QQ", 4106, 2) + body).hexdigest()
        assert blob_id(4106, refs) == want == ChunkMap.build(refs).blob == ChunkMap.build(list(refs)).blob
        assert blob_id(0, []) == ChunkMap.build([]).blob != digestmod.of(b"")

    @pytest.mark.parametrize("change", ["digest", "flags", "length", "count"])
    def test_every_field_is_bound_to_the_id(self, change: str) -> None:
        """A forged map (other chunks, other flags, other cut) under a blob's id never decodes."""
        cm = _map([4096, 100, 1 << 20], [METADATA, 0, 0])
        refs = list(cm.chunks)
        if change == "digest":
            refs[1] = ChunkRef(refs[1].offset, refs[1].length, D2, refs[1].flags)
        elif change == "flags":
            refs[1] = ChunkRef(refs[1].offset, refs[1].length, refs[1].digest, METADATA)
        elif change == "length":
            refs[1:] = [ChunkRef(4096, 50, refs[1].digest), ChunkRef(4146, 50 + (1 << 20), refs[2].digest)]
        else:
            refs.append(ChunkRef(cm.size, 1, D1))
        forged = ChunkMap(blob=cm.blob, size=refs[-1].end, chunks=tuple(refs))
        with pytest.raises(CorruptObject, match=f"does not belong to blob {cm.blob}"):
            ChunkMap.decode(forged.encode(), cm.blob)
        with pytest.raises(CorruptObject, match="does not belong"):
            forged.check()

    def test_encoding_is_canonical(self) -> None:
        cm = _map([10, 20])
        data = bytearray(cm.encode())
        data[5] = 1  # a reserved byte
        with pytest.raises(CorruptObject, match="reserved"):
            ChunkMap.decode(bytes(data), cm.blob)
        with pytest.raises(CorruptObject, match="do not fit"):
            ChunkMap.decode(cm.encode() + b"\0", cm.blob)

    def test_format_1_maps_say_to_rebuild(self) -> None:
        """A map written by an older layerstore (blob id = blake3 of the whole file, which a map
        cannot prove) is refused with what to do, never accepted."""
        head = struct.pack("<4sB3xIQ32s", b"LSCM", 1, 1, 10, digestmod.raw_of(D1))
        body = head + struct.pack("<QII32s", 0, 10, 0, digestmod.raw_of(D2))
        v1 = body + blake3.blake3(body).digest()
        with pytest.raises(CorruptObject, match="older layerstore.*rebuild the layer and push it again"):
            ChunkMap.decode(v1, D1)

    def test_too_many_entries(self) -> None:
        head = struct.pack("<4sB3xIQ", b"LSCM", 2, chunkmap.MAX_ENTRIES + 1, 0)
        with pytest.raises(CorruptObject, match="more than"):
            ChunkMap.decode(head, D1)

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=300))
    def test_junk_is_corrupt(self, junk: bytes) -> None:
        with pytest.raises(CorruptObject):
            ChunkMap.decode(junk, D1)

    @settings(max_examples=100, deadline=None)
    @given(st.lists(st.integers(min_value=1, max_value=1 << 21), max_size=50), st.data())
    def test_span_matches_brute_force(self, lengths: list[int], data: st.DataObject) -> None:
        cm = _map(lengths)
        off = data.draw(st.integers(min_value=0, max_value=cm.size + 10))
        n = data.draw(st.integers(min_value=0, max_value=1 << 22))
        end = min(off + n, cm.size)
        want = [i for i, c in enumerate(cm.chunks) if c.offset < end and c.end > off] if off < end else []
        assert list(cm.span(off, n)) == want
