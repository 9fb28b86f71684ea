"""A store behind the project's HTTP store service (`layerctl serve`, `service/`), through httpx.

    http://host[:port][/prefix]   https://host[:port][/prefix]   http+unix://<%2F-encoded socket>[/prefix]

`prefix` is the path the service answers under (behind a reverse proxy, say); the wire is in
`http_wire` and docs/service.md. The token is `$LAYERSTORE_TOKEN`, else the entry for the
service's URL (or its host[:port]) in the credentials file (`$LAYERSTORE_CREDENTIALS`, else
`$XDG_CONFIG_HOME/layerstore/credentials.json`: a JSON object of URL -> token). HTTPS verifies the
service's certificate against the system's roots, or `$LAYERSTORE_CA_BUNDLE`.

The service does the checks (digests, framing, scopes); this client does what the Backend contract
asks of every backend: `max_size` is enforced from the answer's headers before its body is read
(the service is no more trusted than a bucket), a body shorter or longer than its headers is a
broken stream (retried), a range past the end is an empty read. Retries are the project's one
policy (`layerstore.retry`), driven by `is_temp_failure` (connection and protocol errors, 5xx and
429 answers); a conditional write that was retried and then refused (412) is checked against the
stored bytes, so a write whose first answer was lost is not reported as lost.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote as urlquote
from urllib.parse import unquote, urlsplit

import httpcore
import httpx

from ..errors import ConfigError, CorruptObject, LayerstoreError, NotFound, PermissionDenied, StoreUnavailable
from ..keys import validate, validate_prefix
from ..retry import RetryPolicy, is_temporary
from . import http_wire as wire
from .base import Backend, ObjectInfo

T = TypeVar("T")
DEFAULT_POOL = 32
DEFAULT_ATTEMPTS = 5
DELETE_BATCH = 1000
READ_SIZE = 1 << 20  # bytes a socket read of the object pool asks for (httpcore's own: 64 KiB)
READ_BATCH = 16  # keys a batched read asks for at a time (the service takes up to wire.MAX_BATCH_KEYS)
MAX_ERROR_BODY = 64 << 10
MAX_LIST_LINE = 8 << 10


class HttpBackend(Backend):
    def __init__(self, url: str, *, token: str | None = None, attempts: int = DEFAULT_ATTEMPTS,
                 connect_timeout: float = 5.0, read_timeout: float = 60.0, pool: int = DEFAULT_POOL,
                 transport: httpx.BaseTransport | None = None) -> None:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https", "http+unix") or not parts.netloc:
            raise ConfigError(f"malformed store service URL (want http(s)://host[:port][/prefix]): {url!r}")
        if parts.query or parts.fragment:
            raise ConfigError(f"store service URLs take no query or fragment: {url!r}")
        prefix = parts.path.rstrip("/")
        uds = None
        if scheme == "http+unix":
            uds = unquote(parts.netloc)
            if not uds.startswith("/"):
                raise ConfigError(f"http+unix URLs name an absolute socket path (%2F-encoded): {url!r}")
            base = "http://localhost" + prefix
        else:
            try:
                parts.port  # noqa: B018 - validates the port
            except ValueError:
                raise ConfigError(f"bad port in store URL {url!r}") from None
            base = f"{scheme}://{parts.netloc}{prefix}"
        self.url = url.rstrip("/")
        self.base = base
        self.token = token if token is not None else find_token(self.url, parts.netloc)
        self.policy = RetryPolicy(first=0.05, cap=2.0, attempts=attempts)
        self._uds = uds
        self._timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        self._pool = pool
        self._transport = transport  # tests: a fake service
        self._client: httpx.Client | None = None
        self._core: httpcore.ConnectionPool | None = None
        self._lock = threading.Lock()
        self.batched = True  # False once the service turned out to have no batched read

    # -- the client ----------------------------------------------------------------------
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> httpx.Client:
        verify: Any = self._ssl_context() if os.environ.get("LAYERSTORE_CA_BUNDLE") else True
        limits = httpx.Limits(max_connections=self._pool, max_keepalive_connections=self._pool)
        transport = self._transport or httpx.HTTPTransport(uds=self._uds, verify=verify, limits=limits, retries=0)
        return httpx.Client(base_url=self.base, transport=transport, timeout=self._timeout, headers=self._headers(),
                            trust_env=False)

    @property
    def core(self) -> httpcore.ConnectionPool | None:
        """The pool GETs of objects go through: httpcore, the library under httpx, without httpx's
        request and response models (half the client's CPU per chunk GET, docs/service.md); None
        when a transport was given (tests), then GETs take the httpx client."""
        if self._core is None and self._transport is None:
            with self._lock:
                if self._core is None:
                    self._core = httpcore.ConnectionPool(
                        ssl_context=self._ssl_context() if self.base.startswith("https:") else None,
                        max_connections=self._pool, max_keepalive_connections=self._pool, retries=0, uds=self._uds,
                        network_backend=LargeReads(READ_SIZE))
                    self._core_headers = [(k.encode(), v.encode()) for k, v in self._headers().items()]
                    t = self._timeout
                    self._core_ext = {"timeout": {"connect": t.connect, "read": t.read, "write": t.write,
                                                  "pool": t.pool}}
        return self._core

    def _ssl_context(self) -> Any:
        import ssl

        ca = os.environ.get("LAYERSTORE_CA_BUNDLE")
        return ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()

    def _headers(self) -> dict[str, str]:
        # identity: bodies are read raw (the objects are compressed already where it pays)
        headers = {"Accept-Encoding": "identity"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            core, self._core = self._core, None
        if client is not None:
            client.close()
        if core is not None:
            core.close()

    def is_temp_failure(self, e: BaseException) -> bool:
        if isinstance(e, (httpx.TransportError, httpx.StreamError, *CORE_TEMPORARY)):
            return True
        return is_temporary(e)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """One request under the retry policy; a transport failure that outlives it is a
        `StoreUnavailable`."""
        try:
            return self.policy.call(fn, self.is_temp_failure)
        except (httpx.TransportError, httpx.StreamError, *CORE_TEMPORARY) as e:
            raise StoreUnavailable(f"{what}: store service {self.url} unreachable: {type(e).__name__}: {e}") from None
        except httpx.InvalidURL as e:
            raise ConfigError(f"{what}: {e}") from None

    def _raise_for(self, resp: httpx.Response, what: str) -> None:
        if resp.status_code < 400:
            return
        body = b""
        if not resp.is_stream_consumed:
            for part in resp.iter_bytes():
                body += part
                if len(body) > MAX_ERROR_BODY:
                    break
        else:
            body = resp.content[:MAX_ERROR_BODY]
        raise wire.error_of(resp.status_code, body, what)

    @staticmethod
    def _path(key: str) -> str:
        return wire.OBJECTS + urlquote(validate(key), safe="/:@+=")

    # -- location ------------------------------------------------------------------------
    def create(self) -> None:
        def once() -> None:
            self._raise_for(self.client.post(wire.STORE), "create store")

        self._call("create store", once)

    def check(self) -> None:
        def once() -> None:
            self._raise_for(self.client.get(wire.STORE), "check store")

        self._call("check store", once)

    # -- objects -------------------------------------------------------------------------
    def load(self, key: str, offset: int = 0, size: int | None = None, *, max_size: int | None = None) -> bytes:
        path = self._path(key)
        if offset < 0 or (size is not None and size < 0):
            raise ValueError("negative offset or size")
        if size == 0:
            _check_length(key, self.size(key), max_size)
            return b""
        headers = {}
        if offset or size is not None:
            end = "" if size is None else str(offset + size - 1)
            headers["Range"] = f"bytes={offset}-{end}"
        what = f"object {key}"
        core = self.core

        def once() -> bytes:
            if core is not None:
                with core.stream("GET", self.base + path, headers=self._core_headers + [
                        (k.encode(), v.encode()) for k, v in headers.items()], extensions=self._core_ext) as raw:
                    return answer(CoreAnswer(raw))
            with self.client.stream("GET", path, headers=headers) as resp:
                return answer(resp)

        def answer(resp: Any) -> bytes:
            if resp.status_code == 416:
                return b""  # the range starts at or after the end: a POSIX read at EOF
            self._raise_for(resp, what)
            return _read_body(resp, key, offset, size, max_size, ranged=bool(headers))

        return self._call(what, once)

    def load_many(self, keys: Sequence[str], *, max_size: int | None = None
                  ) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        """Content-addressed objects `READ_BATCH` at a time in one request each (`POST /v1/batch`,
        docs/service.md), any other key with `load`. Every object comes back as a single GET
        would bring it (`max_size` checked before its body is read; its content is the caller's
        to check against its key), and is yielded as soon as it and those before it are in (the
        caller works on one while the next arrives, and holds no more than it wants to); an item
        the service could not read for a moment (5xx, 429) and a service without batched reads
        fall back to `load`, with its retries."""
        for start in range(0, len(keys), READ_BATCH):
            yield from self._window(list(keys[start : start + READ_BATCH]), max_size)

    def _window(self, window: list[str], max_size: int | None) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        """`load_many` of at most READ_BATCH keys: the content keys in one batch, each key yielded
        in its turn once its answer is in (at the end, by `load` if the batch did not bring it)."""
        batch = [k for k in dict.fromkeys(window) if _is_key(k) and wire.kind_of(k) in wire.CONTENT_KINDS]
        if len(batch) < 2 or not self.batched:
            batch = []
        last = {k: i for i, k in enumerate(window)}
        got: dict[str, bytes | LayerstoreError] = {}
        turn = 0

        def due(final: bool) -> Iterator[tuple[str, bytes | LayerstoreError]]:
            nonlocal turn
            while turn < len(window) and (final or window[turn] in got or window[turn] not in batch):
                key = window[turn]
                value = got.pop(key) if key in got else self._load_or_error(key, max_size)
                if last[key] != turn:
                    got[key] = value  # asked again later in the window
                turn += 1
                yield key, value

        for key, value in self._batch(batch, max_size):
            got[key] = value
            yield from due(False)
        yield from due(True)

    def _load_or_error(self, key: str, max_size: int | None) -> bytes | LayerstoreError:
        try:
            return self.load(key, max_size=max_size)
        except LayerstoreError as e:
            return e

    def _batch(self, keys: list[str], max_size: int | None) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        """The answers of batched reads of `keys` (distinct, content-addressed), as they come;
        keys left out are for `load` (a temporary failure of that item, or no batched read at
        this service). A broken answer is asked again for the keys it did not bring, under the
        retry policy."""
        done: set[str] = set()
        single: set[str] = set()
        sched = self.policy.schedule(time.monotonic())
        core = self.core
        while rest := [k for k in keys if k not in done and k not in single]:
            body = wire.batch_request(rest)
            try:
                if core is not None:
                    with core.stream("POST", self.base + wire.BATCH, content=body, extensions=self._core_ext,
                                     headers=[*self._core_headers, (b"Content-Type", b"application/json"),
                                              (b"Content-Length", b"%d" % len(body))]) as raw:
                        yield from self._frames(CoreAnswer(raw), rest, max_size, done, single)
                else:
                    with self.client.stream("POST", wire.BATCH, content=body,
                                            headers={"Content-Type": "application/json"}) as resp:
                        yield from self._frames(resp, rest, max_size, done, single)
            except NoBatch:
                self.batched = False
                return
            except Exception as e:
                if not self.is_temp_failure(e):
                    if not isinstance(e, LayerstoreError):
                        raise
                    for k in rest:
                        if k not in done and k not in single:
                            yield k, e
                    return
                delay = sched.next_delay(time.monotonic())
                if delay is None:
                    return  # what is left goes to `load`, which has its own retries
                time.sleep(delay)

    def _frames(self, resp: Any, rest: list[str], max_size: int | None, done: set[str],
                single: set[str]) -> Iterator[tuple[str, bytes | LayerstoreError]]:
        if resp.status_code in (404, 405):  # the route, not an object: the service predates batches
            raise NoBatch
        self._raise_for(resp, "batched read")
        if resp.headers.get("content-type", "").split(";")[0].strip() != wire.BATCH_TYPE:
            raise StoreUnavailable(f"batched read: the store service answered {resp.headers.get('content-type')!r}")
        frames = wire.BatchFrames(rest, max_size)
        try:
            for part in resp.iter_bytes():
                for key, status, data in frames.feed(part):
                    if status != 200:
                        err = wire.error_of(status, data, f"object {key}")
                        if self.is_temp_failure(err) or isinstance(err, wire.RangeNotSatisfiable):
                            single.add(key)
                            continue
                    done.add(key)
                    yield key, (data if status == 200 else err)
        except CorruptObject as e:  # an object larger than `max_size`: that key's answer, and a new request
            key = rest[frames.next]
            done.add(key)
            yield key, e
            return
        frames.check_done()
        if frames.next < len(rest):
            raise StoreUnavailable(f"batched read: {frames.next} of {len(rest)} objects, then the answer ended")

    def _put(self, key: str, data: bytes | memoryview, headers: dict[str, str]) -> bool:
        """PUT; False when the server says the condition does not hold (412)."""
        path = self._path(key)
        body = bytes(data)
        what = f"write {key}"
        tries = [0]

        def once() -> bool:
            tries[0] += 1
            resp = self.client.put(path, content=body, headers=headers)
            if resp.status_code == 412:
                return False
            self._raise_for(resp, what)
            return True

        done = self._call(what, once)
        if not done and tries[0] > 1:
            # An earlier try may have landed and only its answer been lost: ours if the bytes are.
            try:
                return self.load(key) == body
            except NotFound:
                return False
        return done

    def store_once(self, key: str, data: bytes | memoryview) -> bool:
        return self._put(key, data, {"If-None-Match": "*"})

    def replace(self, key: str, data: bytes) -> None:
        self._put(key, data, {})

    def replace_if(self, key: str, data: bytes, expected: bytes | None) -> bool:
        """Replace `key` with `data` if it holds exactly `expected` (None: if it does not exist)."""
        if expected is None:
            return self._put(key, data, {"If-None-Match": "*"})
        return self._put(key, data, {"If-Match": wire.quote(wire.etag_of(key, expected))})

    def _head(self, key: str) -> int | None:
        path = self._path(key)
        what = f"object {key}"

        def once() -> int | None:
            resp = self.client.head(path)
            if resp.status_code == 404:
                return None
            self._raise_for(resp, what)
            length = resp.headers.get("content-length", "")
            if not length.isdigit():
                raise StoreUnavailable(f"{what}: the store service sent no length")
            return int(length)

        return self._call(what, once)

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def size(self, key: str) -> int:
        n = self._head(key)
        if n is None:
            raise NotFound(f"object {key}: not found")
        return n

    def delete(self, key: str) -> None:
        path = self._path(key)
        what = f"delete {key}"

        def once() -> None:
            self._raise_for(self.client.delete(path), what)

        self._call(what, once)

    def delete_many(self, keys: Iterable[str]) -> int:
        removed = 0
        batch: list[str] = []

        def flush() -> int:
            def once() -> int:
                resp = self.client.post(wire.DELETE_MANY, json={"keys": batch})
                self._raise_for(resp, "delete many")
                try:
                    n = resp.json()["removed"]
                except (ValueError, KeyError, TypeError):
                    raise StoreUnavailable("delete many: malformed answer from the store service") from None
                if not isinstance(n, int):
                    raise StoreUnavailable("delete many: malformed answer from the store service")
                return n

            return self._call("delete many", once)

        for key in keys:
            batch.append(validate(key))
            if len(batch) >= DELETE_BATCH:
                removed += flush()
                batch = []
        if batch:
            removed += flush()
        return removed

    def list(self, prefix: str = "") -> Iterator[str]:
        for key, _size, _mtime in self._list(prefix, info=False):
            yield key

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for key, size, mtime in self._list(prefix, info=True):
            if size is None or mtime is None:
                raise StoreUnavailable(f"list {prefix}: the store service sent a key without its size")
            yield ObjectInfo(key, size, mtime)

    def _list(self, prefix: str, *, info: bool) -> Iterator[tuple[str, int | None, float | None]]:
        """The service streams the listing; one that breaks mid-way is asked again and the keys
        already yielded are skipped (order is not part of the contract, so no cursor)."""
        validate_prefix(prefix)
        seen: set[str] = set()
        sched = self.policy.schedule(time.monotonic())
        what = f"list {prefix or '/'}"
        while True:
            try:
                with self.client.stream("GET", wire.LIST, params={"prefix": prefix, "info": int(info)}) as resp:
                    self._raise_for(resp, what)
                    for line in _lines(resp):
                        entry = wire.parse_list_line(line)
                        if entry[0] in seen:
                            continue
                        if not entry[0].startswith(prefix):
                            raise StoreUnavailable(f"{what}: the store service listed {entry[0]!r}")
                        seen.add(entry[0])
                        yield entry
                return
            except Exception as e:
                if not self.is_temp_failure(e):
                    if isinstance(e, httpx.HTTPError):
                        raise StoreUnavailable(f"{what}: {e}") from None
                    raise
                delay = sched.next_delay(time.monotonic())
                if delay is None:
                    if isinstance(e, LayerstoreError):
                        raise
                    raise StoreUnavailable(f"{what}: store service {self.url} unreachable: {e}") from None
                time.sleep(delay)


class CoreAnswer:
    """An httpcore response seen through the part of httpx.Response's interface `_read_body` and
    `_raise_for` use."""

    def __init__(self, raw: httpcore.Response) -> None:
        self.raw = raw
        self.status_code = raw.status
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw.headers}
        self.is_stream_consumed = False

    def iter_bytes(self) -> Iterator[bytes]:
        self.is_stream_consumed = True
        for part in self.raw.iter_stream():
            if part:
                yield part


def _is_key(key: str) -> bool:
    try:
        validate(key)
    except LayerstoreError:
        return False  # `load` says why, as that key's answer
    return True


class LargeReads(httpcore.NetworkBackend):
    """httpcore's own blocking sockets, read up to `size` bytes at a time instead of 64 KiB: a
    1 MiB chunk in a few trips through h11 and the GIL rather than sixteen (docs/service.md)."""

    def __init__(self, size: int) -> None:
        self.inner = httpcore.SyncBackend()
        self.size = size

    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return LargeReadStream(self.inner.connect_tcp(*args, **kwargs), self.size)

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return LargeReadStream(self.inner.connect_unix_socket(*args, **kwargs), self.size)

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class LargeReadStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, size: int) -> None:
        self.inner = inner
        self.size = size

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max(max_bytes, self.size), timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, timeout)

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return LargeReadStream(self.inner.start_tls(*args, **kwargs), self.size)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class NoBatch(Exception):
    """The service has no batched read (an older one): objects are read one a request."""


CORE_TEMPORARY = (httpcore.NetworkError, httpcore.TimeoutException, httpcore.RemoteProtocolError)


def _read_body(resp: Any, key: str, offset: int, size: int | None, max_size: int | None,
               *, ranged: bool) -> bytes:
    """The body of a GET, bounded by what its headers announce and by `max_size` (checked before
    a byte of the body is read)."""
    length_h = resp.headers.get("content-length")
    length = int(length_h) if length_h and length_h.isdigit() else None
    total = length
    if resp.status_code == 206:
        total_s = resp.headers.get("content-range", "").rpartition("/")[2]
        total = int(total_s) if total_s.isdigit() else None
        if total is None:
            raise StoreUnavailable(f"object {key}: the store service sent a range without the object's length")
    _check_length(key, total, max_size)
    limit = length if length is not None else (max_size if max_size is not None else None)
    parts, got = [], 0
    for part in resp.iter_bytes():
        parts.append(part)
        got += len(part)
        if limit is not None and got > limit:
            if length is None:
                raise CorruptObject(f"object {key}: more than such an object can have ({max_size})")
            raise StoreUnavailable(f"object {key}: the store service sent more than it announced")
    if length is not None and got != length:
        raise StoreUnavailable(f"object {key}: body of {got} bytes, {length} announced (broken stream)")
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if ranged and resp.status_code == 200:
        # A server (or cache) that ignored the range sent the whole object.
        _check_length(key, len(data), max_size)
        data = data[offset:] if size is None else data[offset : offset + size]
    return data


def _lines(resp: httpx.Response) -> Iterator[bytes]:
    pending = b""
    for part in resp.iter_bytes():
        pending += part
        while True:
            line, sep, rest = pending.partition(b"\n")
            if not sep:
                break
            pending = rest
            if line:
                yield line
        if len(pending) > MAX_LIST_LINE:
            raise StoreUnavailable("a listing line from the store service is too long")
    if pending:
        raise httpx.RemoteProtocolError("listing cut mid-line")


def _check_length(key: str, length: int | None, max_size: int | None) -> None:
    if max_size is not None and length is not None and length > max_size:
        raise CorruptObject(f"object {key}: {length} bytes, more than such an object can have ({max_size})")


def credentials_path() -> Path:
    explicit = os.environ.get(wire.CREDENTIALS_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "layerstore" / "credentials.json"


def find_token(url: str, netloc: str) -> str | None:
    """`$LAYERSTORE_TOKEN`, else the credentials file's entry for `url` or its host[:port]."""
    token = os.environ.get(wire.TOKEN_ENV)
    if token:
        return token.strip()
    path = credentials_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PermissionDenied(f"cannot read credentials file {path}: {os.strerror(e.errno or 0)}") from None
    try:
        table = json.loads(raw)
    except ValueError:
        raise ConfigError(f"credentials file {path} is not JSON (want an object of URL -> token)") from None
    if not isinstance(table, dict):
        raise ConfigError(f"credentials file {path}: want an object of URL -> token")
    for name in (url, url.rstrip("/"), netloc):
        value = table.get(name)
        if isinstance(value, str) and value:
            return value.strip()
    return None
