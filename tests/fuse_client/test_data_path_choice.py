"""Which data path a daemon takes (`fuse_client.daemon.data_path_choice`): the default `auto`
takes fanotify only where a service manager keeps the group, and the shim never hands its own
service manager's variables to the daemon it starts. The kernel probe is replaced here (the real
one is exercised by the fanotify mount tests)."""

from __future__ import annotations

import logging

import pytest

from fuse_client import daemon as node_daemon
from fuse_client.fanotify import kernel as fan_kernel
from layerstore.errors import ConfigError
from runtime_shim.supervise.daemon import SERVICE_MANAGER_ENV, daemon_environment

KEPT = {"FDSTORE": "4", "NOTIFY_SOCKET": "/run/systemd/notify"}


@pytest.fixture
def src(tmp_path):
    from testkit.fuse_helpers import make_tree

    return make_tree(tmp_path / "src", small=5)


@pytest.fixture
def kernel_has_events(monkeypatch):
    monkeypatch.setattr(fan_kernel, "probe", lambda where: None)


@pytest.fixture
def kernel_lacks_events(monkeypatch):
    monkeypatch.setattr(fan_kernel, "probe", lambda where: "no FAN_PRE_ACCESS (EINVAL)")


def choice(tmp_path, wanted=None, fmt="plain", env=None):
    return node_daemon.data_path_choice(tmp_path, wanted, fmt, env=env or {})


def test_the_default_is_fuse_without_a_keeper_of_the_group(tmp_path, kernel_has_events):
    path, why = choice(tmp_path)
    assert path == "fuse"
    assert "default" in why and "no service manager keeps the fanotify group" in why


def test_the_default_is_fanotify_with_an_fd_store_and_pre_content_events(tmp_path, kernel_has_events):
    path, why = choice(tmp_path, env=KEPT)
    assert path == "fanotify"
    assert "fd store (4 slots)" in why


def test_the_default_falls_back_to_fuse_where_the_kernel_lacks_events(tmp_path, kernel_lacks_events):
    path, why = choice(tmp_path, env=KEPT)
    assert path == "fuse" and "FAN_PRE_ACCESS" in why


@pytest.mark.parametrize("env", [
    {"FDSTORE": "0", "NOTIFY_SOCKET": "/run/systemd/notify"},  # FileDescriptorStoreMax=0: systemd drops them
    {"FDSTORE": "four", "NOTIFY_SOCKET": "/run/systemd/notify"},
    {"FDSTORE": "4"},  # nobody to send them to
    {"FDSTORE": "4", "NOTIFY_SOCKET": "relative/notify"},
    {"NOTIFY_SOCKET": "@abstract"},  # an old manager without $FDSTORE: not known to keep fds
])
def test_no_keeper_unless_the_manager_says_it_keeps_fds(tmp_path, kernel_has_events, env):
    assert node_daemon.group_keeper(env) is None
    assert choice(tmp_path, env=env)[0] == "fuse"


def test_an_abstract_notify_socket_with_slots_is_a_keeper():
    assert node_daemon.group_keeper({"FDSTORE": "2", "NOTIFY_SOCKET": "@/org/freedesktop/systemd1/notify"})


def test_fanotify_asked_for_without_a_keeper_is_taken_and_warned(tmp_path, kernel_has_events, caplog):
    with caplog.at_level(logging.WARNING, logger="layerstore.fuse.daemon"):
        path, why = choice(tmp_path, "fanotify")
    assert path == "fanotify" and why.startswith("fanotify asked for") and "kept by nobody" in why
    assert any("without a keeper" in r.getMessage() for r in caplog.records)


def test_fanotify_asked_for_where_the_kernel_lacks_events_is_refused(tmp_path, kernel_lacks_events):
    with pytest.raises(ConfigError, match="not available here"):
        choice(tmp_path, "fanotify", env=KEPT)


def test_the_environment_chooses_when_nothing_is_asked(tmp_path, kernel_has_events):
    assert choice(tmp_path, env={**KEPT, "LAYERSTORE_DATA_PATH": "fuse"}) == ("fuse", "fuse asked for")
    assert choice(tmp_path, "auto", env={"LAYERSTORE_DATA_PATH": "fuse"})[0] == "fuse"  # (no keeper)


@pytest.mark.parametrize("wanted", ["auto", "fanotify"])
def test_a_compressed_cache_is_always_fuse(tmp_path, kernel_has_events, wanted):
    path, why = choice(tmp_path, wanted, "zstd", env=KEPT)
    assert path == "fuse" and "compressed" in why


def test_a_bad_value_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="expected auto, fanotify or fuse"):
        choice(tmp_path, env={"LAYERSTORE_DATA_PATH": "fast"})


def test_the_shim_starts_its_daemon_without_its_service_managers_variables():
    env = {"PATH": "/usr/bin", "LAYERSTORE_DATA_PATH": "auto", **KEPT, "LISTEN_FDS": "1", "LISTEN_PID": "7",
           "LISTEN_FDNAMES": "x", "WATCHDOG_USEC": "1000"}
    got = daemon_environment(env)
    assert got == {"PATH": "/usr/bin", "LAYERSTORE_DATA_PATH": "auto"}
    assert not set(got) & set(SERVICE_MANAGER_ENV)


@pytest.mark.root
def test_a_daemon_under_an_fd_store_takes_fanotify_by_default_and_hands_the_group_over(
        backend, layer, tmp_path, monkeypatch):
    """A real daemon, no data path asked for: with a (stand-in) service manager that keeps fds it
    serves fanotify and its group goes to the fd store at the first attach; without one, FUSE."""
    from testkit.fanotify_helpers import NotifySocket, stop_holder
    from testkit.fuse_helpers import DaemonProcess

    from fuse_client.control import attach, detach

    monkeypatch.delenv("LAYERSTORE_DATA_PATH", raising=False)
    with DaemonProcess(backend.url, tmp_path / "plain-cache", tmp_path / "plain-mnt") as d:
        st = d.stats()
        assert st["data_path"] == "fuse" and "no service manager keeps" in st["data_path_reason"], st
    notify = NotifySocket(tmp_path / "notify.sock")
    cache = tmp_path / "cache"
    try:
        with DaemonProcess(backend.url, cache, tmp_path / "mnt",
                           env={"NOTIFY_SOCKET": str(notify.path), "FDSTORE": "4"}) as d:
            st = d.stats()
            assert st["data_path"] == "fanotify" and "fd store (4 slots)" in st["data_path_reason"], st
            attach(cache, layer.blob, "test")
            name, _fd = notify.receive()
            assert name.startswith("fanotify-")
            detach(cache, layer.blob, "test")
    finally:
        stop_holder(cache)
        notify.close()
