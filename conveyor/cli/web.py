"""``conveyor serve`` (the HTTP API under uvicorn), ``conveyor openapi`` and
``conveyor tokens create/list/revoke``.

These are the caller's side: they need the services' URLs (``CONVEYOR_*``, or a running
``conveyor up``) and Conveyor's tables, not the deployment's code; ``serve`` and
``openapi`` add the routers a deployment names in ``HTTP_EXTENSIONS`` when there is one
(:mod:`conveyor.web.server`). They need the ``web`` extra, imported only when they run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from conveyor.cli import output as out
from conveyor.cli.common import attached_engine, attached_settings, cli, run_command
from conveyor.cli.output import console, err, json_option, wait_option
from conveyor.errors import ConfigurationError

if TYPE_CHECKING:
    from conveyor.web.tokens import Token

tokens_cli = typer.Typer(help="Bearer tokens of the HTTP API.", no_args_is_help=True)
cli.add_typer(tokens_cli, name="tokens")

TOKEN_COLUMNS = ["id", "owner", "name", "scopes", "created", "last used", "revoked"]


def _web_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigurationError("the HTTP API needs the web extra: pip install 'conveyor[web]'") from None


@cli.command("serve")
def serve(
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, help="TCP port"),
    workers: int = typer.Option(1, min=1, help="server processes (each with its own connections)"),
    proxy_headers: bool = typer.Option(
        False, help="trust X-Forwarded-For/-Proto from --forwarded-allow-ips (behind a proxy)"
    ),
    forwarded_allow_ips: str = typer.Option("127.0.0.1", help="proxies trusted with --proxy-headers"),
    root_path: str = typer.Option("", help="the path prefix a proxy serves the API under"),
) -> None:
    """Serve the HTTP API (uvicorn; settings from CONVEYOR_*, or a running `conveyor up`)."""

    def main() -> int:
        _web_extra()
        import uvicorn

        settings = attached_settings()
        assert settings.redis_url and settings.database_url
        # Each server process builds its app from the environment (uvicorn's factory).
        os.environ["CONVEYOR_REDIS_URL"] = settings.redis_url
        os.environ["CONVEYOR_DATABASE_URL"] = settings.database_url
        uvicorn.run(
            "conveyor.web.server:app_from_environment",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            proxy_headers=proxy_headers,
            forwarded_allow_ips=forwarded_allow_ips if proxy_headers else None,
            root_path=root_path,
            log_config=None,  # Conveyor's renderer (conveyor.logs), set up by the factory
            server_header=False,
            timeout_graceful_shutdown=30,
        )
        return 0

    run_command(main)


@cli.command("openapi")
def openapi(
    output: Path = typer.Option(None, "--output", "-o", help="write here (default: standard output)"),
) -> None:
    """Print the HTTP API's OpenAPI document (the repository keeps it as docs/openapi.json)."""

    def main() -> int:
        _web_extra()
        from conveyor.web.server import openapi_document

        document = openapi_document()
        if output is None:
            sys.stdout.write(document)
        else:
            output.write_text(document, encoding="utf-8")
        return 0

    run_command(main)


@tokens_cli.command("create")
def tokens_create(
    owner: str = typer.Option(..., help="whose jobs the token submits and sees"),
    scope: list[str] = typer.Option(..., "--scope", help="read, submit or admin (repeat for more)"),
    name: str = typer.Option(None, help="what it is for (shown by `tokens list`)"),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """Create a token; its secret is printed once, here, and never again."""

    def main() -> int:
        from conveyor.web import tokens

        engine = attached_engine()
        try:
            out.wait_until_writable(engine)
            created = tokens.create(engine, owner=owner, scopes=scope, name=name)
        finally:
            engine.dispose()
        token = created.token
        if as_json:
            out.print_json({**_record(token), "token": created.secret})
            return 0
        # The secret alone on stdout (TOKEN=$(conveyor tokens create ...)); the rest on stderr.
        out.status(
            f"token {token.id} for {token.owner} ({' '.join(sorted(token.scopes))}); "
            "keep it now, it is not shown again:"
        )
        out.print_lines([created.secret])
        return 0

    run_command(main, wait=wait, repeat=False)


@tokens_cli.command("list")
def tokens_list(
    owner: str = typer.Option(None, help="only this owner's"),
    revoked: bool = typer.Option(False, "--revoked", help="revoked tokens too"),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """Tokens, oldest first (never their secrets)."""

    def main() -> int:
        from conveyor.web import tokens

        engine = attached_engine()
        try:
            found = tokens.listed(engine, owner=owner, include_revoked=revoked)
        finally:
            engine.dispose()
        if as_json:
            out.print_json([_record(t) for t in found])
            return 0
        out.print_table(TOKEN_COLUMNS, [_cells(t) for t in found], title="tokens")
        return 0

    run_command(main, wait=wait, read_only=True)


@tokens_cli.command("revoke")
def tokens_revoke(token_id: str, wait: float = wait_option()) -> None:
    """Revoke a token (by its id, as `tokens list` shows it): it stops working at once."""

    def main() -> int:
        from conveyor.web import tokens

        engine = attached_engine()
        try:
            token = tokens.revoke(engine, token_id)
        except LookupError as exc:
            err.print(str(exc), markup=False)
            return 1
        finally:
            engine.dispose()
        console.print(f"token {token.id} of {token.owner}: revoked", markup=False)
        return 0

    run_command(main, wait=wait)


def _record(token: Token) -> dict[str, object]:
    return {
        "id": token.id,
        "owner": token.owner,
        "name": token.name,
        "scopes": sorted(token.scopes),
        "created_at": token.created_at,
        "last_used_at": token.last_used_at,
        "revoked_at": token.revoked_at,
    }


def _cells(token: Token) -> list[object]:
    return [
        token.id,
        token.owner,
        token.name or "",
        " ".join(sorted(token.scopes)),
        token.created_at,
        token.last_used_at or "",
        token.revoked_at or "",
    ]


STAGE_COLUMNS = ["stage", "queue", "max attempts", "dedup", "lease key", "on_retry hook", "updated"]


@cli.command("stages")
def stages_list(as_json: bool = json_option(), wait: float = wait_option()) -> None:
    """The stages the deployment's workers registered: what a client may submit by name."""

    def main() -> int:
        from conveyor.client import registry

        engine = attached_engine()
        try:
            found = sorted(registry.load(engine).values(), key=lambda r: r.name)
        finally:
            engine.dispose()
        if as_json:
            out.print_json(
                [
                    {
                        "name": r.name,
                        "queue": r.queue,
                        "max_attempts": r.max_attempts,
                        "dedup": r.dedup,
                        "lease_key": r.lease_key,
                        "on_retry": r.on_retry,
                        "payload_schema": r.payload_schema,
                        "updated_at": r.updated_at,
                    }
                    for r in found
                ]
            )
            return 0
        rows = [
            [
                r.name,
                r.queue,
                r.max_attempts,
                (r.dedup or {}).get("mode", "") if r.dedup else "",
                r.lease_key or "",
                {True: "yes", False: "no", None: "?"}[r.on_retry],
                r.updated_at or "",
            ]
            for r in found
        ]
        out.print_table(STAGE_COLUMNS, rows, title="stages")
        return 0

    run_command(main, wait=wait, read_only=True)


__all__ = ["serve", "stages_list", "tokens_cli"]
