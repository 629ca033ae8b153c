"""``conveyor trading …``: run the local peers, connect a broker, import a user's trades,
show a user's standing and trades, simulate a trade, make digests.

- ``peers``: the broker, market-data and AI-coach peers in the foreground (``broker=URL``,
  ``market=URL``, ``ai=URL`` on stdout), until SIGTERM or Ctrl-C.
- ``connect --user U --broker B --token-stdin``: keep the broker token, encrypted; the token is
  read from stdin (never an argument: argv is visible to every process on the machine).
- ``import --user U``: submit an import (then its score); ``job=<id> status=<s>``, with
  ``deduplicated`` when the same import was still pending. ``--wait S`` waits up to S seconds
  for the job and ends with ``job=<id> status=<s> fetched=N stored=N rejected=N``, exit 0
  only when it succeeded.
- ``status --user U``: trades, rejected rows, tags and ``coach.reflect`` events of the user.
- ``sim --user U --trade ID --horizon N``, ``digest --user U --start D --end D`` and
  ``digest-week [--week D]``: submit, wait (``--wait``, 60 s) and print the result.

A payload refused (a bad ``--user``, ``--since`` or ``--broker``) is one line on stderr
naming the field, exit 2, nothing recorded.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import typer

from conveyor.cli.main import err, json_option, load_platform, run_command, wait_option
from conveyor.cli.output import print_json, print_lines

if TYPE_CHECKING:
    from conveyor.client.handle import JobHandle

# The family's modules are imported inside the commands: `conveyor --help` imports this
# module to list the group.
app = typer.Typer(
    help="The trading family: broker trades imported, bias-scored and reflected on.",
    no_args_is_help=True,
)

DB_WAIT = 30.0  # `import` spends --wait on its job: the database gets the usual budget


def _user_option() -> Any:
    return typer.Option(..., "--user", help="the user's id (1-64 of A-Z a-z 0-9 . _ -)")


def _read_secret(prompt: str) -> str:
    """One secret from stdin: typed without echo on a terminal, else the first line."""
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass(prompt)
    return sys.stdin.readline().strip()


@app.command()
def peers(
    broker_port: int = typer.Option(0, min=0, max=65535, help="the broker peer's port (0: a free one)"),
    market_port: int = typer.Option(0, min=0, max=65535, help="the market-data peer's port (0: a free one)"),
    ai_port: int = typer.Option(0, min=0, max=65535, help="the AI coach peer's port (0: a free one)"),
    ai_key_id: str = typer.Option("dev", help="the key id the coach accepts (X-KeyId)"),
    ai_secret: str = typer.Option("dev-secret", help="the HMAC secret the coach checks (a dev value)"),
    ai_secret_stdin: bool = typer.Option(
        False, "--ai-secret-stdin", help="read the HMAC secret from stdin instead of --ai-secret"
    ),
) -> None:
    """Run the broker, market-data and AI-coach peers on 127.0.0.1 until SIGTERM or Ctrl-C.

    Prints ``broker=URL``, ``market=URL`` and ``ai=URL``, one a line.
    """
    from pipelines.trading.peers import serve

    secret = _read_secret("AI secret: ") if ai_secret_stdin else ai_secret
    if not secret:
        raise typer.BadParameter("the secret is empty", param_hint="--ai-secret")
    try:
        serve(broker_port, market_port, ai_port, ai_key_id, secret)
    except OSError as exc:  # a port taken, say
        err.print(f"error: the peers cannot listen: {exc.strerror or exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None


@app.command()
def connect(
    user: str = _user_option(),
    broker: str = typer.Option(..., "--broker", help="coinbase or binance"),
    token_stdin: bool = typer.Option(
        False, "--token-stdin", help="read the broker token from stdin (the only way to give it)"
    ),
    wait: float = wait_option(),
) -> None:
    """Keep the user's broker token, encrypted; a later connect replaces it.

    The token is read from stdin: ``conveyor trading connect ... --token-stdin < token.txt``.
    """
    if not token_stdin:
        raise typer.BadParameter(
            "the token is read from stdin only: pass --token-stdin", param_hint="--token-stdin"
        )
    token = _read_secret("broker token: ")

    def body() -> int:
        from pipelines.trading.jobs import connect_broker

        connect_broker(load_platform(), user, broker, token)
        print_lines([f"connected user={user} broker={broker}"])
        return 0

    run_command(body, wait=wait)  # connecting twice keeps the token once


@app.command("import")
def import_(
    user: str = _user_option(),
    since: str | None = typer.Option(None, "--since", help="YYYY-MM-DD, inclusive (default: 30 days ago)"),
    broker: str | None = typer.Option(
        None, "--broker", help="coinbase or binance (default: the connected one)"
    ),
    wait: float = typer.Option(
        0.0, "--wait", min=0, metavar="SECONDS", help="wait this long for the import to end (0: do not wait)"
    ),
    as_json: bool = json_option(),
) -> None:
    """Import the user's trades from their broker (then score them); prints the job.

    The same import again while the first is pending is that job (``deduplicated``).
    """

    def body() -> int:
        from conveyor.cli.output import retrying, wait_until_writable
        from conveyor.store.db.schema import SUCCEEDED, TERMINAL
        from pipelines.trading.jobs import submit_import

        platform = load_platform()
        wait_until_writable(platform.engine)
        handle = submit_import(platform, user, since=since, broker=broker)
        status = retrying(lambda: _waited(handle, wait))
        result = retrying(lambda: handle.result) if status == SUCCEEDED else None
        if as_json:
            print_json(
                {"job": handle.id, "status": status, "deduplicated": handle.deduplicated, "result": result}
            )
        elif wait > 0:
            counts = result if isinstance(result, dict) else {}
            numbers = " ".join(f"{k}={counts.get(k, 0)}" for k in ("fetched", "stored", "rejected"))
            score = f" score_job={counts['score_job']}" if counts.get("score_job") else ""
            print_lines([f"job={handle.id} status={status} {numbers}{score}"])
            _why(handle, status)
        else:
            print_lines([f"job={handle.id} status={status}{' deduplicated' if handle.deduplicated else ''}"])
        if wait <= 0:
            return 0
        if status not in TERMINAL:
            err.print(f"job {handle.id} still {status} after {wait:g}s", markup=False, highlight=False)
        return 0 if status == SUCCEEDED else 1

    # Not repeated after a lost connection (a finished import would run again): it waits
    # for the database before its first write instead.
    run_command(body, wait=DB_WAIT, repeat=False)


def _submit_and_wait(submit: Any, wait: float, as_json: bool, show: Any) -> None:
    """Submit (``submit(platform)``), wait up to ``wait`` s, print ``job=… status=…`` and
    ``show(result)``'s words (or the whole document with ``--json``); exit 0 on success."""

    def body() -> int:
        from conveyor.cli.output import retrying, wait_until_writable
        from conveyor.store.db.schema import SUCCEEDED, TERMINAL

        platform = load_platform()
        wait_until_writable(platform.engine)
        handle = submit(platform)
        status = retrying(lambda: _waited(handle, wait))
        result = retrying(lambda: handle.result) if status in TERMINAL else None
        if as_json:
            print_json(
                {"job": handle.id, "status": status, "deduplicated": handle.deduplicated, "result": result}
            )
        else:
            words = show(result) if isinstance(result, dict) and status == SUCCEEDED else ""
            print_lines([f"job={handle.id} status={status}{' ' + words if words else ''}"])
            _why(handle, status)
        if status not in TERMINAL:
            err.print(f"job {handle.id} still {status} after {wait:g}s", markup=False, highlight=False)
        return 0 if status == SUCCEEDED else 1

    run_command(body, wait=DB_WAIT, repeat=False)


def _why(handle: JobHandle, status: str) -> None:
    """Why a job did not succeed, on stderr: a dead one's error, a skipped one's reason."""
    from conveyor.cli.output import retrying
    from conveyor.store.db.schema import DEAD, SKIPPED

    if status == DEAD:
        error = retrying(lambda: handle.row()["last_error"]) or "no error recorded"
        err.print(f"error: {error}", markup=False, highlight=False)
    elif status == SKIPPED:
        skipped = [e for e in retrying(lambda: handle.events()[0]) if e.topic == "job.skipped"]
        reason = skipped[-1].body.get("reason") if skipped else "no reason recorded"
        err.print(f"skipped: {reason}", markup=False, highlight=False)


def _wait_option() -> Any:
    return typer.Option(60.0, "--wait", min=0, metavar="SECONDS", help="how long to wait for the job")


@app.command()
def sim(
    user: str = _user_option(),
    trade: str = typer.Option(..., "--trade", help="the stored trade's id (tradeId)"),
    horizon: int = typer.Option(7, "--horizon", help="days after the trade, 1-365"),
    wait: float = _wait_option(),
    as_json: bool = json_option(),
) -> None:
    """Simulate holding vs. what the trade did over the horizon; prints the delta."""
    from pipelines.trading.jobs import submit_sim

    def show(r: dict[str, Any]) -> str:
        return " ".join(f"{k}={r.get(k)}" for k in ("delta", "source", "cached", "partial"))

    _submit_and_wait(lambda platform: submit_sim(platform, user, trade, horizon), wait, as_json, show)


@app.command()
def digest(
    user: str = _user_option(),
    start: str = typer.Option(..., "--start", help="YYYY-MM-DD, inclusive"),
    end: str = typer.Option(..., "--end", help="YYYY-MM-DD, exclusive"),
    recompute: bool = typer.Option(False, "--recompute", help="compute the period again"),
    wait: float = _wait_option(),
    as_json: bool = json_option(),
) -> None:
    """The user's digest of a period (one per period; ``--recompute`` makes it again)."""
    from pipelines.trading.jobs import submit_digest

    def show(r: dict[str, Any]) -> str:
        return f"digest={r.get('digestId')} trades={r.get('trades')} snapshot={r.get('snapshot')}"

    _submit_and_wait(
        lambda platform: submit_digest(platform, user, start, end, recompute=recompute), wait, as_json, show
    )


@app.command()
def trades(
    user: str = _user_option(),
    limit: int = typer.Option(20, "--limit", min=1, max=1000, help="how many, newest first"),
    as_json: bool = json_option(),
    wait: float = wait_option(),
) -> None:
    """The user's newest stored trades: their tradeId (what ``sim --trade`` takes) and labels."""

    def body() -> int:
        from pipelines.trading.jobs import list_trades

        found = list_trades(load_platform(), user, limit=limit)
        if as_json:
            print_json(found)
        else:
            print_lines(
                f"{r['tradeId']}  {r['ts']}  {r['symbol']} {r['side']} {r['qty']} @ {r['price']}  "
                f"{','.join(r['labels']) or '-'}"
                for r in found
            )
        return 0

    run_command(body, wait=wait, read_only=True)


@app.command("digest-week")
def digest_week(
    week: str | None = typer.Option(None, "--week", help="any day of the ISO week (default: last week)"),
    wait: float = _wait_option(),
    as_json: bool = json_option(),
) -> None:
    """Submit a digest for every user of a week, as the Monday beat entry does."""
    from pipelines.trading.jobs import submit_fanout

    def show(r: dict[str, Any]) -> str:
        return f"week={r.get('week')} users={r.get('users')}"

    _submit_and_wait(lambda platform: submit_fanout(platform, week), wait, as_json, show)


def _waited(handle: JobHandle, seconds: float) -> str:
    """The job's status once terminal, or after ``seconds``."""
    if seconds <= 0:
        return handle.status()
    try:
        return handle.wait(timeout=seconds)
    except TimeoutError:
        return handle.status()


@app.command()
def status(user: str = _user_option(), as_json: bool = json_option(), wait: float = wait_option()) -> None:
    """The user's standing: brokers, trades, rejected rows, bias tags, reflect events."""

    def body() -> int:
        from pipelines.trading.jobs import user_status

        row = user_status(load_platform(), user)
        if as_json:
            print_json(row)
        else:
            shown = {**row, "brokers": ",".join(row["brokers"]) or "-"}
            print_lines(f"{k}: {v}" for k, v in shown.items())
        return 0

    run_command(body, wait=wait, read_only=True)
