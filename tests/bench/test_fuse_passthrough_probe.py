"""bench/probes/fuse_passthrough.py's correctness part (no timing; docs/fuse-passthrough.md): on a
kernel that offers FUSE passthrough, an OPEN answered with a backing id reads the right bytes with
no READ reaching the server; the production stack (file-backed EROFS on the FUSE file, overlayfs
on it) is not available on a mount that negotiated passthrough, and is on one that did not; a
loop device on the FUSE file carries EROFS + overlayfs in every mode. Every mount is gone after."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.probes.fuse_passthrough import correctness, scratch
from layerstore import linux


@pytest.mark.root
def test_passthrough_probe_answers(tmp_path: Path) -> None:
    with scratch(str(tmp_path)) as work:
        found = correctness(work)
        modes = {m["mode"]: m for m in found["modes"]}  # type: ignore[union-attr]
    assert not linux.mounts_under(linux.read_mounts(), str(tmp_path))
    for m in modes.values():
        assert m["unmounted"] and m["a_read"]["detail"]["bytes_equal"]
        assert m["server"]["loop_error"] is None
        assert m["c2_erofs_on_loop"]["ok"] and m["c2_overlay_on_loop_erofs"]["ok"], m
        assert m["c2_overlay_on_loop_erofs"]["detail"]["mismatches"] == 0
    plain = modes["nopt"]
    assert plain["a_read"]["detail"]["server_reads"] > 0
    assert plain["b_erofs_file_backed"]["ok"] and plain["c_overlay"]["ok"], plain
    if not modes["pt1"]["init"]["kernel_offers_passthrough"]:
        pytest.skip("this kernel does not offer FUSE_PASSTHROUGH")
    for label in ("pt1", "pt2"):
        a = modes[label]["a_read"]["detail"]
        assert a["passthrough_opens"] == 1 and a["server_reads"] == 0, modes[label]
        # 6.18-stable (erofs 7893cc12): refused outright; before it, EROFS mounted one level up and
        # overlayfs was refused: the production stack is unavailable either way
        b, c = modes[label]["b_erofs_file_backed"], modes[label].get("c_overlay")
        assert not (b["ok"] and c and c["ok"]), modes[label]
    # a backing file on overlayfs (depth 1) needs max_stack_depth 2: at 1, BACKING_OPEN is ELOOP
    assert "ELOOP" in " ".join(modes["pt1_backing_on_overlay"]["a_read"]["detail"]["backing_errors"])
    assert modes["pt2_backing_on_overlay"]["a_read"]["detail"]["passthrough_opens"] == 1
    pt0 = modes["pt0"]  # passthrough offered with max_stack_depth 0: the kernel does not enable it
    assert pt0["a_read"]["detail"]["passthrough_opens"] == 0 and pt0["b_erofs_file_backed"]["ok"]
