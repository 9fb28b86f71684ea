"""The contenders, each with the same small surface (open, mount -> (handle, root), unmount, close,
state_bytes): a plain overlay of directories, and the runtime shim's API in a long-lived process."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import project
from .probes import TimedLock
from .spec import ENV_TAG


class Plain:
    """mkdir upper/work/root + one overlay mount(2) of the three layer directories. The roots are
    on a mount of their own (a private bind mount of WORK/plain-roots, made by the session), as the
    shim's are: overlayfs walks every child mount of the mounts its upper and lowers are on at
    each mount(2), so roots mounted beside them would make each mount O(mounted) in the kernel.
    Each sandbox's directory is made in WORK/plain for every round and client, as the shim's are in
    NODE/sandboxes: a directory that grows to 30,000 entries once is cheaper to fill again (ext4
    keeps its blocks), and a new one per round made the bare overlay pay that growth each round and
    the shim only in its first (the ids differ between rounds and clients)."""

    name = "plain-overlay"

    def __init__(self, work: Path, trees: dict[str, Path]) -> None:
        self.root = work / "plain"
        self.roots = work / "plain-roots"
        self.root.mkdir(parents=True, exist_ok=True)
        self.lowers = ":".join(str(trees[r]) for r in ("workspace", "toolkit", "base"))

    def open(self) -> None:
        pass

    def mount(self, i: str) -> tuple[str, str]:
        linux = project.linux()

        d = self.root / i
        d.mkdir()
        up, wk, rt = d / "upper", d / "work", self.roots / i
        up.mkdir()
        wk.mkdir()
        rt.mkdir()
        linux.mount("overlay", rt, "overlay", 0, f"lowerdir={self.lowers},upperdir={up},workdir={wk},"
                       "redirect_dir=off,metacopy=off,index=off")
        return i, str(rt)

    def unmount(self, handle: str) -> None:
        linux = project.linux()

        linux.umount(self.roots / handle)
        os.rmdir(self.roots / handle)
        shutil.rmtree(self.root / handle)

    def close(self) -> None:
        pass

    def state_bytes(self) -> dict[str, int]:
        return {}


class Api:
    """`Shim.mount(tag)` in a long-lived process; `fsync` re-adds a flush per state transaction."""

    name = "layerstore-api"

    def __init__(self, node: Path, store: str, *, fsync: bool = False) -> None:
        self.node, self.store, self.fsync = node, store, fsync
        self.shim: Any = None
        self.request: Any = None
        self.lock: TimedLock | None = None
        if fsync:
            self.name = "layerstore-api-fsync"

    def open(self) -> None:
        self.shim = project.shim_class().for_node(self.node, self.store)
        self.request = project.mount_request_class()
        self.lock = self.shim.lock = TimedLock(self.shim.lock)
        if self.fsync:
            state = self.shim.state
            plain_write = state.write

            @contextlib.contextmanager
            def synced_write() -> Iterator[Any]:
                with plain_write() as t:
                    yield t
                state.sync()

            state.write = synced_write

    def mount(self, i: str) -> tuple[str, str]:
        sb = self.shim.mount(self.request(ENV_TAG, sandbox=f"c{i}"))
        return sb.id, sb.target

    def unmount(self, handle: str) -> None:
        self.shim.unmount(handle)

    def close(self) -> None:
        if self.shim is not None:
            self.shim.close()
            self.shim = None

    def state_bytes(self) -> dict[str, int]:
        with project.node_state_class()(self.node / "state") as st:
            return st.size()


def make_contender(kind: str, cfg: dict[str, Any]) -> Plain | Api:
    if kind == "plain-overlay":
        return Plain(Path(cfg["work"]), {k: Path(v) for k, v in cfg["trees"].items()})
    return Api(Path(cfg["node"]), cfg["store"], fsync=kind == "layerstore-api-fsync")
