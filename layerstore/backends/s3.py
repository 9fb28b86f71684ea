"""A store in an S3 bucket (boto3): Ceph RGW, AWS S3, MinIO.

Objects live under `<prefix>/<key>` in one bucket. Credentials, region, retry mode and attempts
come from the standard boto3 sources (environment, `~/.aws/config`, instance metadata); the
store URL's `endpoint=` and `region=` override them. See docs/s3-backend.md.

- `store_once` is a PUT with `If-None-Match: *`: the server creates the object only if the key is
  free (412 for the others), so of several concurrent writers exactly one wins. A server that
  rejects the header (501) switches this backend to HEAD-then-PUT, which has a race window: two
  writers can both see the key free and both write (last write wins, both return True). Objects
  above `multipart_threshold` go up in parts; the completion carries `If-None-Match: *` too, but
  some servers (RGW 16.2 among them) ignore it there, so the same window exists for large objects.
  For content-addressed keys both writers carry identical bytes, so the window only skews stats.
- `replace` is a plain PUT: S3 makes a whole object visible atomically.
- `replace_if` (compare-and-swap, for tags) is a conditional PUT: `If-None-Match: *` to create,
  else GET (the bytes must be the expected ones) then PUT with `If-Match: <that ETag>`, 412 for
  the loser. A server that rejects conditional writes gets no compare-and-swap (ConfigError).
- Retries are decided by the project's one policy (`layerstore.retry`: exponential backoff with
  full jitter, `max_attempts` tries, from the constructor, else AWS_MAX_ATTEMPTS / ~/.aws/config,
  else 5); botocore's own retries are off so that nothing retries twice. This backend only says
  what a temporary failure is (`is_temp_failure`: throttling, 5xx, connection and timeout errors,
  a body that broke mid-stream, a conflicting conditional write). A failure that outlives the
  retries raises `StoreUnavailable`. Listings go page by page, each page retried on its own, so a
  listing resumes where it failed instead of starting over.

One boto3 client is shared by every thread (clients are thread-safe; sessions are not, so the
session is used only to build the client, under a lock). Object reads on a custom path-style
endpoint skip botocore's per-request pipeline (`s3_get.DirectGet`: botocore's SigV4 signer,
urllib3, about half the CPU per GET); a 5xx or 429 becomes botocore's own `ClientError`, any
other answer but 200/206 is asked again through botocore, so errors are classified and
translated in one place (docs/s3-backend.md, "CPU per GB read").
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

from ..errors import ConfigError, CorruptObject, LayerstoreError, NotFound, PermissionDenied, StoreUnavailable
from ..keys import validate, validate_prefix
from ..retry import RetryPolicy, is_temporary
from .base import Backend, ObjectInfo
from .s3_get import BodyCutShort, BodyTooLong, DirectGet, object_length, usable

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_MULTIPART_THRESHOLD = 64 * MiB
DEFAULT_PART_SIZE = 16 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's floor for every part but the last
DEFAULT_MAX_ATTEMPTS = 5  # total attempts, when neither the environment nor ~/.aws/config says
DEFAULT_POOL = 32
DELETE_BATCH = 1000  # S3's limit of keys per DeleteObjects
BACKOFF_FIRST = 0.1  # seconds: the first retry waits up to this, doubling up to BACKOFF_CAP
BACKOFF_CAP = 5.0
T = TypeVar("T")

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchUpload"}
_NO_BUCKET = {"NoSuchBucket"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
           "AccountProblem", "InvalidToken", "ExpiredToken", "UserSuspended"}
_TRANSIENT = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeTooSkewed",
              "Throttling", "ThrottlingException", "TooManyRequests", "OperationAborted"}


class S3Backend(Backend):
    def __init__(self, bucket: str, prefix: str = "", endpoint: str | None = None, region: str | None = None,
                 *, multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD, part_size: int = DEFAULT_PART_SIZE,
                 max_attempts: int | None = None, max_pool_connections: int = DEFAULT_POOL,
                 connect_timeout: float = 5.0, read_timeout: float = 60.0, page_size: int = 1000,
                 direct_get: bool = True) -> None:
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ConfigError(f"bad S3 bucket name {bucket!r} (3-63 of a-z 0-9 . -)")
        prefix = prefix.strip("/")
        if prefix:
            try:
                validate(prefix)
            except LayerstoreError:
                raise ConfigError(f"bad S3 key prefix {prefix!r}") from None
        if endpoint is not None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"bad S3 endpoint {endpoint!r} (want http(s)://host[:port])")
        if part_size < MIN_PART_SIZE or multipart_threshold < part_size:
            raise ConfigError("S3 part size must be >= 5 MiB and <= the multipart threshold")
        if page_size < 1 or max_pool_connections < 1 or (max_attempts is not None and max_attempts < 1):
            raise ConfigError("S3 page size, pool size and attempts must be positive")
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint
        self.region = region
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.page_size = page_size
        self._max_attempts = max_attempts
        self._policy: RetryPolicy | None = None
        self._pool = max_pool_connections
        self._timeouts = (connect_timeout, read_timeout)
        self._client: Any = None
        # Set with the client where a direct GET can replace botocore's (see `s3_get`).
        self._direct: DirectGet | None = None
        self._direct_wanted = direct_get  # False: every GET through botocore (tests of that path)
        self._lock = threading.Lock()
        # Cleared the first time the server rejects `If-None-Match` (see `store_once`).
        self._conditional_put = True
        # Whether the server wants If-Match's ETag without quotes (see `replace_if`).
        self._if_match_bare = False
        query = {k: v for k, v in (("endpoint", endpoint), ("region", region)) if v}
        self.url = f"s3://{bucket}/{prefix}" + (f"?{urlencode(query)}" if query else "")
        self._where = f"s3://{bucket}" + (f" at {endpoint}" if endpoint else "")

    # -- the client ----------------------------------------------------------------------
    @property
    def client(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        import boto3
        import botocore.session
        from botocore.config import Config

        # A private session per client: sessions are not thread-safe, the client built from one is.
        core = botocore.session.Session()
        session = boto3.session.Session(botocore_session=core)
        attempts = self._max_attempts or core.get_config_variable("max_attempts")
        self._policy = RetryPolicy(first=BACKOFF_FIRST, cap=BACKOFF_CAP, attempts=int(attempts or DEFAULT_MAX_ATTEMPTS))
        kwargs: dict[str, Any] = {
            "retries": {"mode": "standard", "total_max_attempts": 1},  # retried by `self.policy` only
            "max_pool_connections": self._pool,
            "connect_timeout": self._timeouts[0],
            "read_timeout": self._timeouts[1],
        }
        custom_endpoint = self.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if custom_endpoint:
            # RGW and MinIO route by path; virtual hosts would need DNS for every bucket.
            kwargs["s3"] = {"addressing_style": "path"}
        # Newer botocore adds CRC checksums (and aws-chunked trailers) that older S3 servers refuse;
        # the store verifies every object by its blake3 id anyway. An explicit setting wins.
        for var in ("request_checksum_calculation", "response_checksum_validation"):
            if not _configured(core, var):
                kwargs[var] = "when_required"
        region = self.region or core.get_config_variable("region") or "us-east-1"
        try:
            client = session.client("s3", endpoint_url=self.endpoint, region_name=region, config=Config(**kwargs))
        except ValueError as e:
            raise ConfigError(f"bad S3 configuration for {self.url}: {e}") from None
        # Object reads skip botocore's per-request pipeline where the request is plain to make
        # (s3_get: about half the CPU of a 1 MiB GET). The same session's credentials, refreshed
        # by botocore; no credentials: botocore's path says what is missing.
        credentials = core.get_credentials()
        endpoint_url = client.meta.endpoint_url
        if self._direct_wanted and credentials is not None and usable(endpoint_url, "s3" in kwargs,
                                                                       client.meta.config.signature_version):
            self._direct = DirectGet(endpoint_url, self.bucket, client.meta.region_name, credentials,
                                     pool=self._pool, connect_timeout=self._timeouts[0],
                                     read_timeout=self._timeouts[1], ca_bundle=core.get_config_variable("ca_bundle"))
        return client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            direct, self._direct = self._direct, None
        if client is not None:
            client.close()
        if direct is not None:
            direct.close()

    @property
    def policy(self) -> RetryPolicy:
        if self._policy is None:
            self.client  # noqa: B018 - building the client reads the configured attempts
        assert self._policy is not None
        return self._policy

    def is_temp_failure(self, e: BaseException) -> bool:
        from botocore.exceptions import ClientError, HTTPClientError, ResponseStreamingError
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from urllib3.exceptions import HTTPError as Urllib3Error

        if isinstance(e, ClientError):
            code = _code(e)
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code == "NotImplemented" or status == 501:
                return False  # e.g. conditional writes unsupported: asking again changes nothing
            return code in _TRANSIENT or code == "ConditionalRequestConflict" or status >= 500 or status == 429
        if isinstance(e, BotoConnectionError | HTTPClientError | ResponseStreamingError | OSError | Urllib3Error
                      | BodyCutShort):
            return True  # urllib3's and BodyCutShort: the direct GET's broken connections and bodies
        return is_temporary(e)

    def _retry(self, fn: Callable[[], T]) -> T:
        """Run one request under the retry policy; what fails is raised as botocore raised it."""
        return self.policy.call(fn, self.is_temp_failure)

    def _name(self, key: str) -> str:
        validate(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- error translation ---------------------------------------------------------------
    def _call(self, what: str, operation: str, /, **kwargs: Any) -> Any:
        """Run one S3 request; every failure (building the client included) leaves as one of
        the project's errors."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self._retry(lambda: getattr(self.client, operation)(**kwargs))
        except ClientError as e:
            raise self._translate(e, what) from None
        except BotoCoreError as e:
            raise self._translate_core(e, what) from None

    def _translate(self, e: Any, what: str) -> LayerstoreError:
        err = e.response.get("Error", {})
        code = str(err.get("Code") or "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        detail = err.get("Message") or code or f"HTTP {status}"
        if code in _NO_BUCKET:
            return NotFound(f"bucket {self.bucket} does not exist ({self._where})")
        if code in _NOT_FOUND or status == 404:
            return NotFound(f"{what}: not found")
        if code in _DENIED or status == 403:
            return PermissionDenied(f"{what}: access denied by {self._where} ({detail})")
        if code in _TRANSIENT or status >= 500 or status == 429:
            return StoreUnavailable(f"{what}: {self._where} failed after retries ({detail})")
        return LayerstoreError(f"{what}: {self._where} refused the request ({detail})")

    def _translate_core(self, e: Exception, what: str) -> LayerstoreError:
        from botocore.exceptions import (
            ConnectionError as BotoConnectionError,
        )
        from botocore.exceptions import (
            HTTPClientError,
            NoCredentialsError,
            NoRegionError,
            PartialCredentialsError,
            ProfileNotFound,
            ResponseStreamingError,
        )

        if isinstance(e, NoCredentialsError):
            return PermissionDenied(f"{what}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                    "or configure a profile)")
        if isinstance(e, (PartialCredentialsError, NoRegionError, ProfileNotFound)):
            return ConfigError(f"{what}: {e}")
        from urllib3.exceptions import HTTPError as Urllib3Error

        if isinstance(e, (BotoConnectionError, HTTPClientError, ResponseStreamingError, Urllib3Error, BodyCutShort)):
            return StoreUnavailable(f"{what}: S3 endpoint {self.endpoint or 'for ' + self._where} unreachable: {e}")
        return StoreUnavailable(f"{what}: {self._where}: {e}")

    # -- location ------------------------------------------------------------------------
    def create(self) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region and self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._retry(lambda: self.client.create_bucket(**kwargs))
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code == "BucketAlreadyExists":
                raise PermissionDenied(f"bucket {self.bucket} belongs to another account ({self._where})") from None
            if code != "BucketAlreadyOwnedByYou":
                raise self._translate(e, f"create bucket {self.bucket}") from None
        except BotoCoreError as e:
            raise self._translate_core(e, f"create bucket {self.bucket}") from None
        self.check()

    def check(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._retry(lambda: self.client.head_bucket(Bucket=self.bucket))
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404 or e.response.get("Error", {}).get("Code") in _NO_BUCKET:
                raise NotFound(f"store {self.url} does not exist: no bucket {self.bucket} "
                               "(run `layerctl store init`)") from None
            raise self._translate(e, f"bucket {self.bucket}") from None
        except BotoCoreError as e:
            raise self._translate_core(e, f"bucket {self.bucket}") from None

    # -- objects -------------------------------------------------------------------------
    def load(self, key: str, offset: int = 0, size: int | None = None, *, max_size: int | None = None) -> bytes:
        name = self._name(key)
        if offset < 0 or (size is not None and size < 0):
            raise ValueError("negative offset or size")
        if size == 0:
            length = self.size(key)  # still NotFound for a missing object
            _check_length(key, length, max_size)
            return b""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": name}
        if offset or size is not None:
            end = "" if size is None else str(offset + size - 1)
            kwargs["Range"] = f"bytes={offset}-{end}"
        return self._get(key, kwargs, max_size)

    def _get(self, key: str, kwargs: dict[str, Any], max_size: int | None) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError as Urllib3Error

        what = f"object {key}"

        def once() -> bytes:
            client, direct = self.client, self._direct
            if direct is not None:
                try:
                    data = direct.get(kwargs["Key"], kwargs.get("Range"), max_size)
                except BodyTooLong as e:
                    _check_length(key, e.length, max_size)
                    raise
                if data is not None:
                    return data
                # Not 200/206 (nor 5xx/429, raised above): botocore asks again and parses,
                # classifies and raises the answer.
            try:
                resp = client.get_object(**kwargs)
            except ClientError as e:
                if _code(e) == "InvalidRange":
                    return b""  # the range starts at or after the end: a POSIX read at EOF
                raise
            body = resp["Body"]
            try:
                if max_size is None:
                    return body.read()  # may break mid-stream: retried like the request
                # The object's length, from the headers, before the body is read: a hostile or
                # tampered endpoint cannot make us allocate more than `max_size` (a body longer
                # than its headers said is cut at max_size + 1 and refused too).
                _check_length(key, _object_length(resp), max_size)
                data = body.read(max_size + 1)
                _check_length(key, len(data), max_size)
                return data
            finally:
                body.close()

        try:
            return self._retry(once)
        except ClientError as e:
            raise self._translate(e, what) from None
        except (BotoCoreError, OSError, Urllib3Error, BodyCutShort) as e:
            raise self._translate_core(e, what) from None

    def store_once(self, key: str, data: bytes | memoryview) -> bool:
        name = self._name(key)
        if len(data) > self.multipart_threshold:
            # Uploading a large object only to be told it exists is waste: look first.
            if self.exists(key):
                return False
            return self._multipart(name, key, data, create_once=True)
        if self._conditional_put:
            try:
                self._put(name, key, data, conditional=True)
                return True
            except _PreconditionFailed:
                return False
            except _ConditionalRejected:
                log.warning("%s rejects If-None-Match on PUT; create-once falls back to HEAD then PUT",
                            self._where)
                self._conditional_put = False
        if self.exists(key):
            return False
        self._put(name, key, data, conditional=False)
        return True

    def replace(self, key: str, data: bytes) -> None:
        name = self._name(key)
        if len(data) > self.multipart_threshold:
            self._multipart(name, key, data, create_once=False)
        else:
            self._put(name, key, data, conditional=False)

    def replace_if(self, key: str, data: bytes, expected: bytes | None) -> bool:
        """Compare-and-swap with S3's conditional PUT: `If-None-Match: *` to create, else the
        current object is read (it must be `expected`) and replaced with `If-Match: <its ETag>`,
        so a write that landed in between makes this one fail (412) instead of overwriting it.
        A server without conditional writes is refused: there is no safe fallback.

        RGW 16.2 matches `If-Match` against the ETag without its quotes (and refuses the quoted
        form that AWS takes): after a 412 whose object still has the ETag we read, the other form
        is tried, and the form that worked is kept for this backend's later calls."""
        name = self._name(key)
        if expected is None:
            return self._put_if(key, {"Bucket": self.bucket, "Key": name, "Body": data, "IfNoneMatch": "*"})
        try:
            resp = self._call(f"object {key}", "get_object", Bucket=self.bucket, Key=name)
        except NotFound:
            return False
        body = resp["Body"]
        try:
            current = body.read(len(expected) + 1)
        finally:
            body.close()
        if current != expected:
            return False
        etag = str(resp["ETag"]).strip('"')
        forms = [etag, f'"{etag}"'] if self._if_match_bare else [f'"{etag}"', etag]
        for i, form in enumerate(forms):
            if self._put_if(key, {"Bucket": self.bucket, "Key": name, "Body": data, "IfMatch": form}):
                self._if_match_bare = form == etag
                return True
            if i == 0:
                try:
                    now = str(self._call(f"object {key}", "head_object", Bucket=self.bucket, Key=name)["ETag"])
                except NotFound:
                    return False
                if now.strip('"') != etag:
                    return False  # really changed in between
        return False

    def _put_if(self, key: str, kwargs: dict[str, Any]) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._retry(lambda: self.client.put_object(**kwargs))
        except ClientError as e:
            try:
                _raise_if_conditional(e, True)
            except _PreconditionFailed:
                return False
            except _ConditionalRejected:
                raise ConfigError(f"{self._where} does not do conditional writes: no compare-and-swap of "
                                  f"{key}") from None
            raise self._translate(e, f"write {key}") from None
        except BotoCoreError as e:
            raise self._translate_core(e, f"write {key}") from None
        return True

    def _put(self, name: str, key: str, data: bytes | memoryview, *, conditional: bool) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": name, "Body": _as_bytes(data)}
        if conditional:
            kwargs["IfNoneMatch"] = "*"
        try:
            self._retry(lambda: self.client.put_object(**kwargs))  # conflicting conditional writes: again
        except ClientError as e:
            _raise_if_conditional(e, conditional)
            raise self._translate(e, f"write {key}") from None
        except BotoCoreError as e:
            raise self._translate_core(e, f"write {key}") from None

    def _multipart(self, name: str, key: str, data: bytes | memoryview, *, create_once: bool) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        view = memoryview(data)
        what = f"write {key}"
        upload = self._call(what, "create_multipart_upload", Bucket=self.bucket, Key=name)["UploadId"]
        done = False
        try:
            parts = []
            for number, off in enumerate(range(0, len(view), self.part_size), start=1):
                resp = self._call(what, "upload_part", Bucket=self.bucket, Key=name, UploadId=upload,
                                  PartNumber=number, Body=bytes(view[off : off + self.part_size]))
                parts.append({"ETag": resp["ETag"], "PartNumber": number})
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": name, "UploadId": upload,
                                      "MultipartUpload": {"Parts": parts}}
            if create_once and self._conditional_put:
                kwargs["IfNoneMatch"] = "*"
            elif create_once and self.exists(key):
                return False
            try:
                self._retry(lambda: self.client.complete_multipart_upload(**kwargs))
            except ClientError as e:
                try:
                    _raise_if_conditional(e, "IfNoneMatch" in kwargs)
                except _PreconditionFailed:
                    return False
                except _ConditionalRejected:
                    self._conditional_put = False
                    kwargs.pop("IfNoneMatch")
                    if self.exists(key):
                        return False
                    self._call(what, "complete_multipart_upload", **kwargs)
                    done = True
                    return True
                raise self._translate(e, what) from None
            except BotoCoreError as e:
                raise self._translate_core(e, what) from None
            done = True
            return True
        finally:
            if not done:
                # Parts of an abandoned upload are invisible but cost space until aborted.
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
                except Exception:  # noqa: BLE001 - best effort; a bucket lifecycle rule is the backstop
                    log.warning("could not abort multipart upload %s of %s", upload, key)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def size(self, key: str) -> int:
        resp = self._call(f"object {key}", "head_object", Bucket=self.bucket, Key=self._name(key))
        return int(resp["ContentLength"])

    def delete(self, key: str) -> None:
        name = self._name(key)
        # S3 deletes succeed for missing keys; the contract wants NotFound, so look first.
        # Two concurrent deletes of one key may therefore both succeed.
        self.size(key)
        self._call(f"delete {key}", "delete_object", Bucket=self.bucket, Key=name)

    def list(self, prefix: str = "") -> Iterator[str]:
        for info in self.list_info(prefix):
            yield info.key

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base + prefix, "MaxKeys": self.page_size}
        while True:
            page = self._call(f"list {prefix or '/'}", "list_objects_v2", **kwargs)  # one page, retried alone
            for obj in page.get("Contents", ()):
                key = obj["Key"][len(base):]
                try:
                    validate(key)
                except LayerstoreError:
                    continue  # not one of ours (a foreign object in a shared bucket)
                yield ObjectInfo(key, int(obj.get("Size", 0)), obj["LastModified"].timestamp())
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            kwargs["ContinuationToken"] = token

    def delete_many(self, keys: Iterable[str]) -> int:
        """DeleteObjects, up to 1,000 keys a request (S3's limit), each batch retried alone.
        S3 reports a key that was already gone as deleted, so the count includes those."""
        removed = 0
        batch: list[str] = []
        for key in keys:
            batch.append(self._name(key))
            if len(batch) == DELETE_BATCH:
                removed += self._delete_batch(batch)
                batch = []
        if batch:
            removed += self._delete_batch(batch)
        return removed

    def _delete_batch(self, names: list[str]) -> int:
        resp = self._call(f"delete {len(names)} objects", "delete_objects", Bucket=self.bucket,
                          Delete={"Objects": [{"Key": n} for n in names], "Quiet": True})
        errors = [e for e in resp.get("Errors", ()) if e.get("Code") not in _NOT_FOUND]
        if errors:
            first = errors[0]
            raise StoreUnavailable(f"delete {first.get('Key')}: {self._where} refused ({first.get('Code')}: "
                                   f"{first.get('Message')}); {len(errors)} of {len(names)} not deleted")
        return len(names)


class _PreconditionFailed(Exception):
    pass


class _ConditionalRejected(Exception):
    pass


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code") or "")


def _raise_if_conditional(e: Any, conditional: bool) -> None:
    """Sort out the answers to `If-None-Match: *`: 412 means the key exists; 501 (or a 400 that
    names the header) means the server does not do conditional writes."""
    if not conditional:
        return
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = _code(e)
    if status == 412 or code == "PreconditionFailed":
        raise _PreconditionFailed
    message = str(e.response.get("Error", {}).get("Message") or "")
    if status == 501 or code == "NotImplemented" or (status == 400 and "If-None-Match" in message):
        raise _ConditionalRejected


def _object_length(resp: dict[str, Any]) -> int | None:
    """The whole object's length from botocore's parsed GET response (see `object_length`)."""
    length = resp.get("ContentLength")
    return object_length(resp.get("ContentRange"), int(length) if length is not None else None)


def _check_length(key: str, length: int | None, max_size: int | None) -> None:
    if max_size is not None and length is not None and length > max_size:
        raise CorruptObject(f"object {key}: {length} bytes, more than such an object can have ({max_size})")


def _configured(core: Any, var: str) -> bool:
    """Did the environment or the config file set `var` (as opposed to botocore's default)?"""
    if os.environ.get("AWS_" + var.upper()):
        return True
    try:
        return var in core.get_scoped_config()
    except Exception:  # noqa: BLE001 - e.g. a named profile that does not exist: boto3 reports it later
        return False


def _as_bytes(data: bytes | memoryview) -> bytes:
    return data if isinstance(data, bytes) else bytes(data)
