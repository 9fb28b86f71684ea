"""The parsers of untrusted bytes under a small, deterministic fuzz run (the long run is
`bench/fuzz.py`): tar streams, OCI layouts and docker archives, chunk objects, chunk maps and the
manifest package's documents refuse bad input only with a `LayerstoreError`, never another
exception type. Inputs: random bytes and mutations of valid objects (testkit.fuzzing)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from testkit import fuzzing

from layerstore.errors import BadInput

_OCI = fuzzing.OciTarget.create()
TARGETS = {t.name: t for t in fuzzing.targets(_OCI)}
EXAMPLES = {"tar": 400, "oci": 200, "chunk_object": 300, "chunk_map": 300, "manifest": 300}


@pytest.fixture(scope="module", autouse=True)
def _scratch() -> Iterator[None]:
    import shutil

    yield
    shutil.rmtree(_OCI.root, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_parser_raises_only_layerstore_errors(name: str) -> None:
    target = TARGETS[name]

    @settings(max_examples=EXAMPLES[name], derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(target.strategy)
    def run(value: object) -> None:
        error = fuzzing.run_one(target, value)
        if error is not None:
            raise error

    run()


def test_the_mutations_reach_past_the_first_check() -> None:
    """Some mutated inputs must parse or fail deep inside, not all at the first check: the
    valid seeds themselves parse, and a mutated tar with fixed checksums is read member by member."""
    for seed in fuzzing.tar_seeds():
        fuzzing.parse_tar(seed)
    for blob, data in fuzzing.chunk_map_seeds():
        fuzzing.parse_chunk_map(data, blob)
    for expected, obj in fuzzing.chunk_seeds():
        fuzzing.parse_chunk_object(obj, expected)
    for seed in _OCI.seeds():
        _OCI(seed)
    flipped = fuzzing.fix_tar_checksums(fuzzing.mutate(fuzzing.tar_seeds()[0], [("set", 1024 + 156, b"Z")]))
    with pytest.raises(BadInput, match="unknown member type"):
        fuzzing.parse_tar(flipped)
