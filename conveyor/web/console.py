"""``/console``: the API's pages for a person in a browser, server-rendered (Jinja2) with a
few lines of JavaScript for live updates, and no build step.

A person signs in by pasting a token (``conveyor tokens create --scope read ...``); the
server verifies it and keeps it in a cookie that is ``HttpOnly``, ``SameSite=Strict``,
scoped to ``/console`` (``Secure`` over https). Only the console's routes read that
cookie: the JSON API keeps to bearer tokens, so a browser's ambient credentials never
reach it. Pages need scope ``read`` (a token sees its owner's jobs unless it is
``admin``); the dead-letter pages and their actions need ``admin``.

Every POST carries a CSRF value, checked before anything is done: an HMAC of a fixed
label keyed by the session's token, so the server keeps no state and a page of another
origin, which can neither read the cookie nor the page, cannot forge it.

Live updates: a page holds an ``EventSource`` on ``/console/stream`` (the event feed,
read with the cookie, since an ``EventSource`` cannot send an ``Authorization`` header)
and re-fetches its own server-rendered fragment (``?fragment=1``) when an event arrives.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode, urlsplit

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Response
from jinja2 import Environment, PackageLoader
from sqlalchemy import func, select
from starlette.responses import HTMLResponse, RedirectResponse
from starlette.status import HTTP_303_SEE_OTHER

from conveyor.store.db.engine import reading
from conveyor.store.db.schema import (
    CANCELLED,
    DEAD,
    EXPIRED,
    QUEUED,
    RETRYING,
    RUNNING,
    SKIPPED,
    SUCCEEDED,
    THROTTLED,
    WAITING_DEDUP,
    WAITING_LEASE,
    job_events,
    jobs,
)
from conveyor.web import dead_letters, events, tokens
from conveyor.web.auth import Caller, client_of
from conveyor.web.events import FeedEvent
from conveyor.web.feed import FeedFilter, body_field, head_cursor, owned_by
from conveyor.web.problems import TYPE_PREFIX, Problem

router = APIRouter(prefix="/console", include_in_schema=False)

COOKIE = "conveyor_console"
CSRF_FIELD = "csrf"
RECENT = 50  # jobs and dead-letter entries a page lists
BATCH_EVENTS = 1000  # the latest events with a batch_id the batches page reads
STATES: tuple[str, ...] = (QUEUED, WAITING_LEASE, WAITING_DEDUP, THROTTLED, RUNNING, RETRYING)
STATES += (SUCCEEDED, DEAD, CANCELLED, EXPIRED, SKIPPED)
FINISHED_COUNTERS = ("ready", "succeeded", "failed", "dead", "cancelled", "skipped", "expired")
STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
# Pages load their own script and style only; none may be framed (clickjacking a Retry).
CSP = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'; form-action 'self'"
)

templates = Environment(loader=PackageLoader("conveyor.web", "templates"), autoescape=True)


class Answer(Exception):
    """A response to send instead of the page: the sign-in redirect, a 403 or 404 page."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


@dataclass(frozen=True)
class Session:
    """A signed-in person: the token their cookie holds."""

    caller: Caller
    secret: str

    @property
    def csrf(self) -> str:
        """The value every form of this session carries."""
        return hmac.new(self.secret.encode(), b"conveyor-console-csrf", hashlib.sha256).hexdigest()


def _base(request: Request) -> str:
    return f"{request.scope.get('root_path', '')}/console"


def render(
    request: Request, name: str, session: Session | None = None, status: int = 200, **context: object
) -> HTMLResponse:
    """Template ``name`` as a page of the console (or a fragment of one)."""
    html = templates.get_template(name).render(base=_base(request), session=session, **context)
    return HTMLResponse(html, status_code=status, headers={"Content-Security-Policy": CSP})


def _to_login(request: Request, *, forget: bool = False) -> RedirectResponse:
    answer = RedirectResponse(f"{_base(request)}/login", status_code=HTTP_303_SEE_OTHER)
    if forget:
        answer.delete_cookie(COOKIE, path=_base(request))
    return answer


def needs(scope: str) -> Any:
    """A dependency: the session of the request's cookie, whose token must allow ``scope``
    (no cookie, or a dead token: to the sign-in page; a missing scope: a 403 page)."""

    def session(request: Request) -> Session:
        secret = request.cookies.get(COOKIE)
        if not secret:
            raise Answer(_to_login(request))
        token = tokens.verify(client_of(request).connections.engine, secret)
        if token is None:
            raise Answer(_to_login(request, forget=True))
        found = Session(Caller(token), secret)
        if not token.allows(scope):
            detail = f"This page needs a token with the '{scope}' scope; yours has {_scopes(token)}."
            raise Answer(render(request, "error.html", found, 403, title="Forbidden", detail=detail))
        return found

    return Depends(session)


def _scopes(token: tokens.Token) -> str:
    return ", ".join(sorted(token.scopes)) or "none"


Viewer = Annotated[Session, needs(tokens.READ)]
Operator = Annotated[Session, needs(tokens.ADMIN)]
Fragment = Annotated[bool, Query(description="only the part a page updates live")]


async def form(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (the first value of each)."""
    fields = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=20)
    return {k: v[0] for k, v in fields.items()}


Form = Annotated[dict[str, str], Depends(form)]


def _checked(request: Request, session: Session, fields: dict[str, str]) -> None:
    if not hmac.compare_digest(fields.get(CSRF_FIELD, ""), session.csrf):
        detail = "The form carried no valid CSRF value: reload the page and try again."
        raise Answer(render(request, "error.html", session, 403, title="Forbidden", detail=detail))


def _back(request: Request, path: str, **notice: str) -> RedirectResponse:
    query = f"?{urlencode(notice)}" if notice else ""
    return RedirectResponse(f"{_base(request)}{path}{query}", status_code=HTTP_303_SEE_OTHER)


@router.get("/login")
def login_page(request: Request) -> HTMLResponse:
    """The sign-in form."""
    return render(request, "login.html")


@router.post("/login")
def login(request: Request, fields: Form) -> Response:
    """Verify the pasted token and keep it in the session cookie. A sign-in posted from
    another site is refused: it would sign this browser in as someone else."""
    if _cross_site(request):
        return render(request, "login.html", status=403, error="Sign in from this page itself.")
    secret = fields.get("token", "").strip()
    token = tokens.verify(client_of(request).connections.engine, secret) if secret else None
    if token is None:
        error = "That token is not valid (unknown, revoked or mistyped)."
        return render(request, "login.html", status=401, error=error)
    if not token.allows(tokens.READ):
        error = f"That token lacks the 'read' scope (it has {_scopes(token)})."
        return render(request, "login.html", status=403, error=error)
    answer = _back(request, "")
    answer.set_cookie(
        COOKIE,
        secret,
        path=_base(request),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return answer


def _cross_site(request: Request) -> bool:
    """Whether a form post came from another origin (``Sec-Fetch-Site``, else ``Origin``)."""
    fetched = request.headers.get("sec-fetch-site")
    if fetched is not None:
        return fetched not in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin == "null"
    return urlsplit(origin).netloc != request.headers.get("host", request.url.netloc)


@router.post("/logout")
def logout(request: Request, session: Viewer, fields: Form) -> Response:
    """Forget the session cookie."""
    _checked(request, session, fields)
    return _to_login(request, forget=True)


@router.get("")
def jobs_page(
    request: Request,
    session: Viewer,
    state: Annotated[str | None, Query(max_length=20)] = None,
    fragment: Fragment = False,
) -> HTMLResponse:
    """Jobs by state: a count per state and the latest jobs (of one state, when given)."""
    engine = client_of(request).connections.engine
    head = head_cursor(engine)  # before the read: any later change reaches the page live
    mine = [] if session.caller.token.admin else [jobs.c.owner == session.caller.owner]
    listed = select(
        jobs.c.id, jobs.c.stage, jobs.c.status, jobs.c.label, jobs.c.owner, jobs.c.created_at
    ).where(*mine)
    if state:
        listed = listed.where(jobs.c.status == state)
    with reading(engine) as conn:
        per_state = select(jobs.c.status, func.count()).where(*mine).group_by(jobs.c.status)
        found: dict[str, int] = {str(s): int(n) for s, n in conn.execute(per_state).all()}
        recent = list(conn.execute(listed.order_by(jobs.c.created_at.desc()).limit(RECENT)).mappings())
    others = [(s, n) for s, n in sorted(found.items()) if s not in STATES]
    counts = [(s, found.get(s, 0)) for s in STATES] + others
    context = {"counts": counts, "recent": recent, "state": state, "total": sum(n for _, n in counts)}
    query = f"?{urlencode({'state': state})}" if state else ""
    return _live(request, session, "jobs", "", fragment, context, stream={"since": head}, refresh=query)


@router.get("/jobs/{job_id}")
def job_page(
    request: Request,
    session: Viewer,
    job_id: Annotated[str, Path(min_length=1, max_length=64)],
    fragment: Fragment = False,
) -> HTMLResponse:
    """One job and its timeline (its events, oldest first)."""
    client = client_of(request)
    head = head_cursor(client.connections.engine)
    try:
        row = client.job(job_id).row()
    except LookupError:
        row = None
    if row is None or not session.caller.sees(row["owner"]):
        detail = f"No job {job_id}."
        raise Answer(render(request, "error.html", session, 404, title="Not Found", detail=detail))
    with reading(client.connections.engine) as conn:
        timeline = list(
            conn.execute(
                select(job_events.c.topic, job_events.c.body, job_events.c.created_at)
                .where(job_events.c.job_id == job_id)
                .order_by(job_events.c.id)
            ).mappings()
        )
    context = {"job": row, "timeline": [(e["topic"], e["created_at"], _brief(e["body"])) for e in timeline]}
    stream = {"since": head, "job": job_id}
    return _live(request, session, "job", f"/jobs/{job_id}", fragment, context, stream=stream)


REFUSALS = {
    "not-retryable": "Not retried: the entry is retried already, or its job is no longer dead.",
    "retry-refused": "Not retried: another job holds its dedup id (a submit would return it).",
    "not-found": "Not retried: there is no such entry (purged?).",
}


@router.get("/dead-letters")
def dead_letters_page(
    request: Request,
    session: Operator,
    fragment: Fragment = False,
    retried: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._:-]{1,64}$")] = None,
    requested: Annotated[int | None, Query(ge=1)] = None,
    refused: Annotated[str | None, Query(pattern=r"^[a-z-]{1,40}$")] = None,
    done: Annotated[str | None, Query(pattern=r"^\d{1,9},\d{1,9},\d{1,9}$")] = None,
) -> HTMLResponse:
    """The open dead-letter entries, newest first, each with a Retry button; Retry all.

    What the last action did comes back in the query as ids, counts and a kind, never as
    text: a crafted link cannot make the page say anything of its choosing."""
    client = client_of(request)
    head = head_cursor(client.connections.engine)
    entries = client.dlq.scan(limit=RECENT)
    notice = None
    if retried:
        notice = f"Job {retried} is queued again."
    elif requested:
        notice = f"Retry of entry {requested} requested: a worker performs it (its stage has a hook)."
    elif done:
        n_retried, n_requested, n_refused = done.split(",")
        notice = f"{n_retried} retried, {n_requested} requested of a worker, {n_refused} refused."
    refused = REFUSALS.get(refused or "", "Not retried.") if refused else None
    context = {"entries": entries, "notice": notice, "refused": refused}
    return _live(request, session, "dead-letters", "/dead-letters", fragment, context, stream={"since": head})


@router.post("/dead-letters/{entry_id}/retry")
def retry_one(
    request: Request, session: Operator, fields: Form, entry_id: Annotated[int, Path(ge=1, le=2**63 - 1)]
) -> Response:
    """Retry one entry, as the API's ``POST /dead-letters/{id}/retry`` does."""
    _checked(request, session, fields)
    try:
        done = dead_letters.retry(request, Response(), session.caller, entry_id)
    except Problem as exc:
        return _back(request, "/dead-letters", refused=exc.type.removeprefix(TYPE_PREFIX) or "refused")
    if done.requested:
        return _back(request, "/dead-letters", requested=str(entry_id))
    return _back(request, "/dead-letters", retried=done.job_id)


@router.post("/dead-letters/retry")
def retry_all(request: Request, session: Operator, fields: Form) -> Response:
    """Retry every open entry, as the API's ``POST /dead-letters/retry`` with no filter."""
    _checked(request, session, fields)
    done = dead_letters.retry_all(request, session.caller, dead_letters.RetryAllRequest(all=True))
    counts = f"{done.retried},{len(done.requested)},{len(done.refused)}"
    return _back(request, "/dead-letters", done=counts)


@router.get("/batches")
def batches_page(request: Request, session: Viewer, fragment: Fragment = False) -> HTMLResponse:
    """Batch progress: the latest counters of each batch, from events whose body has a
    ``batch_id`` (a batch is a deployment's notion; the counters are read generically)."""
    engine = client_of(request).connections.engine
    head = head_cursor(engine)
    with reading(engine) as conn:
        batch = body_field(conn.dialect.name, "batch_id")
        q = select(job_events.c.topic, job_events.c.body, job_events.c.created_at).where(batch.is_not(None))
        if not session.caller.token.admin:
            q = owned_by(q, conn.dialect.name, session.caller.owner)
        rows = list(conn.execute(q.order_by(job_events.c.id.desc()).limit(BATCH_EVENTS)).mappings())
    latest: dict[str, Any] = {}
    for r in rows:
        latest.setdefault(str(r["body"]["batch_id"]), r)
    context = {"batches": [_progress(b, r["topic"], r["body"], r["created_at"]) for b, r in latest.items()]}
    return _live(request, session, "batches", "/batches", fragment, context, stream={"since": head})


@dataclass(frozen=True)
class Progress:
    """A batch as its latest event counts it."""

    batch_id: str
    topic: str
    at: dt.datetime
    done: int
    total: int | None
    counters: list[tuple[str, int]]


def _progress(batch_id: str, topic: str, body: dict[str, Any], at: dt.datetime) -> Progress:
    counters = [(k, v) for k, v in body.items() if isinstance(v, int) and not isinstance(v, bool)]
    numbers = dict(counters)
    total = numbers.get("total")
    if topic.endswith(".completed") and total is not None:
        done = total
    elif "terminal" in numbers:
        done = numbers["terminal"]
    else:
        done = sum(numbers.get(k, 0) for k in FINISHED_COUNTERS)
    return Progress(batch_id, topic, at, done, total, [(k, v) for k, v in counters if k != "total"])


def _brief(body: dict[str, Any], limit: int = 300) -> str:
    text = json.dumps(body, default=str, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _live(
    request: Request,
    session: Session,
    page: str,
    path: str,
    fragment: bool,
    context: dict[str, Any],
    *,
    stream: dict[str, str],
    refresh: str = "",
) -> HTMLResponse:
    """Template ``page`` at ``path`` (or its fragment), which re-fetches the fragment on each
    event of ``stream``."""
    if fragment:
        return render(request, f"_{page}.html", session, **context)
    separator = "&" if refresh else "?"
    urls = {
        "fragment_url": f"{_base(request)}{path}{refresh}{separator}fragment=1",
        "stream_url": f"{_base(request)}/stream?{urlencode(stream)}",
    }
    return render(request, f"{page}.html", session, 200, page=page, **urls, **context)


@router.get("/stream")
async def stream(
    request: Request,
    session: Viewer,
    since: Annotated[str | None, Query(max_length=100)] = None,
    job: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    """``GET /events/stream`` for the console's pages, with the cookie: each event as an
    unnamed message (an ``EventSource`` hears those without naming every topic)."""
    caller = session.caller
    where = FeedFilter(job=job, owner=None if caller.token.admin else caller.owner)
    last = request.headers.get("last-event-id")
    return await events.open_stream(request, where, since, last, _frame)


def _frame(event: FeedEvent) -> str:
    data = json.dumps({"topic": event.topic, "job_id": event.job_id})
    return f"id: {event.position}\ndata: {data}\n\n"


@router.get("/static/{name}")
def static(name: str) -> Response:
    """The console's style sheet and script."""
    if name not in STATIC:
        raise Problem(404, "not-found", "Not Found", f"no file {name}")
    body = files("conveyor.web").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC[name], headers={"Cache-Control": "max-age=300"})


def install(app: FastAPI) -> None:
    """Serve the console on ``app``."""
    app.include_router(router)
    app.add_exception_handler(Answer, _answer)


async def _answer(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Answer)
    return exc.response


__all__ = ["install", "router"]
