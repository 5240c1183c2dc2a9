"""``retool secrets init``: mint the CA, certificates, tokens and Redis ACL of a deployment across
machines (see services/stack/secrets.py for what is written and docs/multinode.md for its use)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("init")
def init(
    out: Path = typer.Option(Path("deploy/secrets"), help="directory to create (made 0700)"),
    san: list[str] = typer.Option([], help="extra name or IP address the server certificates answer to "
                                  "(repeatable): each node's private address, a DNS name"),
    namespace: str = typer.Option("retool", help="Kubernetes namespace (for the in-cluster DNS names)"),
    force: bool = typer.Option(False, help="replace an existing, non-empty directory"),
    group: int | None = typer.Option(None, help="gid the secret files (0640) get; default: your primary "
                                     "group. Compose gives the containers this group (RETOOL_SECRETS_GID)"),
) -> None:
    """Write a private CA, server/client certificates, bearer tokens and the Redis ACL into OUT."""
    try:
        # lazy: cryptography is an optional extra (deploy/dev); only this command needs it
        from services.stack.secrets import init_secrets
    except ImportError as exc:  # cryptography is in the dev and deploy extras
        raise typer.BadParameter(f"{exc}: pip install 'retool[deploy]' (the cryptography package)") from None
    try:
        names = init_secrets(out, sans=san, namespace=namespace, force=force, group=group)
    except FileExistsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--out") from None
    except PermissionError as exc:
        raise typer.BadParameter(str(exc), param_hint="--group") from None
    typer.echo(f"wrote {len(names)} files to {out}: {', '.join(names)}")
    gid = (out / "redis.key").stat().st_gid
    typer.echo(f"keys, tokens and passwords are 0640, group {gid}: set RETOOL_SECRETS_GID={gid} in "
               "deploy/.env "
               "(compose gives the containers that group); keep ca.key offline (docs/multinode.md)")
