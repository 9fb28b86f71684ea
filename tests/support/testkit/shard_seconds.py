"""The seconds each test file takes, per tier, from JUnit XML reports, as the JSON that
tests/conftest.py's `--shard` balances by (tests/shard_seconds.json): `make check` splits the
unmarked tier in two, `make test` the marked tiers. Only the balance of the parts depends on it: a
file it does not name for a tier counts that tier's tests at DEFAULT_SECONDS each.

    pytest -m "not (...)" --junitxml=a.xml ...; pytest -m "..." --junitxml=b.xml ...
    python -m testkit.shard_seconds unmarked=a.xml marked=b.xml > tests/shard_seconds.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter

DEFAULT_SECONDS = 0.1  # per test of a file the JSON does not name


def file_of(classname: str) -> str:
    """`tests.service.test_x.TestY` -> `tests/service/test_x.py`."""
    parts = classname.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py"


def seconds_per_file(reports: list[str]) -> dict[str, float]:
    per: Counter[str] = Counter()
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            per[file_of(case.get("classname", ""))] += float(case.get("time", "0"))
    return {name: round(secs, 2) for name, secs in sorted(per.items())}


TIERS = ("unmarked", "marked")  # tests/conftest.py: "marked" is a test that needs any of NEEDS


def seconds_per_tier(args: list[str]) -> dict[str, dict[str, float]]:
    """`TIER=report.xml` arguments -> tier -> file -> seconds."""
    reports: dict[str, list[str]] = {t: [] for t in TIERS}
    for arg in args:
        tier, sep, report = arg.partition("=")
        if not sep or tier not in reports:
            raise SystemExit(f"{arg}: expected TIER=report.xml with TIER one of {', '.join(TIERS)}")
        reports[tier].append(report)
    return {t: seconds_per_file(r) for t, r in reports.items()}


if __name__ == "__main__":
    json.dump(seconds_per_tier(sys.argv[1:]), sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
