"""The seconds each test file takes in `make check`, from JUnit XML reports, as the JSON that
tests/conftest.py's `--shard` balances by (tests/shard_seconds.json). Only the balance of the two
halves depends on it: a file it does not name counts its tests at DEFAULT_SECONDS each.

    pytest -m "not (...)" --junitxml=a.xml ...; python -m testkit.shard_seconds a.xml [b.xml] > tests/shard_seconds.json
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


if __name__ == "__main__":
    json.dump(seconds_per_file(sys.argv[1:]), sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
