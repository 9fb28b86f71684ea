"""A client of containerd's gRPC API (the parts a pull needs): content, leases, images, snapshots
and diff, in one namespace, optionally under a lease. gRPC statuses become the project's errors
(`SnapshotExists` for ALREADY_EXISTS, `SnapshotNotFound` for NOT_FOUND, `NodeUnavailable` when
containerd does not answer)."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import grpc
from google.protobuf import field_mask_pb2

from layerstore.errors import BadInput, LayerstoreError, NodeUnavailable

from . import stubs as api
from .errors import SnapshotExists, SnapshotNotFound, SnapshotPrecondition
from .snapshots import Mount

T = TypeVar("T")
WRITE_CHUNK = 1 << 20  # under gRPC's default 4 MiB message limit
LEASE_EXPIRE = "containerd.io/gc.expire"


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int

    def proto(self) -> Any:
        return api.types_pb2.Descriptor(media_type=self.media_type, digest=self.digest, size=self.size)


def _translate(e: grpc.RpcError, what: str) -> LayerstoreError:
    code, detail = e.code(), e.details() or ""
    msg = f"containerd: {what}: {detail}"
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return SnapshotExists(msg)
    if code == grpc.StatusCode.NOT_FOUND:
        return SnapshotNotFound(msg)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return SnapshotPrecondition(msg)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return BadInput(msg)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return NodeUnavailable(msg)
    return LayerstoreError(msg)


class ContainerdClient:
    def __init__(self, address: str | os.PathLike[str], namespace: str = "default", timeout: float = 120.0) -> None:
        self.address = os.fspath(address)
        self.namespace = namespace
        self.timeout = timeout
        self.lease = ""
        self.channel = grpc.insecure_channel(f"unix://{os.path.abspath(self.address)}")
        self.content = api.content_pb2_grpc.ContentStub(self.channel)
        self.leases = api.leases_pb2_grpc.LeasesStub(self.channel)
        self.images = api.images_pb2_grpc.ImagesStub(self.channel)
        self.snapshots = api.snapshots_pb2_grpc.SnapshotsStub(self.channel)
        self.diff = api.diff_pb2_grpc.DiffStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ContainerdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _md(self) -> list[tuple[str, str]]:
        md = [("containerd-namespace", self.namespace)]
        if self.lease:
            md.append(("containerd-lease", self.lease))
        return md

    def _call(self, what: str, fn: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        try:
            return fn(request, metadata=self._md(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise _translate(e, what) from None  # type: ignore[arg-type]

    # -- leases --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def leased(self, expire: float = 3600.0) -> Iterator[str]:
        """A lease for what is written meanwhile (it expires on its own if we die), deleted after."""
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + expire))
        lid = f"layerctl-{secrets.token_hex(8)}"
        req = api.leases_pb2.CreateRequest(id=lid, labels={LEASE_EXPIRE: until})
        self._call("create lease", self.leases.Create, req)
        self.lease = lid
        try:
            yield lid
        finally:
            self.lease = ""
            with contextlib.suppress(LayerstoreError):
                self._call("delete lease", self.leases.Delete, api.leases_pb2.DeleteRequest(id=lid))

    def lease_snapshot(self, snapshotter: str, key: str) -> None:
        """Add a snapshot to the current lease (`leased`): containerd's garbage collector keeps it
        while the lease lives, even once nothing else references it (a container deleted with
        --keep-snapshot, before its upper is committed)."""
        if not self.lease:
            raise BadInput("lease_snapshot needs a lease (use leased())")
        res = api.leases_pb2.Resource(id=key, type=f"snapshots/{snapshotter}")
        self._call(f"lease snapshot {key}", self.leases.AddResource,
                   api.leases_pb2.AddResourceRequest(id=self.lease, resource=res))

    def collect_garbage(self) -> None:
        """Run containerd's garbage collection now and wait for it (containerd collects when a
        lease is deleted with `sync`: a throwaway lease is made and deleted so)."""
        lid = f"layerctl-gc-{secrets.token_hex(8)}"
        md = [("containerd-namespace", self.namespace)]
        try:
            self.leases.Create(api.leases_pb2.CreateRequest(id=lid), metadata=md, timeout=self.timeout)
            self.leases.Delete(api.leases_pb2.DeleteRequest(id=lid, sync=True), metadata=md, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _translate(e, "garbage collection") from None  # type: ignore[arg-type]

    # -- content -------------------------------------------------------------------------------
    def content_info(self, digest: str) -> dict[str, str] | None:
        """The labels of a blob in the content store (None: not there)."""
        try:
            res = self._call("content info", self.content.Info, api.content_pb2.InfoRequest(digest=digest))
        except SnapshotNotFound:
            return None
        return dict(res.info.labels)

    def write_content(self, digest: str, size: int, data: bytes | IO[bytes], labels: dict[str, str]) -> None:
        """Store a blob (verified by containerd against `digest`), with labels; a blob already
        there gets the labels added."""
        have = self.content_info(digest)
        if have is not None:
            if any(have.get(k) != v for k, v in labels.items()):
                info = api.content_pb2.Info(digest=digest, labels={**have, **labels})
                mask = field_mask_pb2.FieldMask(paths=[f"labels.{k}" for k in labels])
                req = api.content_pb2.UpdateRequest(info=info, update_mask=mask)
                self._call("content update", self.content.Update, req)
            return
        ref = f"layerctl-{digest}"

        def requests() -> Iterator[Any]:
            yield api.content_pb2.WriteContentRequest(action=api.content_pb2.STAT, ref=ref, total=size, expected=digest)
            offset = 0
            if isinstance(data, bytes | bytearray):
                chunks: Iterator[bytes] = (bytes(data[i:i + WRITE_CHUNK]) for i in range(0, len(data), WRITE_CHUNK))
            else:
                chunks = iter(lambda: data.read(WRITE_CHUNK), b"")
            for chunk in chunks:
                yield api.content_pb2.WriteContentRequest(action=api.content_pb2.WRITE, ref=ref, offset=offset,
                                                          data=chunk)
                offset += len(chunk)
            yield api.content_pb2.WriteContentRequest(action=api.content_pb2.COMMIT, ref=ref, total=size, offset=offset,
                                                  expected=digest, labels=labels)

        try:
            for res in self.content.Write(requests(), metadata=self._md(), timeout=self.timeout):
                if res.action == api.content_pb2.COMMIT and res.digest and res.digest != digest:
                    raise BadInput(f"containerd stored {res.digest}, not {digest}")
        except grpc.RpcError as e:
            err = _translate(e, f"write {digest}")  # type: ignore[arg-type]
            if not isinstance(err, SnapshotExists):  # (written meanwhile by someone else)
                raise err from None

    # -- images --------------------------------------------------------------------------------
    def put_image(self, name: str, target: Descriptor, labels: dict[str, str] | None = None) -> None:
        image = api.images_pb2.Image(name=name, target=target.proto(), labels=labels or {})
        try:
            self._call("create image", self.images.Create, api.images_pb2.CreateImageRequest(image=image))
        except SnapshotExists:
            mask = field_mask_pb2.FieldMask(paths=["target", "labels"])
            req = api.images_pb2.UpdateImageRequest(image=image, update_mask=mask)
            self._call("update image", self.images.Update, req)

    def image_target(self, name: str) -> Descriptor | None:
        try:
            res = self._call("get image", self.images.Get, api.images_pb2.GetImageRequest(name=name))
        except SnapshotNotFound:
            return None
        t = res.image.target
        return Descriptor(t.media_type, t.digest, t.size)

    # -- snapshots -----------------------------------------------------------------------------
    def stat(self, snapshotter: str, key: str) -> bool:
        try:
            req = api.snapshots_pb2.StatSnapshotRequest(snapshotter=snapshotter, key=key)
            self._call("stat", self.snapshots.Stat, req)
        except SnapshotNotFound:
            return False
        return True

    def prepare(self, snapshotter: str, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        req = api.snapshots_pb2.PrepareSnapshotRequest(snapshotter=snapshotter, key=key, parent=parent, labels=labels)
        res = self._call(f"prepare {key}", self.snapshots.Prepare, req)
        return [Mount(m.type, m.source, tuple(m.options)) for m in res.mounts]

    def commit(self, snapshotter: str, name: str, key: str, labels: dict[str, str]) -> None:
        req = api.snapshots_pb2.CommitSnapshotRequest(snapshotter=snapshotter, name=name, key=key, labels=labels)
        self._call(f"commit {key}", self.snapshots.Commit, req)

    def remove(self, snapshotter: str, key: str) -> None:
        self._call(f"remove {key}", self.snapshots.Remove,
                   api.snapshots_pb2.RemoveSnapshotRequest(snapshotter=snapshotter, key=key))

    def apply(self, layer: Descriptor, mounts: list[Mount]) -> str:
        """Unpack a layer from the content store into mounts (containerd's differ); the diff id."""
        req = api.diff_pb2.ApplyRequest(diff=layer.proto(), mounts=[api.types_pb2.Mount(type=m.type, source=m.source,
                                                                                 options=list(m.options))
                                                                 for m in mounts])
        return str(self._call(f"apply {layer.digest}", self.diff.Apply, req).applied.digest)
