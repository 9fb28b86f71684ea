"""The test suite's own classification (tests/conftest.py, docs/testing.md): what gets which mark
without an edit, what a Ceph fixture does to an unmarked test, and how `make check` halves the tier."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.fixtures_ceph import require_ceph_mark

from tests.conftest import NEEDS, REQUIRES, classify, file_weights, shard_files


class FakeItem:
    def __init__(self, *fixturenames: str, marks: tuple[str, ...] = ()) -> None:
        self.fixturenames = list(fixturenames)
        self.marks = list(marks)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        self.marks.append(mark.name)


@pytest.mark.parametrize("fixture", ["ceph", "s3_client", "s3_env", "s3_bucket_name", "s3_store_url",
                                     "cephfs_store_url"])
def test_a_test_using_a_ceph_fixture_is_marked_ceph(fixture: str) -> None:
    item = FakeItem("tmp_path", fixture)
    classify(item)  # type: ignore[arg-type]
    assert item.marks == ["ceph"]


def test_a_mark_is_added_once_and_nothing_else_is_marked() -> None:
    marked, plain = FakeItem("s3_store_url", marks=("ceph",)), FakeItem("tmp_path", "node", "store")
    classify(marked)  # type: ignore[arg-type]
    classify(plain)  # type: ignore[arg-type]
    assert marked.marks == ["ceph"] and plain.marks == []
    assert {m for marks in REQUIRES.values() for m in marks} <= set(NEEDS)


def test_a_ceph_fixture_fails_a_test_without_the_mark(request: pytest.FixtureRequest) -> None:
    with pytest.raises(pytest.fail.Exception, match="not marked `ceph`"):
        require_ceph_mark(request)


@pytest.mark.ceph
def test_a_ceph_fixture_lets_a_marked_test_through(request: pytest.FixtureRequest) -> None:
    require_ceph_mark(request)  # (skipped where Ceph is absent, deselected by make check: runs in make test)


def test_the_halves_cover_every_file_once_and_balance() -> None:
    counts = {f"tests/t{i}.py": n for i, n in enumerate([40, 1, 7, 7, 30, 3, 12, 2, 9, 9])}
    parts = shard_files(counts, 2)
    assert set().union(*parts) == set(counts) and not parts[0] & parts[1]
    loads = [sum(counts[f] for f in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= max(counts.values()) and sum(loads) == 120
    assert shard_files(dict(reversed(counts.items())), 2) == parts  # the same split in every process
    assert shard_files(counts, 3)[2] and shard_files({"tests/a.py": 1}, 2) == [{"tests/a.py"}, set()]


def test_the_halves_balance_by_recorded_seconds(tmp_path: Path) -> None:
    seconds = tmp_path / "seconds.json"
    seconds.write_text('{"unmarked": {"tests/slow.py": 50.0, "tests/fast.py": 1.0}, '
                       '"marked": {"tests/fast.py": 90.0}}')
    counts = {"tests/slow.py": {"unmarked": 2}, "tests/fast.py": {"unmarked": 60},
              "tests/new.py": {"unmarked": 30}, "tests/other.py": {"unmarked": 40}}
    weights = file_weights(counts, seconds)
    assert weights == {"tests/slow.py": 50.0, "tests/fast.py": 1.0, "tests/new.py": 3.0, "tests/other.py": 4.0}
    assert shard_files(weights, 2)[0] == {"tests/slow.py"}  # by count it would share a half with nothing heavy
    assert file_weights(counts, tmp_path / "absent.json")["tests/fast.py"] == 6.0
    # a file's marked tests weigh what the marked tier recorded: `make test` splits that tier
    both = file_weights({"tests/fast.py": {"unmarked": 60, "marked": 2}, "tests/new.py": {"marked": 3}}, seconds)
    assert both == pytest.approx({"tests/fast.py": 91.0, "tests/new.py": 0.3})
