"""A client for OCI distribution (registry v2) servers over httpx: pull and push of manifests and
blobs, with the registry token auth flow. The registry is untrusted: whatever it sends is
size-capped while it is read and checked against the digest asked for before anyone uses it.

The API (small and stable; `layerctl build docker://...`, `env create --from` and the
containerd snapshotter's `ctr push` use it):

    ref = Reference.parse("127.0.0.1:5000/team/busybox:1")     # or ...@sha256:<hex>
    with RegistryClient(ref.registry) as reg:                  # credentials and transport: below
        body, media_type, digest = reg.get_manifest(ref.repository, ref.reference)
        reg.fetch_blob(ref.repository, "sha256:...", dest, max_size=N)   # dest: a path or a file
        reg.blob_exists(ref.repository, "sha256:...")          # HEAD
        reg.push_blob(ref.repository, path_or_bytes, "sha256:...")       # skips a blob already there
        reg.put_manifest(ref.repository, "1", body, media_type)           # -> the manifest's digest

`RegistryClient(registry, *, insecure=None, auth=AUTO, timeout=60.0, chunk_size=...)`:
- `insecure`: speak plain HTTP. None decides: yes for a loopback host (localhost, 127.0.0.0/8,
  ::1, as Docker does) or one listed in $LAYERSTORE_INSECURE_REGISTRIES (comma-separated
  HOST[:PORT]); otherwise HTTPS with certificates verified (against $LAYERSTORE_REGISTRY_CA, else
  $SSL_CERT_FILE, else the system's CAs; proxies from the environment are not used).
- `auth`: `Credentials(username, password)`, None (anonymous only) or AUTO: from
  $LAYERSTORE_REGISTRY_USER/$LAYERSTORE_REGISTRY_PASSWORD, else the docker-style config file
  ($REGISTRY_AUTH_FILE, $DOCKER_CONFIG/config.json, ~/.docker/config.json: `auths[HOST].auth`,
  or its `username`/`password`); anonymous when none has an entry (`credentials_for`).

Auth flow (as Docker and containerd): each request goes out with what the client holds for its
repository scope; a 401 `WWW-Authenticate: Bearer realm,service,scope` gets a token from the
realm (with basic credentials when there are some) and the request is sent once more; a `Basic`
challenge is answered with the credentials. Tokens are cached per scope. Credentials and tokens
go only to the registry's own origin and to an HTTPS realm (or a plain-HTTP realm on an insecure
host); a redirect (blob downloads often go to object storage) is followed without them, and never
from HTTPS to HTTP.

Errors are the project's: `NotFound` (404, unknown name/tag/blob), `PermissionDenied` (401/403
after the auth flow), `StoreUnavailable` (no connection, timeouts, 429/5xx; retried a few times
first), `BadInput` (anything the registry sends that is malformed, over its limit or not what was
asked for), `ConfigError` (a bad reference).

References and media types live in `registry_names` (pure), settings and credentials in
`registry_auth`; their public names are re-exported here, so `erofs_builder.sources.registry` is the one
import a caller needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx

from layerstore.errors import BadInput, ConfigError, LayerstoreError, NotFound, PermissionDenied, StoreUnavailable
from layerstore.retry import RetryPolicy, is_temporary

from .registry_auth import (
    Credentials,
    auth_file,
    credentials_for,
    is_insecure,
    is_loopback,
    parse_challenge,
    tls_verify,
)
from .registry_names import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    MANIFEST_MEDIA_TYPES,
    MAX_MANIFEST,
    OCI_INDEX,
    OCI_MANIFEST,
    Reference,
    check_digest,
    check_manifest_ref,
    check_repository,
    is_digest,
    registry_host_ok,
    sha256_digest,
)

MAX_TOKEN_RESPONSE = 1 << 20
MAX_ERROR_BODY = 64 << 10
MAX_REDIRECTS = 5
CHUNK_SIZE = 16 << 20  # pushes of larger blobs go in PATCH chunks of this size
RETRY = RetryPolicy(first=0.2, cap=2.0, attempts=3)


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


AUTO: Any = _Auto()



def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


class _Capped:
    """Collects a response body, refusing it past `limit` bytes (whatever Content-Length says)."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what, self.parts, self.size = limit, what, [], 0

    def feed(self, response: httpx.Response) -> bytes:
        for part in response.iter_raw(1 << 16):
            self.size += len(part)
            if self.size > self.limit:
                raise BadInput(f"{self.what}: the registry sent more than {self.limit} bytes (the limit)")
            self.parts.append(part)
        return b"".join(self.parts)


class RegistryClient:
    """One registry (HOST[:PORT]); see the module docstring."""

    def __init__(self, registry: str, *, insecure: bool | None = None, auth: Credentials | None = AUTO,
                 timeout: float = 60.0, chunk_size: int = CHUNK_SIZE,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not registry_host_ok(registry):
            raise ConfigError(f"bad registry host {registry[:200]!r}")
        self.registry = registry
        self.insecure = is_insecure(registry) if insecure is None else insecure
        self.base = f"{'http' if self.insecure else 'https'}://{registry}"
        self.credentials = credentials_for(registry) if auth is AUTO else auth
        self.chunk_size = chunk_size
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                 follow_redirects=False, transport=transport, trust_env=False, verify=tls_verify(),
                                 # bytes as stored: what the digest covers (no decompression bombs)
                                 headers={"Accept-Encoding": "identity"})
        self.tokens: dict[str, str] = {}  # scope -> bearer token
        self.basic = False  # the registry asked for basic credentials

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # -- reading --------------------------------------------------------------------------------
    def get_manifest(self, repo: str, ref: str, *, max_size: int = MAX_MANIFEST,
                     accept: tuple[str, ...] = MANIFEST_MEDIA_TYPES) -> tuple[bytes, str, str]:
        """The manifest (or index) `ref` (a tag or a digest): its bytes, media type and digest,
        checked against `ref` when it is a digest (and against Docker-Content-Digest when sent)."""
        check_repository(repo)
        check_manifest_ref(ref)
        what = f"{self.registry}/{repo}: manifest {ref}"

        def once() -> tuple[bytes, str, str]:
            with self._send("GET", repo, f"/v2/{repo}/manifests/{ref}", "pull", what,
                            headers={"Accept": ", ".join(accept)}, stream=True) as r:
                body = _Capped(max_size, what).feed(r)
                media = _media_type(r.headers.get("Content-Type"))
                sent = r.headers.get("Docker-Content-Digest")
            digest = sha256_digest(body)
            if is_digest(ref):
                alg, hexd = ref.split(":", 1)
                if hashlib.new(alg, body).hexdigest() != hexd:
                    raise BadInput(f"{what}: digest mismatch: the registry sent content hashing to {digest}")
                digest = ref
            elif sent and sent.startswith("sha256:") and sent != digest:
                raise BadInput(f"{what}: digest mismatch: content hashes to {digest}, "
                               f"Docker-Content-Digest says {sent[:80]}")
            if media not in MANIFEST_MEDIA_TYPES:
                media = self._media_from_body(body, media, what)
            if media not in accept:
                raise BadInput(f"{what}: unsupported manifest media type {media[:100]!r}")
            return body, media, digest

        return self._retry(once)

    @staticmethod
    def _media_from_body(body: bytes, sent: str, what: str) -> str:
        """Registries may serve OCI manifests as application/json; the document says what it is."""
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError, UnicodeDecodeError):
            raise BadInput(f"{what}: not JSON") from None
        if isinstance(doc, dict) and isinstance(doc.get("mediaType"), str):
            return str(doc["mediaType"])
        if isinstance(doc, dict) and doc.get("schemaVersion") == 2:
            return OCI_INDEX if "manifests" in doc else OCI_MANIFEST
        raise BadInput(f"{what}: unsupported manifest media type {sent[:100]!r} (schema 1 is not supported)")

    def fetch_blob(self, repo: str, digest: str, dest: str | os.PathLike[str] | IO[bytes], max_size: int,
                   *, expected_size: int | None = None, progress: Callable[[int], None] | None = None) -> int:
        """Stream blob `digest` into `dest` (a path, written via a temp file renamed into place only
        when verified; or an open binary file, rewound and truncated first) and verify it: at most
        `max_size` bytes (exactly `expected_size` when given) hashing to `digest`. Returns its size."""
        check_repository(repo)
        check_digest(digest)
        if expected_size is not None and expected_size > max_size:
            raise BadInput(f"{self.registry}/{repo}: blob {digest}: size {expected_size} is over the limit "
                           f"of {max_size} bytes")
        limit = max_size if expected_size is None else expected_size
        if isinstance(dest, (str, os.PathLike)):
            final = Path(dest)
            tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
            try:
                with open(tmp, "wb") as f:
                    size = self._retry(lambda: self._fetch_into(repo, digest, f, limit, expected_size, progress))
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
            return size
        return self._retry(lambda: self._fetch_into(repo, digest, dest, limit, expected_size, progress))

    def _fetch_into(self, repo: str, digest: str, f: IO[bytes], limit: int, expected: int | None,
                    progress: Callable[[int], None] | None) -> int:
        what = f"{self.registry}/{repo}: blob {digest}"
        f.seek(0)
        f.truncate()
        alg, hexd = digest.split(":", 1)
        h, size = hashlib.new(alg), 0
        with self._send("GET", repo, f"/v2/{repo}/blobs/{digest}", "pull", what, stream=True) as r:
            for part in r.iter_raw(1 << 20):
                size += len(part)
                if size > limit:
                    raise BadInput(f"{what}: the registry sent more than "
                                   f"{'its descriptor size of' if expected is not None else 'the limit of'} "
                                   f"{limit} bytes")
                h.update(part)
                f.write(part)
                if progress is not None:
                    progress(len(part))
        if expected is not None and size != expected:
            raise BadInput(f"{what}: size mismatch: the registry sent {size} bytes, the descriptor says {expected}")
        if h.hexdigest() != hexd:
            raise BadInput(f"{what}: digest mismatch: content hashes to {alg}:{h.hexdigest()}")
        f.flush()
        f.seek(0)
        return size

    def blob_exists(self, repo: str, digest: str) -> bool:
        check_repository(repo)
        check_digest(digest)
        what = f"{self.registry}/{repo}: blob {digest}"

        def once() -> bool:
            try:
                with self._send("HEAD", repo, f"/v2/{repo}/blobs/{digest}", "pull", what):
                    return True
            except NotFound:
                return False

        return self._retry(once)

    # -- writing --------------------------------------------------------------------------------
    def push_blob(self, repo: str, data: bytes | str | os.PathLike[str], digest: str | None = None) -> str:
        """Upload a blob (bytes, or a file by path) unless the registry has it; returns its digest
        (computed when not given; the registry checks it too). Small blobs go in one PUT, larger
        ones in PATCH chunks of `chunk_size`."""
        check_repository(repo)
        if digest is None:
            digest = sha256_digest(data) if isinstance(data, bytes) else _file_digest(Path(data))
        check_digest(digest)
        if self.blob_exists(repo, digest):
            return digest
        size = len(data) if isinstance(data, bytes) else Path(data).stat().st_size
        return self._retry(lambda: self._upload(repo, data, digest, size))

    def _upload(self, repo: str, data: bytes | str | os.PathLike[str], digest: str, size: int) -> str:
        what = f"{self.registry}/{repo}: upload of {digest}"
        with self._send("POST", repo, f"/v2/{repo}/blobs/uploads/", "pull,push", what) as r:
            location = self._location(r, what)
        if size <= self.chunk_size:
            body = data if isinstance(data, bytes) else Path(data).read_bytes()
            with self._send("PUT", repo, _with_query(location, digest=digest), "pull,push", what, content=body,
                            headers={"Content-Type": "application/octet-stream"}) as r:
                return self._check_created(r, digest, what)
        offset = 0
        for part in _chunks(data, self.chunk_size):
            headers = {"Content-Type": "application/octet-stream",
                       "Content-Range": f"{offset}-{offset + len(part) - 1}"}
            with self._send("PATCH", repo, location, "pull,push", what, content=part, headers=headers) as r:
                location = self._location(r, what)
            offset += len(part)
        with self._send("PUT", repo, _with_query(location, digest=digest), "pull,push", what) as r:
            return self._check_created(r, digest, what)

    def put_manifest(self, repo: str, ref: str, body: bytes, media_type: str) -> str:
        """Store a manifest (or index) under a tag or its digest; returns its digest."""
        check_repository(repo)
        check_manifest_ref(ref)
        digest = sha256_digest(body)
        what = f"{self.registry}/{repo}: manifest {ref}"
        if is_digest(ref) and ref != digest:
            raise ConfigError(f"{what}: the body hashes to {digest}")

        def once() -> str:
            with self._send("PUT", repo, f"/v2/{repo}/manifests/{ref}", "pull,push", what, content=body,
                            headers={"Content-Type": media_type}) as r:
                return self._check_created(r, digest, what)

        return self._retry(once)

    def _location(self, r: httpx.Response, what: str) -> str:
        loc = r.headers.get("Location")
        if not loc:
            raise BadInput(f"{what}: the registry gave no upload location")
        url = urllib.parse.urljoin(self.base + "/v2/", loc)
        if not self._same_origin(url):
            raise BadInput(f"{what}: the registry sent the upload to another origin ({url[:200]})")
        return url

    @staticmethod
    def _check_created(r: httpx.Response, digest: str, what: str) -> str:
        sent = r.headers.get("Docker-Content-Digest")
        if sent and sent != digest:
            raise BadInput(f"{what}: the registry filed it as {sent[:80]}, not {digest}")
        return digest

    # -- transport and auth --------------------------------------------------------------------
    def _retry(self, fn: Callable[[], Any]) -> Any:
        return RETRY.call(fn, is_temporary)

    def _same_origin(self, url: str) -> bool:
        u, b = httpx.URL(url), httpx.URL(self.base)
        return (u.scheme, u.host, u.port) == (b.scheme, b.host, b.port)

    def _auth_header(self, scope: str) -> dict[str, str]:
        if scope in self.tokens:
            return {"Authorization": f"Bearer {self.tokens[scope]}"}
        if self.basic and self.credentials is not None:
            return {"Authorization": self.credentials.basic()}
        return {}

    def _send(self, method: str, repo: str, path_or_url: str, actions: str, what: str, *,
              headers: dict[str, str] | None = None, content: bytes | None = None,
              stream: bool = False) -> _Response:
        """One request with the auth flow and redirects; a context manager for the (2xx) response."""
        scope = f"repository:{repo}:{actions}"
        url = path_or_url if "://" in path_or_url else self.base + path_or_url
        for attempt in range(2):
            r = self._open(method, url, {**(headers or {}), **self._auth_header(scope)}, content, what)
            if r.status_code != 401 or attempt == 1:
                break
            challenge = r.headers.get("WWW-Authenticate", "")
            r.close()
            self._answer(challenge, scope, what)
        for _ in range(MAX_REDIRECTS):
            if r.status_code not in (301, 302, 303, 307, 308) or method not in ("GET", "HEAD"):
                break
            target = urllib.parse.urljoin(str(r.url), r.headers.get("Location", ""))
            r.close()
            if httpx.URL(target).scheme not in ("http", "https") or \
                    (httpx.URL(target).scheme == "http" and not self.insecure):
                raise BadInput(f"{what}: refused redirect to {target[:200]}")
            own = self._same_origin(target)
            r = self._open(method, target, {**(headers or {}), **(self._auth_header(scope) if own else {})},
                           None, what)
        if r.status_code >= 300:
            try:
                raise self._error(r, what)
            finally:
                r.close()
        if not stream and method != "HEAD":
            r.read()
        return _Response(r)

    def _open(self, method: str, url: str, headers: dict[str, str], content: bytes | None,
              what: str) -> httpx.Response:
        try:
            req = self.http.build_request(method, url, headers=headers, content=content)
            return self.http.send(req, stream=True)
        except httpx.TimeoutException:
            raise StoreUnavailable(f"{what}: registry {self.registry} timed out") from None
        except httpx.TransportError as e:
            raise StoreUnavailable(f"{what}: cannot reach registry {self.registry}: {str(e)[:200]}") from None

    def _answer(self, challenge: str, scope: str, what: str) -> None:
        scheme, params = parse_challenge(challenge)
        if scheme == "basic":
            if self.credentials is None or self.basic:
                raise PermissionDenied(f"{what}: registry {self.registry} wants credentials "
                                       "(docker login, or $LAYERSTORE_REGISTRY_USER/_PASSWORD)")
            self.basic = True
            return
        if scheme != "bearer" or not params.get("realm"):
            raise PermissionDenied(f"{what}: registry {self.registry} refused access "
                                   f"(challenge {challenge[:100]!r})")
        self.tokens[scope] = self._token(params, scope, what)

    def _token(self, params: dict[str, str], scope: str, what: str) -> str:
        realm = httpx.URL(params["realm"])
        if realm.scheme not in ("http", "https") or not realm.host:
            raise BadInput(f"{what}: bad token realm {params['realm'][:200]!r}")
        if realm.scheme == "http" and not is_insecure(realm.host if realm.port is None
                                                      else f"{realm.host}:{realm.port}"):
            raise PermissionDenied(f"{what}: refused token realm over plain HTTP: {params['realm'][:200]}")
        query = {"scope": params.get("scope") or scope}
        if params.get("service"):
            query["service"] = params["service"]
        headers = {"Authorization": self.credentials.basic()} if self.credentials is not None else {}
        r = self._open("GET", str(realm.copy_merge_params(query)), headers, None, f"{what}: token")
        try:
            if r.status_code in (401, 403):
                raise PermissionDenied(f"{what}: the token server refused "
                                       f"{'the credentials' if self.credentials else 'anonymous access'}")
            if r.status_code != 200:
                raise self._error(r, f"{what}: token server")
            body = _Capped(MAX_TOKEN_RESPONSE, f"{what}: token response").feed(r)
        finally:
            r.close()
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError, UnicodeDecodeError):
            doc = None
        token = (doc.get("token") or doc.get("access_token")) if isinstance(doc, dict) else None
        if not isinstance(token, str) or not token or not token.isprintable() or len(token) > 64 << 10:
            raise BadInput(f"{what}: the token server sent no usable token")
        return token

    def _error(self, r: httpx.Response, what: str) -> LayerstoreError:
        detail = ""
        if r.request.method != "HEAD":
            try:
                body = _Capped(MAX_ERROR_BODY, what).feed(r)
                errors = json.loads(body).get("errors") or []
                first = errors[0] if errors and isinstance(errors[0], dict) else {}
                detail = f": {str(first.get('code', ''))[:40]} {str(first.get('message', ''))[:160]}".rstrip()
            except (LayerstoreError, ValueError, AttributeError, RecursionError, UnicodeDecodeError,
                    httpx.HTTPError):
                pass
        detail = "".join(c if c.isprintable() else "?" for c in detail)
        code = r.status_code
        if code == 404:
            return NotFound(f"{what}: not found in registry {self.registry}{detail}")
        if code in (401, 403):
            return PermissionDenied(f"{what}: registry {self.registry} refused access (HTTP {code}){detail}")
        if code == 429 or code >= 500:
            return StoreUnavailable(f"{what}: registry {self.registry} answered HTTP {code}{detail}")
        return BadInput(f"{what}: registry {self.registry} answered HTTP {code}{detail}")


class _Response:
    def __init__(self, r: httpx.Response) -> None:
        self.r = r

    def __enter__(self) -> httpx.Response:
        return self.r

    def __exit__(self, *exc: object) -> None:
        self.r.close()


def _with_query(url: str, **params: str) -> str:
    return str(httpx.URL(url).copy_merge_params(params))


def _chunks(data: bytes | str | os.PathLike[str], size: int) -> Iterator[bytes]:
    if isinstance(data, bytes):
        for i in range(0, len(data), size):
            yield data[i:i + size]
        return
    with open(data, "rb") as f:
        while part := f.read(size):
            yield part


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


__all__ = ["AUTO", "CHUNK_SIZE", "DOCKER_LIST", "DOCKER_MANIFEST", "MANIFEST_MEDIA_TYPES", "MAX_MANIFEST", "OCI_INDEX",
           "OCI_MANIFEST", "Credentials", "Reference", "RegistryClient", "auth_file", "check_digest",
           "check_manifest_ref", "check_repository", "credentials_for", "is_insecure", "is_loopback",
           "sha256_digest"]
