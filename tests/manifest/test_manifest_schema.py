"""Pure units: the manifest schema, runtime config, canonical form, traces."""

from __future__ import annotations

import json
from typing import Any

import pytest

from layerstore import digest as digestmod
from manifest import canonical
from manifest.config import RuntimeConfig
from manifest.errors import InvalidManifest
from manifest.schema import Layer, Manifest, check_against_chunk_maps, parse_manifest
from manifest.trace import parse_trace, prefetch_from_trace

B = digestmod.of(b"base")
T1 = digestmod.of(b"toolkit-1")
T2 = digestmod.of(b"toolkit-2")
W = digestmod.of(b"workspace")


def make(**kw: Any) -> Manifest:
    kw.setdefault("layers", (Layer(B, 100, "base"), Layer(T1, 50, "toolkit"), Layer(W, 7, "workspace")))
    return Manifest(**kw)


def doc(**over: Any) -> dict[str, Any]:
    d = make().to_json()
    d.update(over)
    return d


def err(obj: Any) -> str:
    with pytest.raises(InvalidManifest) as ei:
        parse_manifest(obj)
    return str(ei.value)


# -- canonical form and digest ---------------------------------------------------------------------
def test_canonical_bytes_are_sorted_compact_utf8() -> None:
    m = make(annotations={"note": "café ☕"}, config=RuntimeConfig(cmd=("/bin/sh",), env=("A=1",)))
    data = m.to_bytes()
    assert b" " not in data.replace(b"caf\xc3\xa9 \xe2\x98\x95", b"")
    assert "café ☕".encode() in data
    obj = json.loads(data)
    assert data == json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert list(obj) == sorted(obj)
    assert m.digest() == digestmod.of(data)
    assert Manifest.from_bytes(data) == m


def test_digest_is_stable_across_construction_order() -> None:
    a = make(annotations={"a": "1", "b": "2"}, prefetch={B: (3, 1), W: (0,)})
    b = make(annotations={"b": "2", "a": "1"}, prefetch={W: (0,), B: (3, 1)})
    assert a.to_bytes() == b.to_bytes() and a.digest() == b.digest()


def test_prefetch_order_is_significant() -> None:
    assert make(prefetch={B: (1, 0)}).digest() != make(prefetch={B: (0, 1)}).digest()


def test_non_canonical_bytes_are_refused() -> None:
    data = make().to_bytes()
    pretty = json.dumps(json.loads(data), indent=2).encode()
    assert "canonical" in _bytes_err(pretty)
    assert Manifest.from_bytes(pretty, require_canonical=False) == make()
    ascii_escaped = json.dumps(json.loads(make(annotations={"a": "é"}).to_bytes()), sort_keys=True,
                               separators=(",", ":")).encode()
    assert "canonical" in _bytes_err(ascii_escaped)


def _bytes_err(data: bytes) -> str:
    with pytest.raises(InvalidManifest) as ei:
        Manifest.from_bytes(data)
    return str(ei.value)


@pytest.mark.parametrize("data, needle", [
    (b"", "not JSON"),
    (b"{", "not JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b"\xef\xbb\xbf{}", "byte order mark"),
    (b'{"a":1,"a":2}', "duplicate key 'a'"),
    (b"[NaN]", "NaN is not a JSON number"),
    (b"[Infinity]", "Infinity"),
    (b"[" * 100 + b"]" * 100, "nested deeper"),
    (b"1" * 5000, "not JSON we read"),
    (b"[]", "want an object, got a list"),
])
def test_bad_bytes(data: bytes, needle: str) -> None:
    assert needle in _bytes_err(data)


def test_canonical_loads_tolerates_brackets_in_strings() -> None:
    assert canonical.loads(json.dumps({"a": "[" * 200}).encode()) == {"a": "[" * 200}


# -- top-level fields ---------------------------------------------------------------------------
def test_schema_version_checked_before_fields() -> None:
    assert "unknown schema version 2 (this layerctl reads 1)" in err(doc(schema_version=2, future="x"))
    assert "unknown schema version True" in err(doc(schema_version=True))
    assert "unknown schema version '1'" in err(doc(schema_version="1"))
    d = doc()
    del d["schema_version"]
    assert "missing field 'schema_version'" in err(d)


def test_kind() -> None:
    assert "not an environment manifest (kind 'signature'" in err(doc(kind="signature"))


@pytest.mark.parametrize("field", ["layers", "config", "prefetch", "annotations"])
def test_missing_field(field: str) -> None:
    d = doc()
    del d[field]
    assert f"missing field {field!r}" in err(d)


def test_extra_field() -> None:
    assert "unknown field 'extra'" in err(doc(extra=1))


# -- layers ---------------------------------------------------------------------------------------
def L(blob: str, role: str, size: int = 1) -> dict[str, Any]:  # noqa: N802
    return {"blob": blob, "size": size, "role": role}


@pytest.mark.parametrize("layers, needle", [
    ([], "layers: empty"),
    ([L(T1, "toolkit")], "layers[0]: the first layer must be the base, got a toolkit"),
    ([L(W, "workspace")], "first layer must be the base, got a workspace"),
    ([L(B, "base"), L(T1, "base")], "layers[1]: a second base"),
    ([L(B, "base"), L(W, "workspace"), L(T1, "toolkit")],
     "layers[1]: the workspace must be the last (top) layer, but layer 2 is a toolkit"),
    ([L(B, "base"), L(W, "workspace"), L(T1, "workspace")], "layers[1]: the workspace must be the last"),
    ([L(B, "base"), L(B, "toolkit")], f"layers[1]: blob {B} is already layer 0"),
    ([L(B, "base"), L(T1, "tool")], "layers[1].role: unknown role 'tool'"),
    ([L(B, "base"), {"blob": T1, "size": 1}], "layers[1]: missing field 'role'"),
    ([{**L(B, "base"), "digest": B}], "layers[0]: unknown field 'digest'"),
    ([L("b3:1234", "base")], "layers[0].blob: not a digest"),
    ([L(B.upper(), "base")], "not a digest"),
    ([L(B, "base", -1)], "layers[0].size: want a non-negative integer, got -1"),
    ([L(B, "base", True)], "layers[0].size: want a non-negative integer, got True"),  # type: ignore[arg-type]
    ([{"blob": B, "size": 1.0, "role": "base"}], "want a non-negative integer, got 1.0"),
    ([L(B, "base", 1 << 63)], "want a non-negative integer"),
    ([L(B, 7, 1)], "layers[0].role: want a string, got an integer"),  # type: ignore[arg-type]
    ("base", "manifest: layers: want a list of layers, got a string"),
    (["x"], "layers[0]: want an object, got a string"),
    ([L(B, "base")] + [L(digestmod.of(str(i).encode()), "toolkit") for i in range(500)], "more than overlayfs"),
])
def test_bad_layers(layers: Any, needle: str) -> None:
    assert needle in err(doc(layers=layers))


def test_good_layer_shapes() -> None:
    for layers in ([L(B, "base")], [L(B, "base"), L(W, "workspace")],
                   [L(B, "base"), L(T1, "toolkit"), L(T2, "toolkit"), L(W, "workspace")]):
        m = parse_manifest(doc(layers=layers, prefetch={}))
        assert m.base.blob == B
        assert [t.blob for t in m.toolkits] == [x["blob"] for x in layers if x["role"] == "toolkit"]
        assert (m.workspace is not None) == (layers[-1]["role"] == "workspace")


# -- config ---------------------------------------------------------------------------------------
def cfg(**over: Any) -> dict[str, Any]:
    d = RuntimeConfig().to_json()
    d.update(over)
    return d


@pytest.mark.parametrize("config, needle", [
    (cfg(env=["NOEQUALS"]), "config.env[0]: want KEY=VALUE, got 'NOEQUALS'"),
    (cfg(env=["=v"]), "config.env[0]: want KEY=VALUE"),
    (cfg(env=["A B=1"]), "config.env[0]: bad variable name 'A B'"),
    (cfg(env=["A=1", "B=2", "A=3"]), "config.env[2]: A is already set by env[0]"),
    (cfg(env=["A=\x00"]), "config.env[0]: contains a NUL"),
    (cfg(env="A=1"), "config.env: want a list of strings, got a string"),
    (cfg(cmd=["ok", 3]), "config.cmd[1]: want a string, got an integer"),
    (cfg(entrypoint=["\ud800"]), "config.entrypoint[0]: not valid Unicode"),
    (cfg(workdir="work"), "config.workdir: must be an absolute path, got 'work'"),
    (cfg(workdir=""), "must be an absolute path"),
    (cfg(workdir="/a/../etc"), "config.workdir: must not contain '..'"),
    (cfg(workdir=None), "config.workdir: want a string, got null"),
    (cfg(user="root user"), "config.user: want USER, UID, USER:GROUP or UID:GID"),
    (cfg(user="a:b:c"), "config.user"),
    (cfg(shell=["/bin/sh"]), "config: unknown field 'shell'"),
    ({k: v for k, v in cfg().items() if k != "user"}, "config: missing field 'user'"),
    ([], "config: want an object, got a list"),
])
def test_bad_config(config: Any, needle: str) -> None:
    assert needle in err(doc(config=config))


def test_config_values() -> None:
    c = RuntimeConfig(entrypoint=("/bin/sh", "-c"), cmd=("echo hi",), env=("A=1=2", "B="), workdir="/w",
                      user="1000:1000")
    assert c.argv == ["/bin/sh", "-c", "echo hi"]
    assert c.env_map() == {"A": "1=2", "B": ""}
    assert RuntimeConfig.from_json(c.to_json()) == c
    assert RuntimeConfig.from_json({"cmd": ["x"]}, partial=True) == RuntimeConfig(cmd=("x",))
    for user in ("", "root", "0", "1000:1000", "www-data:www-data", "_apt"):
        RuntimeConfig(user=user)


# -- prefetch and annotations ------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch, needle", [
    ({T2: [0]}, "is not a layer of this environment"),
    ({"nope": [0]}, "prefetch['nope']: not a digest"),
    ({B: []}, "empty list"),
    ({B: [1, 2, 1]}, "[2]: chunk 1 is listed twice"),
    ({B: [-1]}, "[0]: want a chunk index"),
    ({B: [1 << 32]}, "want a chunk index"),
    ({B: ["0"]}, "want a chunk index (a non-negative integer), got '0'"),
    ({B: [False]}, "want a chunk index"),
    ({B: 3}, "want a list of chunk indexes, got an integer"),
    ([B], "manifest: prefetch: want an object"),
])
def test_bad_prefetch(prefetch: Any, needle: str) -> None:
    assert needle in err(doc(prefetch=prefetch))


@pytest.mark.parametrize("annotations, needle", [
    ({"": "x"}, "annotations: bad key ''"),
    ({"a b": "x"}, "bad key 'a b'"),
    ({".hidden": "x"}, "bad key"),
    ({"k" * 257: "x"}, "bad key"),
    ({"k": 1}, "annotations['k']: want a string, got an integer"),
    ({"k": "\udc80"}, "not valid Unicode"),
    ("k=v", "want an object"),
])
def test_bad_annotations(annotations: Any, needle: str) -> None:
    assert needle in err(doc(annotations=annotations))


def test_annotation_values_may_be_anything_textual() -> None:
    m = make(annotations={"org.example/task-id": "línea 1\nline 2\x00", "k": ""})
    assert Manifest.from_bytes(m.to_bytes()) == m


# -- against the store's chunk maps ----------------------------------------------------------------
def test_check_against_chunk_maps() -> None:
    m = make(prefetch={B: (0, 4)})
    sizes = {B: 100, T1: 50, W: 7}
    counts = {B: 5, T1: 1, W: 1}
    check_against_chunk_maps(m, sizes, counts)
    with pytest.raises(InvalidManifest, match=r"layers\[1\]: size 50 does not match .* \(51 bytes\)"):
        check_against_chunk_maps(m, {**sizes, T1: 51}, counts)
    with pytest.raises(InvalidManifest, match=r"chunk 4 is out of range \(the blob has 4 chunks\)"):
        check_against_chunk_maps(m, sizes, {**counts, B: 4})
    with pytest.raises(InvalidManifest, match="has no chunk map"):
        check_against_chunk_maps(m, {B: 100}, counts)


# -- traces ----------------------------------------------------------------------------------------
def trace_bytes(blobs: Any, **extra: Any) -> bytes:
    return json.dumps({"version": 1, "blobs": blobs, **extra}).encode()


def test_trace_keeps_only_layers_dedupes_and_drops_empty() -> None:
    other = digestmod.of(b"other")
    t = parse_trace(trace_bytes({B: [3, 0, 3, 1], other: [9], T1: [], W: [0]}, node="n1"))
    assert prefetch_from_trace(t, {B: 4, T1: 2, W: 1}) == {B: (3, 0, 1), W: (0,)}


@pytest.mark.parametrize("data, needle", [
    (trace_bytes({}) .replace(b'"version": 1', b'"version": 2'), "unknown trace version 2"),
    (b'{"blobs": {}}', "missing field 'version'"),
    (b'{"version": 1}', "missing field 'blobs'"),
    (trace_bytes([]), "prefetch trace: blobs: want an object"),
    (trace_bytes({"x": [1]}), "not a digest"),
    (trace_bytes({B: {}}), "want a list of chunk indexes, got an object"),
    (trace_bytes({B: [1.5]}), "want a chunk index (a non-negative integer), got a number"),
    (trace_bytes({B: [-2]}), "not a chunk index"),
    (b"not json", "prefetch trace: not JSON"),
])
def test_bad_trace(data: bytes, needle: str) -> None:
    with pytest.raises(InvalidManifest) as ei:
        parse_trace(data)
    assert needle in str(ei.value)


def test_trace_index_beyond_chunk_map() -> None:
    t = parse_trace(trace_bytes({B: [0, 5]}))
    with pytest.raises(InvalidManifest, match=f"blob {B}: entry 1 is chunk 5, but the blob has 5 chunks"):
        prefetch_from_trace(t, {B: 5})


def test_constructor_refuses_wrong_shapes() -> None:
    with pytest.raises(InvalidManifest, match="wrong shape"):
        Manifest(layers=(Layer(B, 1, "base"),), prefetch={B: 5})  # type: ignore[dict-item]
    with pytest.raises(InvalidManifest, match=r"layers\[0\]: not a Layer"):
        Manifest(layers=({"blob": B},))  # type: ignore[arg-type]
