"""``conveyor publisher …``: schedule a post, show, list, edit, cancel, replay and test posts.

``schedule`` prints the post's id (``--json``: ``id``, ``status``, ``idempotency_key``,
``job_id``, ``existing``; ``--preview``: the normalised document, nothing recorded). A plan
refused prints one line naming the field and exits 1, as does an unknown id or a post that
cannot change now (its code: ``post-not-pending``, ``post-not-failed``,
``idempotency-key-taken``). ``test`` prints whether a post would run then and inserts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from conveyor.cli.main import err, json_option, load_platform, run_command, wait_option
from conveyor.cli.output import print_json, print_lines, print_table

# The family's modules are imported inside the commands: `conveyor --help` imports this
# module to list the group.
app = typer.Typer(
    help="The publisher family: scheduled Facebook and Instagram posts, published once.",
    no_args_is_help=True,
)

LIST_COLUMNS = ("id", "channel", "account", "status", "scheduled_at", "attempts", "remote_id", "last_error")


def _placeholders(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        name, eq, text = value.partition("=")
        if not eq or not name.strip():
            raise typer.BadParameter("a placeholder is 'name=value'", param_hint="--placeholder")
        out[name.strip()] = text
    return out


def _guarded(body: Callable[[], int]) -> Callable[[], int]:
    """``body`` with the family's refusals as one line on stderr and exit 1."""

    def main() -> int:
        from pipelines.publisher.posts import PostConflict, PostNotFound
        from tasks.publisher.plans import PlanInvalid

        try:
            return body()
        except PlanInvalid as exc:
            err.print(str(exc), markup=False, soft_wrap=True, highlight=False)
        except PostNotFound as exc:
            err.print(str(exc), markup=False, soft_wrap=True, highlight=False)
        except PostConflict as exc:
            err.print(f"{exc} ({exc.code})", markup=False, soft_wrap=True, highlight=False)
        except OverflowError:  # a time at the edge of Python's years 1-9999, moved past it
            err.print("--at: the time is out of range (years 1-9999, a minute inside)", markup=False)
        return 1

    return main


def _print_record(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(row)
    else:
        print_lines(f"{k}: {'' if v is None else v}" for k, v in row.items())


def _print_status(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(row)
    else:
        print_lines([f"{row['id']}: {row['status']}"])


@app.command()
def schedule(
    brand: str = typer.Option(..., help="the brand (blackout windows may name it)"),
    channel: str = typer.Option(..., help="facebook or instagram"),
    account: str = typer.Option(..., help="the page or Instagram account"),
    caption: str = typer.Option(..., help="the text; {name} is filled from --placeholder"),
    at: str = typer.Option(..., "--at", help="ISO 8601 with an offset (a past time runs now)"),
    media: list[str] = typer.Option([], help="an image or link URL (repeatable; Instagram: one+)"),
    first_comment: str | None = typer.Option(None, help="Instagram: a first comment, posted once"),
    key: str | None = typer.Option(None, help="the idempotency key (default: derived from the plan)"),
    preview: bool = typer.Option(False, "--preview", help="normalise only: nothing recorded or posted"),
    placeholder: list[str] = typer.Option([], help="'name=value' for the caption (repeatable)"),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """Schedule one post (its job runs on a worker when due); prints its id.

    The same plan again is the same post (``(existing)``), nothing else written.
    """
    values = _placeholders(placeholder)

    def body() -> int:
        from pipelines.publisher.posts import Plan, schedule_post

        plan = Plan(
            brand=brand,
            channel=channel,
            account=account,
            caption=caption,
            scheduled_at=at,
            media=tuple(media),
            placeholders=values,
            first_comment=first_comment,
            idempotency_key=key,
            preview=preview,
        )
        done = schedule_post(load_platform(), plan)
        if done.preview is not None:
            _print_record(done.preview, as_json)
        elif as_json:
            print_json(done.as_dict())
        else:
            print_lines([done.id])
            if done.existing:
                err.print(
                    f"{done.id}: an existing post (the same plan), nothing written",
                    markup=False,
                    soft_wrap=True,
                )
        return 0

    # Safe to run again after a lost connection: the plan's key makes it the same post.
    run_command(_guarded(body), wait=wait)


@app.command()
def show(post_id: str, as_json: bool = json_option(), wait: float = wait_option()) -> None:
    """One post: its record and its job's status."""

    def body() -> int:
        from pipelines.publisher.posts import show_post

        _print_record(show_post(load_platform(), post_id), as_json)
        return 0

    run_command(_guarded(body), wait=wait, read_only=True)


@app.command("list")
def list_(
    status: str | None = typer.Option(None, help="pending, running, completed, failed or cancelled"),
    limit: int = typer.Option(50, min=1, max=1000),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """The newest posts."""

    def body() -> int:
        from pipelines.publisher.posts import list_posts

        rows = list_posts(load_platform(), status=status.lower() if status else None, limit=limit)
        if as_json:
            print_json(rows)
        else:
            print_table(LIST_COLUMNS, [[r[c] for c in LIST_COLUMNS] for r in rows], short={7: 60})
        return 0

    run_command(_guarded(body), wait=wait, read_only=True)


@app.command()
def edit(
    post_id: str,
    caption: str | None = typer.Option(None, help="the new text (a template: give --placeholder)"),
    media: list[str] = typer.Option([], help="the new media, replacing all (repeatable)"),
    at: str | None = typer.Option(None, "--at", help="the new time, ISO 8601 with an offset"),
    placeholder: list[str] = typer.Option([], help="'name=value' for the caption (repeatable)"),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """Change a pending post's caption, media or time (its key is computed again)."""
    values = _placeholders(placeholder)

    def body() -> int:
        from pipelines.publisher.posts import edit_post

        row = edit_post(
            load_platform(),
            post_id,
            caption=caption,
            media=media or None,
            scheduled_at=at,
            placeholders=values or None,
        )
        _print_status(row, as_json)
        return 0

    run_command(_guarded(body), wait=wait)


@app.command()
def cancel(post_id: str, as_json: bool = json_option(), wait: float = wait_option()) -> None:
    """Cancel a pending post (and its job)."""

    def body() -> int:
        from pipelines.publisher.posts import cancel_post

        row = cancel_post(load_platform(), post_id, by="cli")
        _print_status(row, as_json)
        return 0

    run_command(_guarded(body), wait=wait, repeat=False)


@app.command()
def replay(post_id: str, as_json: bool = json_option(), wait: float = wait_option()) -> None:
    """Replay a failed post now: same key, a fresh attempt budget.

    A post already published (it has a remote id) comes back as it is.
    """

    def body() -> int:
        from pipelines.publisher.posts import replay_post

        row = replay_post(load_platform(), post_id, by="cli")
        _print_status(row, as_json)
        return 0

    run_command(_guarded(body), wait=wait, repeat=False)


@app.command()
def test(
    channel: str = typer.Option(..., help="facebook or instagram"),
    account: str = typer.Option(..., help="the page or Instagram account"),
    at: str = typer.Option(..., "--at", help="ISO 8601 with an offset"),
    brand: str = typer.Option("", help="the brand (its blackout windows)"),
    caption: str = typer.Option("", help="with a caption or media: the post's key"),
    media: list[str] = typer.Option([], help="an image or link URL (repeatable)"),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """Would a post run then? Blackout, busy channel or account, its key. Inserts nothing."""

    def body() -> int:
        from pipelines.publisher.posts import check_post

        out = check_post(
            load_platform(),
            channel=channel,
            account=account,
            at=at,
            brand=brand,
            caption=caption,
            media=media,
        )
        if as_json:
            print_json(out)
        else:
            blackout = out["blackout"]
            held = f"{blackout['window']} until {blackout['until']}" if blackout else "no"
            print_lines(
                [
                    f"would_run: {'yes' if out['would_run'] else 'no'}",
                    f"blackout: {held}",
                    f"channel_busy: {'yes' if out['channel_busy'] else 'no'}",
                    f"account_busy: {'yes' if out['account_busy'] else 'no'}",
                    f"token: {'yes' if out['token'] else 'no'}",
                    f"idempotency_key: {out['idempotency_key'] or ''}",
                    f"existing: {out['existing'] or ''}",
                ]
            )
        return 0

    run_command(_guarded(body), wait=wait, read_only=True)
