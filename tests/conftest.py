"""Shared test fixtures (the Ceph ones live in the development kit, `testkit.fixtures_ceph`) and the
one place that classifies tests by what they need and decides what a test does where that is missing.

The marks (registered in pyproject.toml; `make check` runs the tests that carry none of them):

- `root`: mounts, namespaces, cgroups: skipped without root (`testkit.shim_support.needs_root` is
  this same mark, kept importable);
- `ceph`: the real single-node Ceph (`testkit.fixtures_ceph`): skipped where Ceph is not installed;
  where it is, a cluster that does not start FAILS the test (CI machines have Ceph);
- `vm`: qemu and the guest kit of the current sources: skipped where either is missing;
- `containerd`: containerd and ctr: skipped where missing;
- `registry`: Debian's docker-registry on loopback: skipped where missing;
- `slow`: needs nothing above but takes long (a tier of its own, never skipped).

Classified here without edits to the test: a test that uses a Ceph fixture gets `ceph`, one that
uses a fixture marked by `REQUIRES` below gets that fixture's marks. A Ceph fixture reached
only through `request.getfixturevalue` (a backend parameter) cannot be seen at collection: the
parameter carries the mark (`pytest.param("s3", marks=pytest.mark.ceph)`), and the fixture fails a
test that lacks it (`testkit.fixtures_ceph`), so a missing mark shows on every machine.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from testkit.shard_seconds import DEFAULT_SECONDS

pytest_plugins = ["testkit.fixtures_ceph"]

# The marks that say what a test needs, in the order `make check` lists them.
NEEDS = ("root", "ceph", "vm", "containerd", "registry", "slow")
# Fixtures whose users need something: fixture name -> marks its users get.
REQUIRES: dict[str, tuple[str, ...]] = {
    **{name: ("ceph",) for name in ("ceph", "s3_client", "s3_env", "s3_bucket_name", "s3_store_url",
                                     "cephfs_store_url")},
}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Path]:
    """A node directory for the runtime shim; its mounts and processes are torn down afterwards."""
    from testkit.shim_support import cleanup_node

    n = tmp_path / "node"
    try:
        yield n
    finally:
        cleanup_node(n, tmp_path)


def _root_missing() -> str:
    return "" if os.geteuid() == 0 else "needs root (mounts)"


def _ceph_missing() -> str:
    if shutil.which("ceph-mon") is None:
        return "needs Ceph (ceph-mon and friends: .ci/install-deps.sh)"
    return _root_missing() and "needs root (the Ceph harness mounts CephFS)"


def _vm_missing() -> str:
    from testkit.vm_support import vm_unavailable

    return vm_unavailable()


def _containerd_missing() -> str:
    from testkit.containerd import containerd_missing

    return containerd_missing()


def _registry_missing() -> str:
    from testkit.oci_registry import registry_missing

    return registry_missing()


# mark -> why this machine cannot run its tests ("" if it can); asked once, only for marks in use.
MISSING: dict[str, Callable[[], str]] = {"root": _root_missing, "ceph": _ceph_missing, "vm": _vm_missing,
                                         "containerd": _containerd_missing, "registry": _registry_missing}


def classify(item: pytest.Item) -> None:
    """Add the marks a test gets from the fixtures it uses."""
    for name in getattr(item, "fixturenames", ()):
        for mark in REQUIRES.get(name, ()):
            if item.get_closest_marker(mark) is None:
                item.add_marker(getattr(pytest.mark, mark))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the I-th of N parts of the selected tests, whole files each, balanced by "
                          "recorded seconds (`make check` and `make test` run parts at once)")


def shard_files(counts: dict[str, int], n: int) -> list[set[str]]:
    """Split files (name -> number of tests) into n parts of near-equal totals: largest first,
    each to the lightest part so far (ties: the first part). Deterministic for equal input."""
    parts: list[set[str]] = [set() for _ in range(n)]
    loads = [0] * n
    for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        k = loads.index(min(loads))
        parts[k].add(name)
        loads[k] += count
    return parts


SHARD_SECONDS = Path(__file__).with_name("shard_seconds.json")  # (testkit/shard_seconds.py writes it)


def file_weights(counts: dict[str, dict[str, int]], seconds_file: Path) -> dict[str, float]:
    """Each selected file's weight for the parts: per tier of its selected tests ("marked" or
    "unmarked", testkit.shard_seconds.TIERS), the seconds that tier of the file took as recorded in
    `seconds_file`, else its tests at DEFAULT_SECONDS each. Only the balance depends on it."""
    try:
        recorded = json.loads(seconds_file.read_text())
    except (OSError, ValueError):
        recorded = {}
    return {name: sum(float(recorded.get(tier, {}).get(name, n * DEFAULT_SECONDS)) for tier, n in tiers.items())
            for name, tiers in counts.items()}


class Shard:
    def __init__(self, i: int, n: int) -> None:
        self.i, self.n = i, n

    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the parts split what is left
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        counts: dict[str, dict[str, int]] = {}
        for item in items:
            tiers = counts.setdefault(item.nodeid.partition("::")[0], {})
            tier = "marked" if any(item.get_closest_marker(m) for m in NEEDS) else "unmarked"
            tiers[tier] = tiers.get(tier, 0) + 1
        mine = shard_files(file_weights(counts, SHARD_SECONDS), self.n)[self.i - 1]
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid.partition("::")[0] not in mine])
        items[:] = [it for it in items if it.nodeid.partition("::")[0] in mine]


def pytest_configure(config: pytest.Config) -> None:
    shard = config.getoption("--shard")
    if shard:
        i, _, n = shard.partition("/")
        if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
            raise pytest.UsageError(f"--shard {shard}: expected I/N with 1 <= I <= N")
        config.pluginmanager.register(Shard(int(i), int(n)), "layerstore-shard")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: a mark added here counts there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why: dict[str, str] = {}
    for item in items:
        classify(item)
        for mark, missing in MISSING.items():
            if item.get_closest_marker(mark) is None:
                continue
            if mark not in why:
                why[mark] = missing()
            if why[mark]:
                item.add_marker(pytest.mark.skip(reason=why[mark]))
                break
