"""Pure units of the runtime shim: overlay options, mount(8) helper argv, OCI config, mountinfo."""

from __future__ import annotations

import pytest

from layerstore.errors import BadInput, ConfigError
from runtime_shim import bundle, mountinfo, overlay
from runtime_shim.commit import committed_layers, layer_entries
from runtime_shim.environment import LayerSpec
from runtime_shim.errors import ShimError
from runtime_shim.mount_helper import parse_mount_argv, parse_umount_argv
from runtime_shim.paths import check_sandbox_id, new_sandbox_id, resolve_node_dir


def test_overlay_options_stack_top_first() -> None:
    opts = overlay.options(["/n/layers/ws", "/n/layers/tk", "/n/layers/base"], "/n/s/up", "/n/s/work")
    assert opts.startswith("lowerdir=/n/layers/ws:/n/layers/tk:/n/layers/base,upperdir=/n/s/up,workdir=/n/s/work")
    assert "redirect_dir=off" in opts and "metacopy=off" in opts and "index=off" in opts


@pytest.mark.parametrize("bad", ["/a,b", "/a:b", "/a b", "/a\\b"])
def test_overlay_refuses_paths_it_cannot_express(bad: str) -> None:
    with pytest.raises(ConfigError):
        overlay.options([bad], "/u", "/w")


def test_overlay_needs_a_layer_and_at_most_500() -> None:
    with pytest.raises(ShimError):
        overlay.options([], "/u", "/w")
    with pytest.raises(ShimError):
        overlay.options([f"/l{i}" for i in range(501)], "/u", "/w")


def test_node_dir_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAYERSTORE_NODE_DIR", raising=False)
    assert str(resolve_node_dir()) == "/var/lib/layerstore"
    monkeypatch.setenv("LAYERSTORE_NODE_DIR", "/srv/node")
    assert str(resolve_node_dir()) == "/srv/node"
    assert str(resolve_node_dir("/x/y")) == "/x/y"
    with pytest.raises(ConfigError):
        resolve_node_dir("/x,y")


def test_sandbox_ids() -> None:
    assert check_sandbox_id("task-1.a_b") == "task-1.a_b"
    for bad in ("", ".trash", "../x", "a/b", "x" * 129):
        with pytest.raises(ConfigError):
            check_sandbox_id(bad)
    assert new_sandbox_id() != new_sandbox_id()


def test_mount_helper_argv_as_mount8_passes_it() -> None:
    req = parse_mount_argv(["bb:1", "/mnt/x", "-n", "-o", "rw,sandbox=s1,upper=/u/s1,eager,node_dir=/n"])
    assert (req.env, req.target, req.sandbox, req.upper, req.node_dir, req.eager) == \
        ("bb:1", "/mnt/x", "s1", "/u/s1", "/n", True)
    assert req.ignored == ["rw"]
    req = parse_mount_argv(["-sfv", "-o", "whatever=1,sandbox=s2", "b3:" + "0" * 64, "/t", "-t", "layerstore"])
    assert req.fake and req.verbose and req.sandbox == "s2" and req.ignored == ["whatever=1"]
    assert parse_mount_argv(["e:1", "/t", "-osandbox=a"]).sandbox == "a"


@pytest.mark.parametrize("argv", [["only-one"], ["a", "b", "c"], ["a", "b", "-o", "bogus=1"], ["a", "b", "-x"],
                                  ["a", "b", "-o", "ro"]])
def test_mount_helper_bad_argv(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_mount_argv(argv)


def test_umount_helper_argv() -> None:
    assert parse_umount_argv(["/mnt/x", "-n", "-t", "overlay"]) == "/mnt/x"
    with pytest.raises(ConfigError):
        parse_umount_argv(["-l"])


def test_oci_config_defaults() -> None:
    cfg = bundle.oci_config("/n/s/rootfs", ["/bin/sh"], env=["PATH=/bin"], hostname="sb-1")
    assert cfg["root"] == {"path": "/n/s/rootfs", "readonly": False}
    assert cfg["process"]["user"] == {"uid": 0, "gid": 0}
    assert {n["type"] for n in cfg["linux"]["namespaces"]} == {"pid", "ipc", "uts", "mount", "network"}
    assert not any(n.get("path") for n in cfg["linux"]["namespaces"])  # new namespaces, loopback only
    dests = {m["destination"] for m in cfg["mounts"]}
    assert {"/proc", "/dev", "/sys", "/tmp"} <= dests
    assert all(m["type"] != "bind" for m in cfg["mounts"])  # nothing of the node is bound in


def test_process_args_and_env() -> None:
    conf = {"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo hi"], "env": ["A=1"]}
    assert bundle.process_args(conf, None) == ["/bin/sh", "-c", "echo hi"]
    assert bundle.process_args(conf, ["echo bye"]) == ["/bin/sh", "-c", "echo bye"]
    assert bundle.process_env(conf)[0].startswith("PATH=")
    assert bundle.process_env({"env": ["PATH=/x"]}, ["B=2"]) == ["PATH=/x", "B=2"]
    with pytest.raises(BadInput):
        bundle.process_args({"entrypoint": [], "cmd": []}, None)


def test_parse_user() -> None:
    passwd = "root:x:0:0::/:/bin/sh\napp:x:1000:1001::/:/bin/sh\n"
    group = "root:x:0:\nstaff:x:50:\n"
    assert bundle.parse_user("", passwd, group) == (0, 0)
    assert bundle.parse_user("app", passwd, group) == (1000, 1001)
    assert bundle.parse_user("1000", passwd, group) == (1000, 1001)
    assert bundle.parse_user("app:staff", passwd, group) == (1000, 50)
    assert bundle.parse_user("7:8", "", "") == (7, 8)
    with pytest.raises(BadInput):
        bundle.parse_user("ghost", passwd, group)


def test_mountinfo_parse() -> None:
    lines = [
        "30 1 0:25 / / rw - ext4 /dev/vda1 rw\n",
        "40 30 0:40 / /n/layers/ab rw,relatime - erofs /n/fuse/blobs/b3:ab ro\n",
        "41 30 0:41 / /n/with\\040space rw - overlay overlay rw,lowerdir=/a,upperdir=/u,workdir=/w\n",
    ]
    mounts = mountinfo.parse(lines)
    assert mounts["/n/layers/ab"].fstype == "erofs"
    assert mounts["/n/with space"].options.endswith("workdir=/w")
    assert [m.mountpoint for m in mountinfo.under(mounts, "/n")] == ["/n/layers/ab", "/n/with space"]


def test_committed_layers_stack_the_new_workspace_on_top() -> None:
    base, tk, ws = LayerSpec("b3:" + "1" * 64, 1, "base"), LayerSpec("b3:" + "2" * 64, 2, "toolkit"), \
        LayerSpec("b3:" + "3" * 64, 3, "workspace")
    out = committed_layers([base, tk, ws], "b3:" + "4" * 64, 4, LayerSpec)
    assert [(x.blob[3], x.role) for x in out] == [("1", "base"), ("2", "toolkit"), ("3", "toolkit"),
                                                   ("4", "workspace")]
    assert committed_layers([base, tk], tk.blob, 2, LayerSpec) == (base, tk)


def test_layer_entries_keep_only_opaque() -> None:
    class E:
        def __init__(self, xattrs: dict[bytes, bytes]) -> None:
            self.xattrs = xattrs

    entries = [(E({b"trusted.overlay.opaque": b"y", b"trusted.overlay.origin": b"\0", b"user.a": b"1"}), None),
               (E({b"trusted.overlay.impure": b"y"}), None)]
    out = [e.xattrs for e, _ in layer_entries(entries)]
    assert out == [{b"user.a": b"1", b"trusted.overlay.opaque": b"y"}, {}]
