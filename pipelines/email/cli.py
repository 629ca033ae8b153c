"""``conveyor email …``: send a message, show it, list the outbox, settle an unknown one.

``send`` prints the outbox id (``--json``: ``outbox_id``, ``job_id``, ``status``,
``deduplicated``); an invalid message, or another message under an outbox id already used
(a line with "conflict"), exits 1 with nothing recorded. Addresses are shown masked.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import typer

from conveyor.cli.main import err, json_option, load_platform, run_command, wait_option
from conveyor.cli.output import print_json, print_lines, print_table

# The family's modules are imported inside the commands: `conveyor --help` imports this
# module to list the group.
app = typer.Typer(
    help="The email family: send through the outbox, exactly once where the provider allows.",
    no_args_is_help=True,
)


def _headers(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        name, colon, text = value.partition(":")
        if not colon or not name.strip():
            raise typer.BadParameter("a header is 'Name: value'", param_hint="--header")
        out[name.strip()] = text.strip()
    return out


@app.command()
def send(
    company: str = typer.Option(..., help="the company (tenant) id, a UUID"),
    to: str = typer.Option(..., help="the recipient's address"),
    subject: str = typer.Option(..., help="1-150 characters, one line"),
    html_file: Path | None = typer.Option(
        None, exists=True, dir_okay=False, help="the HTML body (UTF-8), stored; or --html-ref"
    ),
    html_ref: str | None = typer.Option(None, help="an email_html id already stored; or --html-file"),
    outbox_id: str | None = typer.Option(None, help="the message's id (default: a new UUID)"),
    cc: list[str] = typer.Option([], help="a copy (up to 5)"),
    bcc: list[str] = typer.Option([], help="a blind copy (up to 5)"),
    reply_to: str | None = typer.Option(None, help="the Reply-To address"),
    header: list[str] = typer.Option([], help="'Name: value' (repeatable)"),
    tag: list[str] = typer.Option([], help="a tag (up to 5)"),
    recipient_id: str | None = typer.Option(None, help="the recipient's id, a UUID (or one of the next two)"),
    external_id: str | None = typer.Option(None, help="the recipient's id in your system"),
    cpf_cnpj: str | None = typer.Option(None, help="the recipient's CPF/CNPJ digits, hashed (HMAC) first"),
    priority: int = typer.Option(5, min=1, max=10, help="1 first ... 10 last"),
    delay: float = typer.Option(0.0, min=0, max=86399, help="seconds before it is sent (under 24 h)"),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """Send one message through the outbox (its job runs on a worker).

    Give one of --html-file or --html-ref, and at least one of --recipient-id,
    --external-id or --cpf-cnpj. Prints the outbox id (the job's id).
    """
    if (html_file is None) == (html_ref is None):
        raise typer.BadParameter("give one of --html-file or --html-ref")
    message_id = outbox_id or str(uuid.uuid4())  # one id, however often the body is run

    def main() -> int:
        from conveyor.errors import ConfigurationError, IdempotencyConflict, PayloadInvalid
        from pipelines.email.messages import email_settings, send_email
        from tasks.email.privacy import cpf_cnpj_hash

        platform = load_platform()
        recipient: dict[str, Any] = {"email": to, "recipientId": recipient_id, "externalId": external_id}
        try:
            if cpf_cnpj is not None:
                recipient["cpfCnpjHash"] = cpf_cnpj_hash(cpf_cnpj, email_settings(platform).pii_key_bytes())
            data = {
                "outboxId": message_id,
                "companyId": company,
                "requestId": f"cli-{uuid.uuid4()}",
                "to": to,
                "cc": cc,
                "bcc": bcc,
                "subject": subject,
                "htmlRef": html_ref or "",
                "replyTo": reply_to,
                "headers": _headers(header),
                "tags": tag,
                "recipient": {k: v for k, v in recipient.items() if v is not None},
                "attempt": 1,
                "enqueuedAt": dt.datetime.now(dt.UTC).isoformat(),
            }
            try:
                html = html_file.read_text(encoding="utf-8") if html_file is not None else None
            except UnicodeDecodeError:
                err.print(f"--html-file {html_file}: not UTF-8 text", markup=False, soft_wrap=True)
                return 1
            sent = send_email(platform, data, html=html, priority=priority, delay=delay)
        except (PayloadInvalid, IdempotencyConflict, ConfigurationError, ValueError) as exc:
            hint = ""
            if "recipient: at least one" in str(exc):
                hint = " (give --recipient-id, --external-id or --cpf-cnpj)"
            err.print(f"{exc}{hint}", markup=False, soft_wrap=True)
            return 1
        if as_json:
            print_json(sent.as_dict())
        else:
            suffix = " (deduplicated)" if sent.deduplicated else ""
            print_lines([f"{sent.outbox_id}{suffix}"])
        return 0

    run_command(main, wait=wait)


@app.command()
def show(outbox_id: str, as_json: bool = json_option(), wait: float = wait_option()) -> None:
    """One message: its outbox row and its job (addresses masked)."""

    def main() -> int:
        from pipelines.email.messages import show_message

        row = show_message(load_platform(), outbox_id)
        if row is None:
            err.print(f"no message {outbox_id}", markup=False)
            return 1
        if as_json:
            print_json(row)
        else:
            print_lines(f"{k}: {'' if v is None else v}" for k, v in row.items())
        return 0

    run_command(main, wait=wait, read_only=True)


@app.command("list")
def list_(
    status: str | None = typer.Option(None, help="PENDING, SENDING, SENT, FAILED, UNKNOWN or EXPIRED"),
    limit: int = typer.Option(50, min=1, max=1000),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """The newest messages of the outbox."""

    def main() -> int:
        from pipelines.email.messages import list_messages

        try:
            rows = list_messages(load_platform(), status=status.upper() if status else None, limit=limit)
        except ValueError as exc:
            err.print(str(exc), markup=False)
            return 1
        if as_json:
            print_json(rows)
        else:
            columns = ("outbox_id", "status", "to", "attempts", "updated_at", "last_error")
            print_table(columns, [[r[c] for c in columns] for r in rows], short={5: 60})
        return 0

    run_command(main, wait=wait, read_only=True)


@app.command()
def resolve(
    outbox_id: str,
    delivered: bool = typer.Option(False, "--delivered", help="it arrived: record SENT, send nothing"),
    resend: bool = typer.Option(False, "--resend", help="it did not: send it again (may duplicate)"),
    wait: float = wait_option(),
) -> None:
    """Settle a message whose delivery is UNKNOWN (held by on_unknown "hold")."""
    if delivered == resend:
        raise typer.BadParameter("give one of --delivered or --resend")

    def main() -> int:
        from pipelines.email.messages import NotResolvable
        from pipelines.email.messages import resolve as settle

        try:
            status = settle(load_platform(), outbox_id, delivered=delivered, by="cli")
        except NotResolvable as exc:
            err.print(str(exc), markup=False)
            return 1
        print_lines([f"{outbox_id}: {status}"])
        return 0

    run_command(main, wait=wait, repeat=False)
