"""Errors of the control API itself (registered by name, so the blocking client raises the same
class again: `layerstore.errors.from_wire`)."""

from __future__ import annotations

from layerstore.errors import LayerstoreError


class DataPathUnavailable(LayerstoreError):
    """`POST /attach` to a daemon that serves the FUSE data path only (no fanotify pre-content
    events on this kernel, or forced with LAYERSTORE_DATA_PATH=fuse)."""

    exit_code = 2
    http_status = 409
