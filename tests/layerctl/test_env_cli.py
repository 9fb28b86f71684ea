"""`layerctl env ...` end to end through the installed entry point, on a temporary local store."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from testkit.cli_helpers import Result, assert_clean_failure, layerctl

ABSENT = "b3:" + "a" * 64


class Ctx:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = str(root / "store")
        assert layerctl("store", "init", "--store", self.store).code == 0
        self.base = self.put("base", 3 * 1024 * 1024 + 5)  # 4 chunks of the default size
        self.tool = self.put("tool", 1000)
        self.work = self.put("work", 10)

    def put(self, name: str, size: int) -> str:
        p = self.root / name
        p.write_bytes(os.urandom(size))
        r = layerctl("store", "put-blob", "--store", self.store, "--json", str(p))
        assert r.code == 0, r
        return r.json()["blob"]

    def run(self, *args: str) -> Result:
        return layerctl("env", *args, "--store", self.store) if args[0] != "keygen" else layerctl("env", *args)

    def ok(self, *args: str) -> Any:
        r = self.run(*args, "--json")
        assert r.code == 0 and not r.err, r
        return r.json()

    def file(self, name: str, content: Any) -> str:
        p = self.root / name
        p.write_text(content if isinstance(content, str) else json.dumps(content))
        return str(p)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Ctx:
    return Ctx(tmp_path_factory.mktemp("envcli"))


def test_create_show_ls(ctx: Ctx) -> None:
    cfg = ctx.file("cfg.json", {"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo hi"], "env": ["PATH=/bin", "A=b=c"],
                                "workdir": "/src", "user": "1000:1000"})
    trace = ctx.file("trace.json", {"version": 1, "blobs": {ctx.base: [3, 0, 3], ctx.work: [0], ABSENT: [7]}})
    out = ctx.ok("create", "--base", ctx.base, "--toolkit", ctx.tool, "--workspace", ctx.work, "--config", cfg,
                 "--prefetch-trace", trace, "--annotation", "org.example/task=42", "--annotation", "note=a=b",
                 "-t", "py:v1")
    assert set(out) == {"manifest", "tag", "released_leases"} and out["released_leases"] == []
    assert out["tag"] == "py:v1" and out["manifest"].startswith("b3:")

    shown = ctx.ok("show", "py:v1")
    assert shown["manifest"] == out["manifest"] and shown["signed_by"] == []
    env = shown["environment"]
    assert env["schema_version"] == 1 and env["kind"] == "environment"
    assert [(x["role"], x["blob"], x["size"]) for x in env["layers"]] == [
        ("base", ctx.base, 3 * 1024 * 1024 + 5), ("toolkit", ctx.tool, 1000), ("workspace", ctx.work, 10)]
    assert env["config"] == {"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo hi"], "env": ["PATH=/bin", "A=b=c"],
                             "workdir": "/src", "user": "1000:1000"}
    assert env["prefetch"] == {ctx.base: [3, 0], ctx.work: [0]}
    assert env["annotations"] == {"org.example/task": "42", "note": "a=b"}
    assert ctx.ok("show", out["manifest"])["environment"] == env

    # the same inputs give the same manifest; a second tag points at it
    again = ctx.ok("create", "--base", ctx.base, "--toolkit", ctx.tool, "--workspace", ctx.work, "--config", cfg,
                   "--prefetch-trace", trace, "--annotation", "note=a=b", "--annotation", "org.example/task=42",
                   "-t", "py:latest")
    assert again["manifest"] == out["manifest"]
    listed = ctx.ok("ls")
    assert {"tag": "py:v1", "manifest": out["manifest"]} in listed
    assert {"tag": "py:latest", "manifest": out["manifest"]} in listed

    human = ctx.run("show", "py:v1")
    assert human.code == 0 and "workspace" in human.out and "org.example/task=42" in human.out
    human_ls = ctx.run("ls")
    assert f"py:v1 -> {out['manifest']}" in human_ls.out


def test_retag_last_writer_wins(ctx: Ctx) -> None:
    a = ctx.ok("create", "--base", ctx.base, "-t", "moving:tag")["manifest"]
    b = ctx.ok("create", "--base", ctx.tool, "-t", "moving:tag")["manifest"]
    assert a != b and ctx.ok("show", "moving:tag")["manifest"] == b
    assert ctx.ok("show", a)["manifest"] == a  # the old manifest stays addressable by digest


def test_partial_config_file_takes_defaults(ctx: Ctx) -> None:
    cfg = ctx.file("partial.json", {"cmd": ["/bin/true"]})
    ctx.ok("create", "--base", ctx.base, "--config", cfg, "-t", "partial:v1")
    assert ctx.ok("show", "partial:v1")["environment"]["config"] == {
        "entrypoint": [], "cmd": ["/bin/true"], "env": [], "workdir": "/", "user": ""}


@pytest.mark.slow  # about 3-5 s: kept out of `make check`'s 2 minutes
def test_sign_and_verify(ctx: Ctx) -> None:
    k1, k2 = str(ctx.root / "k1.pem"), str(ctx.root / "k2.pem")
    kg = ctx.ok("keygen", "--out", k1)
    pub1 = kg["public_key"]
    assert pub1.startswith("ed25519:") and kg["key_file"] == k1
    assert stat.S_IMODE(os.stat(k1).st_mode) == 0o600
    r = ctx.run("keygen", "--out", k2)
    assert r.code == 0 and r.out.startswith("ed25519:")
    pub2 = r.out.strip()

    signed = ctx.ok("create", "--base", ctx.base, "--toolkit", ctx.tool, "-t", "signed:v1", "--sign", k1)
    assert signed["signed_by"] == pub1
    pol1 = ctx.file("pol1.json", {"require_signature": True, "trusted_keys": [pub1]})
    pol2 = ctx.file("pol2.json", {"require_signature": True, "trusted_keys": [pub2]})
    loose = ctx.file("loose.json", {"require_signature": False})

    v = ctx.ok("verify", "signed:v1", "--policy", pol1)
    assert v == {"manifest": signed["manifest"], "ref": "signed:v1", "signed_by": [pub1]}
    assert ctx.ok("show", "signed:v1")["signed_by"] == [pub1]
    human = ctx.run("verify", "signed:v1", "--policy", pol1)
    assert human.code == 0 and human.out.startswith("ok: signed:v1") and pub1 in human.out

    r = ctx.run("verify", "signed:v1", "--policy", pol2)
    assert_clean_failure(r, "has no valid signature by a trusted key (1 valid signature(s) by untrusted keys)")
    assert r.code == 6
    assert ctx.ok("sign", "signed:v1", "--key", k2) == {"manifest": signed["manifest"], "signed_by": pub2}
    assert ctx.ok("verify", "signed:v1", "--policy", pol2)["signed_by"] == [pub2]
    assert sorted(ctx.ok("show", "signed:v1")["signed_by"]) == sorted([pub1, pub2])

    ctx.ok("create", "--base", ctx.base, "-t", "unsigned:v1")
    r = ctx.run("verify", "unsigned:v1", "--policy", pol1)
    assert_clean_failure(r, "environment unsigned:v1 (b3:", "is not signed, and the trust policy requires a signature")
    assert r.code == 6
    assert ctx.ok("verify", "unsigned:v1", "--policy", loose)["signed_by"] == []
    # signature tags never show up as environments
    assert all(not row["tag"].startswith("sig/") for row in ctx.ok("ls"))


def test_verify_checks_layers(ctx: Ctx) -> None:
    # a manifest whose layer size disagrees with the store, written behind layerctl's back
    from layerstore.store import Store
    from manifest.schema import Layer, Manifest

    m = Manifest(layers=(Layer(ctx.tool, 999, "base"),))
    with Store.open(ctx.store) as s:
        s.put_manifest(m.to_bytes())
        s.set_tag("forged:v1", m.digest())
    loose = ctx.file("loose2.json", {"require_signature": False})
    assert_clean_failure(ctx.run("verify", "forged:v1", "--policy", loose),
                         "size 999 does not match the store's chunk map")


def tagn(i: int) -> str:
    return f"err:e{i}"


@pytest.mark.parametrize("args, code, needle", [
    (["create", "--base", ABSENT, "-t", tagn(1)], 3, f"layer blob {ABSENT} is not in store"),
    (["create", "--base", "b3:1234", "-t", tagn(2)], 2, "--base: not a digest"),
    (["create", "--base", "{base}", "--toolkit", "nope", "-t", tagn(3)], 2, "--toolkit: not a digest"),
    (["create", "--base", "{base}", "--workspace", "{base}", "-t", tagn(4)], 2,
     "is given twice (as base and as workspace)"),
    (["create", "--base", "{base}", "-t", "sig/x:y"], 2, "tag name 'sig/x' is reserved"),
    (["create", "--base", "{base}", "-t", "Bad Tag"], 2, "not a tag reference"),
    (["create", "--base", "{base}", "-t", "notag"], 2, "not a tag reference"),
    (["create", "-t", tagn(5)], 2, "Missing option '--base'"),
    (["create", "--base", "{base}", "-t", tagn(6), "--annotation", "novalue"], 2,
     "--annotation: want KEY=VALUE, got 'novalue'"),
    (["create", "--base", "{base}", "-t", tagn(7), "--annotation", "a b=c"], 2, "annotations: bad key 'a b'"),
    (["create", "--base", "{base}", "-t", tagn(8), "--annotation", "k=1", "--annotation", "k=2"], 2,
     "--annotation: k is given twice"),
    (["create", "--base", "{base}", "-t", tagn(9), "--config", "{missing}"], 3, "no such file"),
    (["create", "--base", "{base}", "-t", tagn(10), "--config", "@{{\"workdir\": \"src\"}}"], 2,
     "config.workdir: must be an absolute path, got 'src'"),
    (["create", "--base", "{base}", "-t", tagn(11), "--config", "@{{\"env\": [\"NOEQ\"]}}"], 2,
     "config.env[0]: want KEY=VALUE, got 'NOEQ'"),
    (["create", "--base", "{base}", "-t", tagn(12), "--config", "@{{\"shell\": []}}"], 2,
     "unknown field 'shell'"),
    (["create", "--base", "{base}", "-t", tagn(13), "--config", "@not json"], 2, "not JSON"),
    (["create", "--base", "{base}", "-t", tagn(14), "--prefetch-trace", "@{{\"version\": 2, \"blobs\": {{}}}}"], 2,
     "unknown trace version 2"),
    (["create", "--base", "{base}", "-t", tagn(15), "--prefetch-trace",
      "@{{\"version\": 1, \"blobs\": {{\"{base}\": [0, 4]}}}}"], 2,
     "entry 1 is chunk 4, but the blob has 4 chunks"),
    (["create", "--base", "{base}", "-t", tagn(16), "--prefetch-trace",
      "@{{\"version\": 1, \"blobs\": {{\"x\": []}}}}"],
     2, "not a digest"),
    (["create", "--base", "{base}", "-t", tagn(17), "--sign", "@not a key"], 2, "not an unencrypted PEM private key"),
    (["create", "--base", "{base}", "-t", tagn(18), "--sign", "{missing}"], 3, "no such file"),
    (["show", "nope:v1"], 3, "tag nope:v1 is not in store"),
    (["show", "b3:zz"], 2, "not a digest"),
    (["show", ABSENT], 3, f"manifest {ABSENT} is not in store"),
    (["show", "no-colon"], 2, "not a tag reference"),
    (["verify", "nope:v1"], 2, "Missing option '--policy'"),
    (["verify", "nope:v1", "--policy", "{missing}"], 3, "trust policy"),
    (["verify", "nope:v1", "--policy", "@{{\"require_signature\": true}}"], 2, "trusts no key"),
    (["verify", "nope:v1", "--policy", "@{{\"require_signature\": 1}}"], 2, "require_signature: want true or false"),
    (["verify", "nope:v1", "--policy", "@{{\"require_signature\": false, \"trusted_keys\": [\"rsa:x\"]}}"], 2,
     "trusted_keys[0]: want 'ed25519:'"),
    (["sign", "nope:v1", "--key", "@garbage"], 2, "not an unencrypted PEM private key"),
    (["keygen", "--out", "{root}/no/such/dir/key"], 3, "does not exist"),
])
def test_errors_are_one_clear_line(ctx: Ctx, args: list[str], code: int, needle: str) -> None:
    files = iter(range(1000))

    def expand(a: str) -> str:
        if a.startswith("@"):  # inline file content
            return ctx.file(f"input-{os.getpid()}-{next(files)}-{abs(hash(a))}", a[1:].format(base=ctx.base))
        return a.format(base=ctx.base, missing=str(ctx.root / "missing.json"), root=str(ctx.root))

    r = ctx.run(*(expand(a) for a in args))
    assert_clean_failure(r, needle)
    assert r.code == code, r
    assert not r.out


def test_keygen_refuses_to_overwrite(ctx: Ctx) -> None:
    key = str(ctx.root / "once.pem")
    first = ctx.ok("keygen", "--out", key)
    before = Path(key).read_bytes()
    r = ctx.run("keygen", "--out", key)
    assert_clean_failure(r, "already exists (use --force to replace it)")
    assert Path(key).read_bytes() == before
    assert ctx.ok("keygen", "--out", key, "--force")["public_key"] != first["public_key"]
    assert not [p for p in ctx.root.iterdir() if p.name.startswith(".once.pem")]


def test_show_refuses_a_non_environment_object(ctx: Ctx) -> None:
    k = str(ctx.root / "k3.pem")
    ctx.ok("keygen", "--out", k)
    m = ctx.ok("create", "--base", ctx.work, "-t", "obj:v1", "--sign", k)["manifest"]
    store = Path(ctx.store)
    sig_tags = list((store / "tags" / "sig").iterdir())
    sig_obj = next(p for p in sig_tags if p.name.startswith(m[3:])).read_text().strip()
    assert_clean_failure(ctx.run("show", sig_obj), "not an environment manifest (kind 'signature'")


def test_uninitialised_store(tmp_path: Path) -> None:
    r = layerctl("env", "ls", "--store", str(tmp_path / "empty"))
    assert r.code != 0 and "Traceback" not in r.err
