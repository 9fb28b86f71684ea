"""Firecracker and Cloud Hypervisor configurations emitted from a `VmSpec` match each VMM's own
documented schema (the parts committed under tests/runtime_shim/data/, with their source and
version). Objects are validated closed (no property the schema does not name), which is stricter
than the schemas themselves but what Firecracker's parser does (it refuses unknown fields): a
misspelt field fails here instead of being ignored by a VMM. Only QEMU is booted on this node kind."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest

from runtime_shim.vm.spec import Drive, Pmem, Stream, VmSpec, VmSpecError
from runtime_shim.vm.vmm_configs import STREAM_PORT_BASE, cloud_hypervisor_config, emit_all, firecracker_config

DATA = Path(__file__).parent / "data"


def closed(schema: Any) -> Any:
    """Every object schema that lists properties gets `additionalProperties: false`."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def validator(name: str) -> Any:
    doc = json.loads((DATA / name).read_text())
    root = doc.pop("root")
    doc.pop("_source")
    return jsonschema_rs.Draft4Validator({"$ref": root, **closed(doc)})


FC = validator("firecracker-schema.json")
CH = validator("cloud-hypervisor-schema.json")


def spec(tmp: Path, machine: str = "microvm", pmem: bool = False) -> VmSpec:
    drives = [Drive(str(tmp / f"layer{i}.erofs"), serial=f"layer{i}") for i in range(3)]
    drives += [Drive(str(tmp / "upper.img"), read_only=False, role="upper", serial="upper"),
               Drive(str(tmp / "config.img"), role="config", serial="config", direct=True)]
    streams = tuple(Stream(n, str(tmp / f"{n}.sock")) for n in ("stdout", "stderr", "status"))
    return VmSpec(kernel="/k/vmlinuz", initrd="/k/initrd.img", cmdline="console=ttyS0 quiet", memory_mib=512,
                  vcpus=2, machine=machine, drives=tuple(drives), streams=streams,
                  console_log=str(tmp / "console.log"),
                  pmem=(Pmem(str(tmp / "root.erofs"), 4 << 20),) if pmem else ())


@pytest.mark.parametrize("machine,pmem", [("microvm", False), ("q35", True)])
def test_both_match_their_schema(tmp_path: Path, machine: str, pmem: bool) -> None:
    s = spec(tmp_path, machine, pmem)
    out = emit_all(s, kernel="/k/vmlinux")
    fc, ch = out["firecracker"], out["cloud-hypervisor"]
    assert list(FC.iter_errors(fc.config)) == []
    assert list(CH.iter_errors(ch.config)) == []
    # the same drives, in the same order, read-only exactly where the spec says
    assert [(d["drive_id"], d["path_on_host"], d["is_read_only"]) for d in fc.config["drives"]] == \
        [(d.serial, d.path, d.read_only) for d in s.drives]
    assert [(d["serial"], d["path"], d["readonly"], d["direct"]) for d in ch.config["disks"]] == \
        [(d.serial, d.path, d.read_only, d.direct) for d in s.drives]
    assert fc.config["boot-source"] == {"kernel_image_path": "/k/vmlinux", "initrd_path": "/k/initrd.img",
                                        "boot_args": "console=ttyS0 quiet"}
    assert ch.config["payload"] == {"kernel": "/k/vmlinux", "initramfs": "/k/initrd.img",
                                    "cmdline": "console=ttyS0 quiet"}
    assert fc.config["machine-config"]["mem_size_mib"] == 512 and ch.config["memory"]["size"] == 512 << 20
    assert fc.stream_ports == ch.stream_ports == {"stdout": STREAM_PORT_BASE, "stderr": STREAM_PORT_BASE + 1,
                                                  "status": STREAM_PORT_BASE + 2}
    assert fc.config["vsock"]["uds_path"] == ch.config["vsock"]["socket"] == str(tmp_path / "vsock.sock")
    assert ("pmem" in fc.config) is pmem and ("pmem" in ch.config) is pmem
    json.dumps(fc.config), json.dumps(ch.config)


def test_the_validators_can_fail(tmp_path: Path) -> None:
    s = spec(tmp_path)
    fc = firecracker_config(s).config
    ch = cloud_hypervisor_config(s).config
    for doc, v, edit in [
        (fc, FC, lambda d: d["drives"][0].pop("drive_id")),
        (fc, FC, lambda d: d["machine-config"].update(vcpu_count=0)),
        (fc, FC, lambda d: d["drives"][0].update(read_only=True)),  # misspelt: is_read_only
        (fc, FC, lambda d: d["drives"][0].update(cache_type="Writethrough")),
        (ch, CH, lambda d: d.pop("payload")),
        (ch, CH, lambda d: d["disks"][0].update(readonly="yes")),
        (ch, CH, lambda d: d["serial"].update(mode="Telnet")),
        (ch, CH, lambda d: d["vsock"].update(cid=2)),
    ]:
        bad = copy.deepcopy(doc)
        edit(bad)
        assert not v.is_valid(bad), bad


def test_refusals(tmp_path: Path) -> None:
    s = spec(tmp_path)
    odd = VmSpec(kernel=s.kernel, initrd=None, cmdline="", drives=(Drive("/x/l.erofs", serial="layer-0"),))
    with pytest.raises(VmSpecError):
        firecracker_config(odd)
    assert cloud_hypervisor_config(odd).config["disks"][0]["serial"] == "layer-0"
    writable = VmSpec(kernel=s.kernel, initrd=None, cmdline="", drives=(Drive("/x/l", read_only=False, serial="l"),))
    with pytest.raises(VmSpecError):
        cloud_hypervisor_config(writable)
    with pytest.raises(VmSpecError):
        firecracker_config(s, vsock_uds="relative.sock")
    bare = VmSpec(kernel=s.kernel, initrd=None, cmdline="")
    fc = firecracker_config(bare).config
    assert "vsock" not in fc and "initrd_path" not in fc["boot-source"]
    assert list(FC.iter_errors(firecracker_config(bare).config)) == []
    assert list(CH.iter_errors(cloud_hypervisor_config(bare).config)) == []
