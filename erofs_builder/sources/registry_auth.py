"""Registry settings and credentials from the environment, and auth challenges (no network):
which registries speak plain HTTP (`is_insecure`: loopback hosts, as Docker does, and
$LAYERSTORE_INSECURE_REGISTRIES), the CAs HTTPS is checked against (`tls_verify`), the
credentials for a registry (`credentials_for`: $LAYERSTORE_REGISTRY_USER/_PASSWORD, else the
docker-style config file), and the parameters of a `WWW-Authenticate` challenge
(`parse_challenge`). Used by `erofs_builder.sources.registry` (the client)."""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from layerstore.errors import ConfigError

INSECURE_ENV = "LAYERSTORE_INSECURE_REGISTRIES"
CA_ENV = "LAYERSTORE_REGISTRY_CA"  # a PEM bundle of the CAs registries' certificates are checked against
USER_ENV, PASSWORD_ENV = "LAYERSTORE_REGISTRY_USER", "LAYERSTORE_REGISTRY_PASSWORD"
MAX_AUTH_FILE = 1 << 20
_CHALLENGE_PARAM = re.compile(r'([A-Za-z_]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))')


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = ""

    def __repr__(self) -> str:  # never print a password
        return f"Credentials({self.username!r}, ***)"

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


def _host_only(registry: str) -> str:
    if registry.startswith("["):
        return registry[1:].split("]", 1)[0]
    return registry.rsplit(":", 1)[0] if registry.count(":") == 1 else registry


def is_loopback(registry: str) -> bool:
    host = _host_only(registry)
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_insecure(registry: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether `registry` speaks plain HTTP: a loopback host, or one the user listed."""
    env = os.environ if env is None else env
    listed = {r.strip() for r in env.get(INSECURE_ENV, "").split(",") if r.strip()}
    return is_loopback(registry) or registry in listed or _host_only(registry) in listed


def tls_verify(env: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """How HTTPS certificates are checked: against $LAYERSTORE_REGISTRY_CA (else $SSL_CERT_FILE)
    when set, else certifi's bundle (httpx's own default). Never off: a registry without a
    certificate is listed as insecure (plain HTTP) instead. One context per bundle file and
    version, shared by every client (loading a bundle costs ~30 ms of CPU; a client is made per
    image on the snapshotter's CRI path)."""
    env = os.environ if env is None else env
    cafile = env.get(CA_ENV) or env.get("SSL_CERT_FILE")
    if not cafile:
        import certifi

        cafile = certifi.where()
    try:
        st = os.stat(cafile)
        key = (cafile, st.st_mtime_ns, st.st_size, st.st_ino)
        with _TLS_MU:
            ctx = _TLS.get(key)
        if ctx is None:
            ctx = ssl.create_default_context(cafile=cafile)
            with _TLS_MU:
                _TLS.clear()  # (one bundle in use at a time: an old version goes)
                _TLS[key] = ctx
        return ctx
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"{cafile}: not a readable PEM bundle of CA certificates: {e}") from None


_TLS: dict[tuple[str, int, int, int], ssl.SSLContext] = {}
_TLS_MU = threading.Lock()


def auth_file(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("REGISTRY_AUTH_FILE"):
        return Path(env["REGISTRY_AUTH_FILE"])
    if env.get("DOCKER_CONFIG"):
        return Path(env["DOCKER_CONFIG"]) / "config.json"
    return Path(env.get("HOME", os.path.expanduser("~"))) / ".docker" / "config.json"


def credentials_for(registry: str, env: Mapping[str, str] | None = None) -> Credentials | None:
    """The credentials for `registry`: the environment's, else the auth file's entry, else None."""
    env = os.environ if env is None else env
    if env.get(USER_ENV):
        return Credentials(env[USER_ENV], env.get(PASSWORD_ENV, ""))
    path = auth_file(env)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_AUTH_FILE + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        doc = json.loads(raw) if len(raw) <= MAX_AUTH_FILE else None
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a registry auth file (a JSON object with 'auths')")
    auths = doc.get("auths")
    if not isinstance(auths, dict):
        return None
    entry = next((v for k, v in auths.items() if isinstance(k, str) and _auth_key(k) == registry), None)
    if not isinstance(entry, dict):
        return None
    if isinstance(entry.get("auth"), str) and entry["auth"]:
        try:
            user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            raise ConfigError(f"{path}: auths[{registry!r}].auth is not base64 of user:password") from None
        if not sep:
            raise ConfigError(f"{path}: auths[{registry!r}].auth is not base64 of user:password")
        return Credentials(user, password)
    if isinstance(entry.get("username"), str):
        return Credentials(entry["username"], str(entry.get("password") or ""))
    return None


def _auth_key(key: str) -> str:
    """`https://host:port/v1/` (old docker config keys) -> `host:port`."""
    if "://" in key:
        key = key.split("://", 1)[1]
    return key.split("/", 1)[0]


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = {m[1].lower(): m[2].replace('\\"', '"') if m[2] is not None else m[3] or ""
              for m in _CHALLENGE_PARAM.finditer(rest)}
    return scheme.lower(), params



__all__ = ["CA_ENV", "INSECURE_ENV", "PASSWORD_ENV", "USER_ENV", "Credentials", "auth_file", "credentials_for",
           "is_insecure", "is_loopback", "parse_challenge", "tls_verify"]
