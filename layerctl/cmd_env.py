"""`layerctl env ...`: create (from layers in the store, or from a whole image with --from), show, list,
sign and verify environments (manifests named by tags)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from layerstore import leases
from layerstore.errors import ConfigError, LayerstoreError
from manifest import environment as envmod
from manifest import files

from .cmd_store import open_store
from .options import emit_json, human_bytes, json_option, store_option

if TYPE_CHECKING:
    from manifest.config import RuntimeConfig
    from manifest.signing import PrivateKey

_file = click.Path(dir_okay=False, path_type=Path)


@click.group("env")
def env_group() -> None:
    """Environments: ordered layers + runtime config + prefetch hints, named by tags."""


@env_group.command("create")
@store_option
@click.option("--from", "image", metavar="SRC", default=None,
              help="Make the whole image SRC the environment: oci:PATH[:REF], docker-archive:PATH[:REF] or "
                   "docker://HOST/NAME[:TAG|@DIGEST]. Its layers are built and pushed; the bottom one is the base, "
                   "the others toolkits; its runtime config is the environment's (docs/image-inputs.md).")
@click.option("--top-workspace", is_flag=True, help="With --from: the image's top layer is the workspace.")
@click.option("--base", default=None, metavar="DIGEST", help="The base layer's blob (exactly one).")
@click.option("--toolkit", "toolkits", multiple=True, metavar="DIGEST", help="A toolkit layer, bottom first; repeat.")
@click.option("--workspace", metavar="DIGEST", default=None, help="The workspace layer (at most one, on top).")
@click.option("--config", "config_file", type=_file, default=None,
              help="Runtime config JSON (as `layerctl build --config-out` writes).")
@click.option("--prefetch-trace", "trace_file", type=_file, default=None,
              help="A node daemon trace: {\"version\": 1, \"blobs\": {DIGEST: [chunk, ...]}}.")
@click.option("--annotation", "annotations", multiple=True, metavar="K=V", help="An annotation; repeat.")
@click.option("-t", "--tag", "tag", required=True, metavar="NAME:TAG", help="The tag to point at the manifest.")
@click.option("--sign", "key_file", type=_file, default=None, metavar="KEYFILE",
              help="Sign the manifest with this ed25519 key (from `layerctl env keygen`).")
@json_option
def create_cmd(store_url: str | None, image: str | None, top_workspace: bool, base: str | None,
               toolkits: tuple[str, ...], workspace: str | None, config_file: Path | None, trace_file: Path | None,
               annotations: tuple[str, ...], tag: str, key_file: Path | None, as_json: bool) -> None:
    """Create an environment from layers already in the store (--base, --toolkit, --workspace),
    or from a whole image (--from), and tag it."""
    if image is None and base is None:
        raise click.UsageError("Missing option '--base' (or --from SRC, a whole image)")
    if image is not None and base is not None:
        raise ConfigError("give --base DIGEST (layers in the store) or --from SRC (an image), not both")
    if image is not None and toolkits:
        raise ConfigError("--toolkit goes with --base; with --from the image's layers are the toolkits")
    if image is None and top_workspace:
        raise ConfigError("--top-workspace goes with --from")
    # Everything local is read and checked before the store is touched.
    envmod.check_environment_tag(tag)
    notes = _parse_annotations(annotations)
    config = files.read_config(config_file) if config_file else None
    trace = files.read_trace(trace_file) if trace_file else None
    key = files.read_private_key(key_file) if key_file else None
    if image is not None:
        _create_from_image(store_url, image, tag, top_workspace=top_workspace, workspace=workspace, config=config,
                           trace=trace, annotations=notes, key=key, as_json=as_json)
        return
    assert base is not None
    with open_store(store_url) as store:
        manifest = envmod.build_manifest(store, base=base, toolkits=toolkits, workspace=workspace, config=config,
                                         trace=trace, annotations=notes)
        created = envmod.create_environment(store, manifest, tag, key=key)
        # The tag now keeps the layers: the leases their pushes left behind can go.
        released = leases.release_kept(store.backend, {layer.blob for layer in manifest.layers})
    if as_json:
        emit_json({**created.to_json(), "released_leases": released})
        return
    click.echo(f"{created.tag} -> {created.manifest}")
    click.echo(f"  {len(manifest.layers)} layer(s), {human_bytes(manifest.size)}, "
               f"prefetch hints for {len(manifest.prefetch)} blob(s)")
    if created.signed_by is not None:
        click.echo(f"  signed by {created.signed_by}")
    for lease_id in released:
        click.echo(f"  released lease {lease_id}")


def _create_from_image(store_url: str | None, image: str, tag: str, *, top_workspace: bool, workspace: str | None,
                       config: RuntimeConfig | None, trace: dict[str, list[int]] | None, annotations: dict[str, str],
                       key: PrivateKey | None, as_json: bool) -> None:
    from erofs_builder.image_env import environment_from_image

    from .cmd_build import ProgressBar

    try:
        with open_store(store_url) as store, ProgressBar(not as_json) as bar:
            made = environment_from_image(store, image, tag, top_workspace=top_workspace, workspace=workspace,
                                          config=config, trace=trace, annotations=annotations, key=key,
                                          progress=bar.task)
    except OSError as e:
        raise LayerstoreError(f"env create --from {image}: {e.filename or ''}: {e.strerror}") from None
    manifest, created = made.manifest, made.created
    if as_json:
        emit_json({**created.to_json(), "layers": [layer.to_json() for layer in manifest.layers],
                   "image_layers": len(made.built), "dropped_duplicates": made.dropped,
                   "config": manifest.config.to_json()})
        return
    click.echo(f"{created.tag} -> {created.manifest}")
    click.echo(f"  from {image}: {len(made.built)} image layer(s), {human_bytes(manifest.size)}"
               + (f", {made.dropped} duplicate(s) left out" if made.dropped else ""))
    for layer in manifest.layers:
        click.echo(f"  {layer.role:<10} {layer.blob}  {human_bytes(layer.size)}")
    click.echo(f"  argv       {manifest.config.argv}")
    cfg = manifest.config
    click.echo(f"  workdir    {cfg.workdir}" + (f"  user {cfg.user}" if cfg.user else ""))
    if created.signed_by is not None:
        click.echo(f"  signed by {created.signed_by}")


def _parse_annotations(items: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--annotation: want KEY=VALUE, got {item!r}")
        if key in out:
            raise ConfigError(f"--annotation: {key} is given twice")
        out[key] = value
    return out


@env_group.command("show")
@store_option
@json_option
@click.argument("ref")
def show_cmd(store_url: str | None, as_json: bool, ref: str) -> None:
    """Show the environment REF (NAME:TAG or a manifest digest)."""
    with open_store(store_url) as store:
        digest = envmod.resolve_ref(store, ref)
        manifest = envmod.load_manifest(store, digest)
        signers = envmod.verified_signers(store, digest)
    if as_json:
        emit_json({"manifest": digest, "ref": ref, "environment": manifest.to_json(),
                   "signed_by": [str(k) for k in signers]})
        return
    click.echo(f"environment {ref}" + ("" if ref == digest else f" -> {digest}"))
    click.echo(f"  size       {human_bytes(manifest.size)} in {len(manifest.layers)} layers")
    for layer in manifest.layers:
        hints = manifest.prefetch.get(layer.blob)
        extra = f", {len(hints)} chunks prefetched" if hints else ""
        click.echo(f"  {layer.role:<10} {layer.blob}  {human_bytes(layer.size)}{extra}")
    cfg = manifest.config
    click.echo(f"  argv       {cfg.argv}")
    click.echo(f"  workdir    {cfg.workdir}" + (f"  user {cfg.user}" if cfg.user else ""))
    for entry in cfg.env:
        click.echo(f"  env        {entry}")
    for k, v in sorted(manifest.annotations.items()):
        click.echo(f"  annotation {k}={v}")
    for key in signers:
        click.echo(f"  signed by  {key}")


@env_group.command("ls")
@store_option
@json_option
def ls_cmd(store_url: str | None, as_json: bool) -> None:
    """List environment tags and the manifests they point at."""
    with open_store(store_url) as store:
        envs = envmod.list_environments(store)
    rows = [{"tag": ref, "manifest": m} for ref, m in sorted(envs.items())]
    if as_json:
        emit_json(rows)
        return
    for row in rows:
        click.echo(f"{row['tag']} -> {row['manifest']}")


@env_group.command("keygen")
@click.option("--out", "out", type=_file, required=True, metavar="KEYFILE",
              help="Where to write the private key (PEM, mode 0600).")
@click.option("--force", is_flag=True, help="Replace KEYFILE if it exists.")
@json_option
def keygen_cmd(out: Path, force: bool, as_json: bool) -> None:
    """Make an ed25519 signing key; print its public key (for trust policies)."""
    from manifest.signing import PrivateKey

    key = PrivateKey.generate()
    files.write_private_key(out, key, force=force)
    if as_json:
        emit_json({"key_file": str(out), "public_key": str(key.public_key())})
    else:
        click.echo(str(key.public_key()))


@env_group.command("sign")
@store_option
@click.option("--key", "key_file", type=_file, required=True, metavar="KEYFILE", help="The ed25519 signing key.")
@json_option
@click.argument("ref")
def sign_cmd(store_url: str | None, key_file: Path, as_json: bool, ref: str) -> None:
    """Sign the existing environment REF."""
    from manifest.signing import sign_manifest

    key = files.read_private_key(key_file)
    with open_store(store_url) as store:
        digest = envmod.resolve_ref(store, ref)
        envmod.load_manifest(store, digest)  # only environments are signed
        signer = envmod.put_signature(store, sign_manifest(digest, key))
    if as_json:
        emit_json({"manifest": digest, "signed_by": str(signer)})
    else:
        click.echo(f"{digest} signed by {signer}")


@env_group.command("verify")
@store_option
@click.option("--policy", "policy_file", type=_file, required=True, metavar="FILE", envvar=files.POLICY_ENV,
              help='Trust policy JSON: {"require_signature": true, "trusted_keys": ["ed25519:..."]}. '
              f"Default: ${files.POLICY_ENV}.")
@json_option
@click.argument("ref")
def verify_cmd(store_url: str | None, policy_file: Path, as_json: bool, ref: str) -> None:
    """Check REF as a runtime would before mounting: manifest, signature policy, layers present."""
    policy = files.read_policy(policy_file)
    with open_store(store_url) as store:
        env = envmod.resolve_environment(store, ref, policy, check_layer_blobs=True)
    if as_json:
        emit_json({"manifest": env.digest, "ref": ref, "signed_by": [str(k) for k in env.signed_by]})
        return
    by = ", ".join(str(k) for k in env.signed_by) or "nobody (the policy does not require a signature)"
    click.echo(f"ok: {ref}" + ("" if ref == env.digest else f" -> {env.digest}") + f", signed by {by}")


def register(cli: click.Group) -> None:
    cli.add_command(env_group)
