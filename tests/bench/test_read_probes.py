"""The read bench's load-independent probe: a process's page faults (`process_faults`) count the
pages it touches for the first time."""

from __future__ import annotations

import mmap
import os

from bench.readbench.probes import process_faults


def test_page_faults_count_touched_pages() -> None:
    pages = 256
    m = mmap.mmap(-1, pages * mmap.PAGESIZE)  # anonymous: every first touch is a fault
    try:
        before = process_faults(os.getpid())
        for i in range(pages):
            m[i * mmap.PAGESIZE] = 1
        after = process_faults(os.getpid())
    finally:
        m.close()
    # Fault-around does not apply to anonymous writes; huge pages could make it fewer, never 0.
    assert after - before >= 1
    assert after - before <= pages + 64  # (the interpreter's own faults meanwhile)
