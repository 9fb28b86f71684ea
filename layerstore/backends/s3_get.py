"""A GetObject that skips botocore's request pipeline: the S3 backend's hot read.

botocore spends about 1.3 ms of CPU on every request around the bytes (measured on a 1 MiB GET
from RGW: event hooks, endpoint rule resolution, request and response model handling, a
dateutil parse of Last-Modified), more than the fetch path's own work on the chunk. A node
cold-reading from S3 makes one GET per chunk, so this is its largest CPU cost (docs/s3-backend.md,
"CPU per GB read"). This module makes the same signed request directly: botocore's own SigV4
signer (`S3SigV4Auth`) over the backend's own credentials (refreshed by botocore as they
expire), sent through urllib3 (botocore's own HTTP library) with the backend's pool size and
timeouts, the body read in one call into one buffer (http.client allocates the declared length
once and fills it from the socket).

It answers the success case (200, 206) and the store's temporary failures (5xx, 429: raised as
the `ClientError` botocore would raise, from the error document's Code and Message, so that a
throttling store gets no more requests than before). Any other status returns None and the
caller asks botocore the same request again, so those answers (404, 403, 416, redirects...) are
parsed, classified and translated by the one path that always did it.

There is no transport checksum to check: botocore checks none on a plain GET either
(`response_checksum_validation = when_required`, set by the backend), and every chunk is
verified by its blake3 id against the signed digest above this layer, so a CRC would check the
same bytes twice.

It is used only where its request is the one botocore would send: a custom path-style endpoint
(RGW, MinIO), SigV4, no proxy from the environment, credentials present (else botocore's path
reports what is missing). AWS's virtual-hosted endpoints keep botocore's path.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import quote, urlsplit

OK = (200, 206)
MAX_ERROR_BODY = 64 << 10  # an S3 error document is a few hundred bytes
_ERROR_FIELDS = {name: re.compile(rf"<{name}>([^<]{{0,512}})</{name}>") for name in ("Code", "Message")}
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")


class BodyTooLong(Exception):
    """The object's length (headers or body) is above the caller's limit."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length


class BodyCutShort(Exception):
    """The connection ended before the length the headers declared: temporary, asked again."""


def usable(endpoint: str | None, path_style: bool, signature_version: str | None) -> bool:
    """May the direct GET replace botocore's for this endpoint and signature version?"""
    if not endpoint or not path_style or any(os.environ.get(v) for v in _PROXY_VARS):
        return False
    if signature_version not in (None, "s3v4", "v4"):
        return False  # e.g. an old server configured for SigV2 ("s3"): botocore signs that
    return urlsplit(endpoint).scheme in ("http", "https")


class DirectGet:
    """Signed GetObject requests over one urllib3 pool; thread-safe (urllib3 pools are, the
    signer is made per request, frozen credentials are immutable)."""

    def __init__(self, endpoint: str, bucket: str, region: str, credentials: Any, *, pool: int,
                 connect_timeout: float, read_timeout: float, ca_bundle: str | None) -> None:
        import urllib3
        from botocore.httpsession import get_cert_path

        self._base = f"{endpoint.rstrip('/')}/{bucket}/"
        self._path = f"{urlsplit(endpoint).path.rstrip('/')}/{bucket}/"
        self._region = region
        self._credentials = credentials
        kwargs: dict[str, Any] = {}
        if urlsplit(endpoint).scheme == "https":
            kwargs["ca_certs"] = ca_bundle or get_cert_path(True)
        # One host: its connection pool itself (a PoolManager would parse every URL again).
        self._http = urllib3.connection_from_url(endpoint, maxsize=pool, retries=False,
                                                 timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
                                                 **kwargs)

    def get(self, name: str, range_header: str | None, max_size: int | None) -> bytes | None:
        """The object's bytes (or the range's); botocore's `ClientError` for a 5xx or 429; None
        for any other status (the caller then asks botocore). Raises `BodyTooLong` before
        reading a body longer than `max_size` (judged by the whole object's length in the
        headers, and by the bytes themselves when the headers say nothing), `BodyCutShort` when
        fewer bytes than declared arrive, and urllib3's errors for a connection that fails."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        quoted = quote(name, safe="/~")
        headers = {"Range": range_header} if range_header else {}
        request = AWSRequest(method="GET", url=self._base + quoted, headers=headers)
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(request)
        resp = self._http.urlopen("GET", self._path + quoted, headers=dict(request.headers.items()),
                                  preload_content=False, decode_content=False, redirect=False, retries=False)
        try:
            if resp.status not in OK:
                if resp.status >= 500 or resp.status == 429:
                    raise server_error(resp.status, resp.reason, resp.read(MAX_ERROR_BODY))
                resp.close()  # not drained: an error body can be as long as its sender likes
                return None
            declared = resp.headers.get("Content-Length")
            length = int(declared) if declared is not None and declared.isdigit() else None
            if max_size is not None:
                total = object_length(resp.headers.get("Content-Range"), length)
                if total is not None and total > max_size:
                    resp.close()  # never read the body: drop the connection
                    raise BodyTooLong(total)
            if length is None:
                # No declared length (chunked): read at most one byte past the limit.
                data = resp.read() if max_size is None else resp.read(max_size + 1)
                if max_size is not None and len(data) > max_size:
                    resp.close()
                    raise BodyTooLong(len(data))
                return data
            data = resp.read()  # one allocation of the declared length, filled from the socket
            if len(data) != length:
                raise BodyCutShort(f"the body ended after {len(data)} of {length} bytes")
            return data
        finally:
            if resp.status not in OK:
                resp.close()
            resp.release_conn()

    def close(self) -> None:
        self._http.close()


def object_length(content_range: str | None, content_length: int | None) -> int | None:
    """The whole object's length: the total of a Content-Range (a ranged GET), else the
    Content-Length; None when the server sent neither."""
    total = str(content_range or "").rpartition("/")[2]
    if total.isdigit():
        return int(total)
    return content_length


def server_error(status: int, reason: str | None, body: bytes) -> Exception:
    """The `ClientError` botocore raises for a GetObject answered `status` with this error
    document (its Code and Message; the status and reason when there is none)."""
    from botocore.exceptions import ClientError

    text = body.decode("utf-8", "replace")
    fields = {name: m.group(1) if (m := pattern.search(text)) else None for name, pattern in _ERROR_FIELDS.items()}
    error = {"Code": fields["Code"] or str(status), "Message": fields["Message"] or (reason or "")}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
