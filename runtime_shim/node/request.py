"""`MountRequest`: what one `Shim.mount` is asked to compose (pure; checked when made)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ShimError
from ..resolve.environment import EnvSpec


@dataclass(frozen=True, slots=True)
class MountRequest:
    """A sandbox's root to compose at `target` (default NODE/roots/<id>).

    `env`: an environment reference (resolved by the shim's resolver) or a resolved `EnvSpec`.
    `sandbox`: the sandbox id (default: a new one). A new sandbox gets a fresh upper under the node
    directory; an id whose directory already exists is refused unless `upper` is passed
    explicitly (resume). An explicit upper is the caller's: it is never deleted, and it is refused
    while another sandbox uses it.
    `eager`: every chunk of every layer is on the node before the root is mounted.
    `utab_entry`: record the root in /run/mount/utab so that `umount TARGET` tears the sandbox
    down (see `utab`); for mount(8)-style callers.
    `upper_size`: the upper and work directories of a new (shim-owned) upper go on a tmpfs of that
    many bytes of its own (NODE/sandboxes/<id>/scratch): a sandbox that fills it gets ENOSPC, the
    node disk keeps its space; the upper lives in memory and does not survive a reboot (for
    sandboxes that are not kept). None: on the node disk, unlimited.
    `upper_image`: the same quota for a sandbox that is kept, on the node disk: a sparse ext4 image
    of that many bytes (NODE/sandboxes/<id>/upper.img) loop-mounted at the same place; it survives
    a reboot (recovery mounts it again before the overlay). Not with `upper_size`; ignored with an
    explicit `upper` (the caller's upper stays where it is). Refused (`NodeFull`) when the node
    disk's free space cannot hold it together with what the other kept uppers may still take
    (`overlay.reserve_upper_image`, under the node lock).
    `nosuid`, `nodev`: the root's mount flags (both on unless relaxed).
    `userns`: the sandbox gets an id range of its own (`idmap`; recorded as `Sandbox.userns`): its
    layers are stacked as idmapped clones and its upper is owned by the range's root, for a
    backend to run it in a user namespace of that mapping. Only for a shim-owned upper (a caller's
    upper, written under another mapping or none, keeps host ids: no userns).
    `guest`: the name of a VM backend whose guest composes the root itself (`Sandbox.backend`):
    the layers are mounted (shared and counted as for any sandbox: each layer mount's file, the
    daemon's lazily fetched one or a pinned complete cache file, is what the VM reads as a drive)
    but no overlay is made and `target` stays unmounted; `upper_image` then makes the sandbox's
    upper drive (a sparse ext4 image at NODE/sandboxes/<id>/upper.img, never mounted on the host),
    and without it the guest keeps its upper in its own memory. Not with `upper`, `upper_size`,
    `utab_entry` or `userns`.

    Contradictory or impossible options raise `ShimError` here, before the shim resolves or
    locks anything."""

    env: str | EnvSpec
    target: str | os.PathLike[str] | None = None
    sandbox: str | None = None
    upper: str | os.PathLike[str] | None = None
    eager: bool = False
    utab_entry: bool = False
    upper_size: int | None = None
    upper_image: int | None = None
    nosuid: bool = True
    nodev: bool = True
    userns: bool = False
    guest: str | None = None

    def __post_init__(self) -> None:
        if self.upper_size is not None and self.upper_size <= 0:
            raise ShimError(f"upper size {self.upper_size}: want a positive number of bytes (None: no quota)")
        if self.upper_image is not None and (self.upper_image <= 0 or self.upper_size is not None):
            raise ShimError(f"upper image size {self.upper_image}: want a positive number of bytes, without upper_size")
        if self.guest is not None and (self.upper is not None or self.upper_size is not None or self.utab_entry
                                       or self.userns):
            raise ShimError("a sandbox composed in a guest takes no host upper, upper size, utab entry or userns")

    @property
    def image_size(self) -> int | None:
        """The upper image to make: none for an explicit upper (the caller's: it stays where it is)."""
        return None if self.upper is not None else self.upper_image

    @property
    def scratch(self) -> bool:
        """The sandbox's upper goes on a size-limited filesystem of its own (tmpfs or image)."""
        return self.upper_size is not None or self.image_size is not None
