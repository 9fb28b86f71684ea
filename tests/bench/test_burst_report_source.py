"""The burst report names the raw results file it was given, not the size's default name."""

import json
from pathlib import Path

from bench.burst import report


def test_the_report_names_the_file_it_read(tmp_path: Path) -> None:
    results = {"size": "quick", "sandboxes": 2, "environments": {}, "contenders": {}}
    f = tmp_path / "burst-cri-quick.json"
    f.write_text(json.dumps(results))
    section = report.render(f, None, None)
    assert f"`{f}`" in section
    assert "bench/results/burst-quick.json" not in section


def test_the_default_name_without_a_file() -> None:
    section = report.markdown({"size": "full", "contenders": {}})
    assert "`bench/results/burst-full.json`" in section
