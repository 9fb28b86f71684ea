"""A real OCI registry for tests: Debian's docker-registry (distribution 2.8) on a free loopback
port, with its own config and storage directory, stopped by PID and cleaned up even when the
test fails.

    with oci_registry(tmp_path) as reg:                    # anonymous pull and push
        reg.host                                           # "127.0.0.1:PORT"
        reg.ref("busybox", "1")                            # "127.0.0.1:PORT/busybox:1"
    with oci_registry(tmp_path, auth="token") as reg:      # Bearer token flow (a token server here)
        reg.user, reg.password, reg.token_requests
    with oci_registry(tmp_path, auth="htpasswd") as reg:   # Basic auth (bcrypt htpasswd)
    with oci_registry(tmp_path, tls=True) as reg:          # HTTPS with a self-signed certificate
        reg.url, reg.ca                                    # "https://127.0.0.1:PORT", its PEM file

`auth="token"`: the registry refuses anonymous requests with `WWW-Authenticate: Bearer
realm=...,service=...,scope=...`; a tiny token server in this process (a thread) answers
`GET /token?service=&scope=` with an ES256 JWT the registry trusts (a self-signed certificate in
its `rootcertbundle`), granting the asked actions only to `user:password` (basic credentials),
and pull only to anonymous clients when `anonymous_pull=True`. Every token request is recorded
(`token_requests`: (user or None, scope)). The token server and the registry listen only on
127.0.0.1.

The module imports nothing of the project, so the snapshotter tests (and benchmarks) can use it.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import ctypes.util
import datetime
import hashlib
import http.server
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
needs_registry = pytest.mark.registry  # skipped by tests/conftest.py where registry_missing() says why


def registry_missing() -> str:
    """Why registry tests cannot run here ("" if they can)."""
    return "" if os.path.exists(REGISTRY_BIN) else "needs docker-registry (.ci/install-deps.sh)"
SERVICE = "layerstore-test-registry"
ISSUER = "layerstore-test-issuer"
START_TIMEOUT = 20.0


def free_port() -> int:
    """A free loopback port (the kernel's pick; a start that loses the race is retried)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- token auth ---------------------------------------------------------------------------------
def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def libtrust_key_id(public_der: bytes) -> str:
    """The key id distribution's token verifier files a root certificate's key under: base32 of
    the first 240 bits of the sha256 of the DER public key, in groups of four joined by ':'."""
    raw = base64.b32encode(hashlib.sha256(public_der).digest()[:30]).decode().rstrip("=")
    return ":".join(raw[i:i + 4] for i in range(0, len(raw), 4))


class TokenIssuer:
    """An ES256 key, its self-signed certificate (PEM, for the registry's rootcertbundle) and
    JWTs the registry accepts."""

    def __init__(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=30))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        der = self.key.public_key().public_bytes(serialization.Encoding.DER,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
        self.kid = libtrust_key_id(der)

    def token(self, subject: str, access: list[dict[str, object]], ttl: int = 300) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "kid": self.kid}
        claims = {"iss": ISSUER, "sub": subject, "aud": SERVICE, "exp": now + ttl, "nbf": now - 10, "iat": now,
                  "jti": secrets.token_hex(8), "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def parse_scope(scope: str) -> dict[str, object] | None:
    """`repository:NAME:pull,push` -> an access claim entry."""
    parts = scope.split(":")
    if len(parts) < 3:
        return None
    return {"type": parts[0], "name": ":".join(parts[1:-1]), "actions": parts[-1].split(",")}


class TokenServer:
    """`GET /token?service=...&scope=...` on 127.0.0.1, in a thread."""

    def __init__(self, issuer: TokenIssuer, user: str, password: str, anonymous_pull: bool) -> None:
        self.issuer, self.user, self.password, self.anonymous_pull = issuer, user, password, anonymous_pull
        self.requests: list[tuple[str | None, str]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="token-server", daemon=True)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def answer(self, h: http.server.BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = urllib.parse.parse_qs(url.query)
        who = self._user(h.headers.get("Authorization"))
        scopes = [s for value in query.get("scope", []) for s in value.split(" ") if s]
        self.requests.extend((who if who else None, s) for s in scopes or [""])
        if url.path != "/token" or query.get("service") != [SERVICE] or who == "":
            h.send_response(401 if who == "" else 404)
            h.end_headers()
            return
        access = []
        for scope in scopes:
            entry = parse_scope(scope)
            if entry is None:
                continue
            if who is None:  # anonymous: pull at most, and only when allowed
                entry["actions"] = [a for a in entry["actions"] if a == "pull"] if self.anonymous_pull else []  # type: ignore[union-attr]
            access.append(entry)
        token = self.issuer.token(who or "anonymous", access)
        body = json.dumps({"token": token, "access_token": token, "expires_in": 300}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _user(self, header: str | None) -> str | None:
        """The authenticated user, None when anonymous, "" for wrong credentials."""
        if not header:
            return None
        kind, _, value = header.partition(" ")
        if kind.lower() != "basic":
            return ""
        try:
            user, _, password = base64.b64decode(value).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return ""
        return user if (user, password) == (self.user, self.password) else ""

    def __enter__(self) -> TokenServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash for an htpasswd file (glibc's libcrypt; the registry accepts only bcrypt)."""
    lib = ctypes.CDLL(ctypes.util.find_library("crypt") or "libcrypt.so.1")
    lib.crypt.restype = ctypes.c_char_p
    alphabet = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    salt = "".join(secrets.choice(alphabet) for _ in range(21)) + "u"
    out = lib.crypt(password.encode(), f"$2b$05${salt}".encode())
    if not out or not out.startswith(b"$2b$"):
        raise RuntimeError("libcrypt cannot make bcrypt hashes")
    return str(out.decode())


# -- the registry -------------------------------------------------------------------------------
@dataclass
class Registry:
    root: Path
    port: int
    pid: int
    auth: str | None = None
    user: str = "tester"
    password: str = "s3cret-pw"
    token_server: TokenServer | None = None
    log: Path = field(default_factory=Path)
    ca: Path | None = None  # with tls: the certificate (self-signed: it is its own CA)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://{self.host}"

    def ref(self, name: str, tag: str = "latest") -> str:
        return f"{self.host}/{name}:{tag}"

    @property
    def token_requests(self) -> list[tuple[str | None, str]]:
        return self.token_server.requests if self.token_server is not None else []

    def docker_config(self, path: Path) -> Path:
        """A docker-style config.json holding this registry's credentials."""
        auth = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"auths": {self.host: {"auth": auth}}}))
        return path

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def self_signed(root: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and localhost) and its key, as PEM files under `root`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = root / "tls-cert.pem", root / "tls-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _config(root: Path, port: int, auth: str | None, token: TokenServer | None,
            user: str, password: str, tls: tuple[Path, Path] | None = None) -> str:
    lines = ["version: 0.1", "log:", "  level: warn", "  accesslog:", "    disabled: true", "storage:",
             "  filesystem:", f"    rootdirectory: {root / 'storage'}", "  delete:", "    enabled: true",
             "  maintenance:", "    uploadpurging:", "      enabled: false", "http:",
             f"  addr: 127.0.0.1:{port}", f"  secret: {secrets.token_hex(16)}",
             *(["  tls:", f"    certificate: {tls[0]}", f"    key: {tls[1]}"] if tls else []),
             "health:", "  storagedriver:", "    enabled: false"]
    if auth == "token":
        assert token is not None
        cert = root / "token-cert.pem"
        cert.write_bytes(token.issuer.cert_pem)
        lines += ["auth:", "  token:", f"    realm: {token.realm}", f"    service: {SERVICE}",
                  f"    issuer: {ISSUER}", f"    rootcertbundle: {cert}"]
    elif auth == "htpasswd":
        pw = root / "htpasswd"
        pw.write_text(f"{user}:{bcrypt_hash(password)}\n")
        lines += ["auth:", "  htpasswd:", "    realm: layerstore-test", f"    path: {pw}"]
    elif auth is not None:
        raise ValueError(f"auth: want None, 'token' or 'htpasswd', got {auth!r}")
    return "\n".join(lines) + "\n"


def _answers(port: int, ca: Path | None = None) -> bool:
    import ssl

    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(f"{'https' if ca else 'http'}://127.0.0.1:{port}/v2/", timeout=1,
                                    context=context):
            return True
    except urllib.error.HTTPError as e:
        return e.code == 401
    except OSError:
        return False


def _stop(pid: int, proc: subprocess.Popen[bytes] | None) -> None:
    """Stop the registry we started (by its PID) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if proc is not None:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def oci_registry(root: Path, *, auth: str | None = None, user: str = "tester", password: str = "s3cret-pw",
                 anonymous_pull: bool = False, tls: bool = False) -> Iterator[Registry]:
    """A running registry under `root` (config, storage, log); stopped and removed afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    cert = self_signed(root) if tls else None
    with contextlib.ExitStack() as stack:
        token = None
        if auth == "token":
            token = stack.enter_context(TokenServer(TokenIssuer(), user, password, anonymous_pull))
        log = root / "registry.log"
        for _attempt in range(5):
            port = free_port()
            (root / "config.yml").write_text(_config(root, port, auth, token, user, password, cert))
            with open(log, "ab") as out:
                proc = subprocess.Popen([REGISTRY_BIN, "serve", str(root / "config.yml")], stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            reg = Registry(root, port, proc.pid, auth, user, password, token, log, cert[0] if cert else None)
            try:
                deadline = time.monotonic() + START_TIMEOUT
                while proc.poll() is None and not _answers(port, reg.ca) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if proc.poll() is not None:
                    continue  # lost the port, most likely: try another one
                if not _answers(port, reg.ca):
                    raise RuntimeError(f"docker-registry did not answer within {START_TIMEOUT}s:\n{reg.log_text()}")
                try:
                    yield reg
                    return
                finally:
                    _stop(proc.pid, proc)
                    shutil.rmtree(root / "storage", ignore_errors=True)
            finally:
                if proc.poll() is None:
                    _stop(proc.pid, proc)
        raise RuntimeError(f"docker-registry would not start:\n{(root / 'registry.log').read_text(errors='replace')}")
