"""The parts of issue 27's orderly stop that need no root: stop signals as `Stopped`
(`runtime_shim.backends.signals`) and finding a sandbox's cgroup in a hierarchy layout (`cgroups`, on a
fake /sys/fs/cgroup under tmp_path: nothing there names a process, so nothing is killed)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from runtime_shim.backends import cgroups, signals


def in_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")


def deliver(signum: int) -> None:
    """Send `signum` to this process and give the handler its chance (it runs between bytecodes
    of the main thread)."""
    os.kill(os.getpid(), signum)
    for _ in range(100):
        time.sleep(0.01)


@pytest.mark.parametrize("signum", signals.STOP_SIGNALS)
def test_a_stop_signal_raises_stopped_once(signum: int) -> None:
    in_main_thread()
    before = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    with pytest.raises(signals.Stopped) as e, signals.stopping():
        try:
            deliver(signum)
        finally:
            with signals.shielded():
                deliver(signum)  # during the clean-up: counted, not raised
                assert signals.received() == 2
    assert e.value.signum == signum and isinstance(e.value, KeyboardInterrupt)
    assert str(e.value) == f"stopped by {signal.Signals(signum).name}"
    assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before


def test_stopped_says_what_it_stopped() -> None:
    assert str(signals.Stopped(signal.SIGHUP, "sandbox x stopped and removed")) == \
        "stopped by SIGHUP: sandbox x stopped and removed"


def test_off_the_main_thread_nothing_changes() -> None:
    seen: list[object] = []

    def target() -> None:
        with signals.stopping():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    th = threading.Thread(target=target)
    th.start()
    th.join()
    assert seen == [before]


def test_hierarchies_of_a_unified_and_a_legacy_layout(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "layerstore" / "sb-1").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu pids\n")
    assert cgroups.hierarchies(v2) == [v2]
    assert cgroups.dirs("sb-1", v2) == [v2 / "layerstore" / "sb-1"]

    v1 = tmp_path / "v1"
    for h in ("cpu,cpuacct", "pids", "unified"):
        (v1 / h).mkdir(parents=True)
    os.symlink("cpu,cpuacct", v1 / "cpu")  # counted once
    (v1 / "pids" / "layerstore" / "sb-1" / "child").mkdir(parents=True)
    (v1 / "unified" / "layerstore" / "sb-1").mkdir(parents=True)
    assert cgroups.hierarchies(v1) == [v1 / "cpu,cpuacct", v1 / "pids", v1 / "unified"]
    assert cgroups.dirs("sb-1", v1) == [v1 / "pids" / "layerstore" / "sb-1" / "child",  # children first
                                        v1 / "pids" / "layerstore" / "sb-1", v1 / "unified" / "layerstore" / "sb-1"]
    assert cgroups.dirs("sb-2", v1) == [] and cgroups.hierarchies(tmp_path / "none") == []
    assert cgroups.remove("sb-1", timeout=0, root=v1) == [] and cgroups.dirs("sb-1", v1) == []


def test_parse_procs() -> None:
    assert cgroups.parse_procs("12\n345\n\n") == {12, 345}
    assert cgroups.parse_procs("") == set()
    assert cgroups.sandbox_path("sb-1") == "/layerstore/sb-1"
