"""Property tests: round trips of valid manifests, and parsers that answer any input with their
own error (never another exception)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from layerstore.errors import ConfigError, LayerstoreError
from manifest import canonical
from manifest.config import RuntimeConfig
from manifest.errors import InvalidManifest
from manifest.schema import Layer, Manifest, parse_manifest
from manifest.signing import Signature, TrustPolicy
from manifest.trace import parse_trace, parse_trace_json

settings.register_profile("manifest", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("manifest")

digests = st.binary(min_size=32, max_size=32).map(lambda b: "b3:" + b.hex())
text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20)
env_entries = st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,10}", fullmatch=True), text,
                              max_size=5).map(lambda d: tuple(f"{k}={v}" for k, v in d.items()))
workdirs = st.lists(st.from_regex(r"[A-Za-z0-9_ .-]{1,8}", fullmatch=True).filter(lambda s: s != ".."),
                    max_size=4).map(lambda parts: "/" + "/".join(parts))
users = st.one_of(st.just(""), st.from_regex(r"[a-z_][a-z0-9_-]{0,8}(:[a-z0-9_][a-z0-9_-]{0,8})?", fullmatch=True))
configs = st.builds(RuntimeConfig, entrypoint=st.lists(text, max_size=3).map(tuple),
                    cmd=st.lists(text, max_size=3).map(tuple), env=env_entries, workdir=workdirs, user=users)
annotations = st.dictionaries(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,30}", fullmatch=True),
                              st.text(st.characters(blacklist_categories=("Cs",)), max_size=30), max_size=4)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    blobs = draw(st.lists(digests, min_size=1, max_size=6, unique=True))
    has_ws = len(blobs) > 1 and draw(st.booleans())
    roles = ["base"] + ["toolkit"] * (len(blobs) - 1 - has_ws) + ["workspace"] * has_ws
    layers = tuple(Layer(b, draw(st.integers(0, 1 << 40)), r) for b, r in zip(blobs, roles, strict=True))
    hinted = draw(st.lists(st.sampled_from(blobs), unique=True, max_size=len(blobs)))
    prefetch = {b: tuple(draw(st.lists(st.integers(0, 10_000), min_size=1, max_size=10, unique=True)))
                for b in hinted}
    return Manifest(layers=layers, config=draw(configs), prefetch=prefetch, annotations=draw(annotations))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10) | digests,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | digests, inner, max_size=4),
    max_leaves=20,
)


@given(manifests())
def test_round_trip(m: Manifest) -> None:
    data = m.to_bytes()
    assert Manifest.from_bytes(data) == m
    assert parse_manifest(json.loads(data)) == m
    assert Manifest.from_bytes(data).digest() == m.digest()
    assert canonical.dumps(json.loads(data)) == data


@given(manifests())
def test_any_other_formatting_is_refused(m: Manifest) -> None:
    data = m.to_bytes()
    pretty = json.dumps(json.loads(data), indent=1).encode()
    assume(pretty != data)
    try:
        Manifest.from_bytes(pretty)
    except InvalidManifest as e:
        assert "canonical" in str(e)
    else:
        raise AssertionError("non-canonical bytes accepted")


@given(json_values)
def test_random_json_gives_invalid_manifest(obj: Any) -> None:
    with contextlib.suppress(InvalidManifest):
        parse_manifest(obj)


@st.composite
def mutated_docs(draw: st.DrawFn) -> Any:
    """A valid manifest's JSON with one nested value replaced or removed: near misses reach the
    deep rules that random JSON rarely does."""
    doc = draw(manifests()).to_json()
    paths: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k in list(node):
                paths.append((node, k))
                walk(node[k])
        elif isinstance(node, list):
            for i in range(len(node)):
                paths.append((node, i))
                walk(node[i])

    walk(doc)
    parent, key = draw(st.sampled_from(paths))
    if draw(st.booleans()):
        parent[key] = draw(json_values)
    elif isinstance(parent, dict):
        del parent[key]
    else:
        parent.pop(key)
    return doc


@pytest.mark.slow  # about 2-3 s: kept out of `make check`'s 2 minutes
@given(mutated_docs())
def test_near_miss_documents_give_invalid_manifest(doc: Any) -> None:
    try:
        m = parse_manifest(doc)
    except InvalidManifest:
        return
    assert Manifest.from_bytes(m.to_bytes()) == m


@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_random_bytes(data: bytes) -> None:
    for parse in (Manifest.from_bytes, parse_trace, Signature.from_bytes):
        with contextlib.suppress(InvalidManifest):
            parse(data)
    with contextlib.suppress(ConfigError):
        TrustPolicy.from_bytes(data)


@given(json_values)
def test_random_json_trace_and_policy(obj: Any) -> None:
    with contextlib.suppress(InvalidManifest):
        parse_trace_json(obj)
    with contextlib.suppress(ConfigError):
        TrustPolicy.from_json(obj)


@given(st.dictionaries(st.sampled_from(["version", "blobs", "x"]), json_values, max_size=3)
       | st.fixed_dictionaries({"version": st.just(1), "blobs": st.dictionaries(digests, json_values, max_size=3)}))
def test_trace_near_misses(obj: Any) -> None:
    try:
        trace = parse_trace_json(obj)
    except InvalidManifest:
        return
    assert all(isinstance(i, int) and i >= 0 for idx in trace.values() for i in idx)


@given(configs)
def test_config_round_trip(c: RuntimeConfig) -> None:
    assert RuntimeConfig.from_json(c.to_json()) == c
    assert RuntimeConfig.from_json(json.loads(canonical.dumps(c.to_json()))) == c


@given(st.dictionaries(st.sampled_from(["entrypoint", "cmd", "env", "workdir", "user", "other"]), json_values))
def test_config_file_near_misses(obj: Any) -> None:
    try:
        RuntimeConfig.from_json(obj, partial=True)
    except LayerstoreError as e:
        assert isinstance(e, InvalidManifest)
