"""The generated containerd API stubs and the Kubernetes CRI subset's (snapshotter/api), generated
first if they are missing or older than their .proto files (a checkout where `make deps` has not
run yet)."""

from __future__ import annotations

from . import protoc

protoc.generate()

from .api import (  # noqa: E402
    content_pb2,
    content_pb2_grpc,
    cri_pb2,
    cri_pb2_grpc,
    diff_pb2,
    diff_pb2_grpc,
    images_pb2,
    images_pb2_grpc,
    leases_pb2,
    leases_pb2_grpc,
    snapshots_pb2,
    snapshots_pb2_grpc,
    types_pb2,
)

__all__ = ["content_pb2", "content_pb2_grpc", "cri_pb2", "cri_pb2_grpc", "diff_pb2", "diff_pb2_grpc", "images_pb2",
           "images_pb2_grpc", "leases_pb2", "leases_pb2_grpc", "snapshots_pb2", "snapshots_pb2_grpc", "types_pb2"]
