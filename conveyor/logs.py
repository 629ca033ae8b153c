"""Structured logs: one renderer for structlog and stdlib records, per-job context, redaction.

:func:`configure_logging` puts a single handler on the root logger whose
``structlog.stdlib.ProcessorFormatter`` renders every record, Conveyor's, Celery's and a
stage's, as JSON lines or as console text (``CONVEYOR_LOG_FORMAT``). Before anything is
rendered, :func:`redact` masks the values of secret-looking keys and scrubs secrets and
e-mail addresses out of every string (the message, its ``%``-args, tracebacks). A line
logged while an OpenTelemetry span is current carries its ``trace_id`` and ``span_id``.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from logging.handlers import WatchedFileHandler
from typing import TYPE_CHECKING, Any, TextIO, TypeAlias

# structlog and OpenTelemetry are imported where they are used: a command that logs nothing
# (`conveyor --help`) imports this module for redaction and must not load them.
if TYPE_CHECKING:
    from structlog.stdlib import BoundLogger
    from structlog.typing import EventDict, Processor, WrappedLogger

    from conveyor.settings import ConveyorSettings

MASK = "***"
JOB_KEYS = ("job_id", "stage", "attempt", "queue")
JOB_LOGGER = "conveyor.job"
HANDLER_NAME = "conveyor"
JobTokens: TypeAlias = Mapping[str, contextvars.Token[Any]]

_SECRET_WORD = (
    r"(?:password|passwd|passphrase|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key"
    r"|authori[sz]ation|cookie|dsn|credential|session[_-]?id)"
)
_SECRET_KEY = re.compile(_SECRET_WORD, re.IGNORECASE)
# ``scheme://user:password@host``: the password goes, the user and host stay.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]{0,30}://[^\s:/?#@]*):[^\s/?#]*@")
# ``token=…``, ``password: …``, ``'api_key': '…'``, ``Authorization: Bearer …``.
_INLINE = re.compile(
    # The look-ahead and the possessive key keep this linear on long runs of word characters.
    rf"(?<![\w-])(?=[\w-]*?{_SECRET_WORD})(?P<key>[\w-]++)(?P<sep>[\"']?\s*[:=]\s*)"
    r"(?P<value>\"[^\"]*\"|'[^']*'|(?P<scheme>(?:bearer|basic|digest|token)\s+)?[^\s&;,\"'<>()\[\]{}]+)",
    re.IGNORECASE,
)
# A command line: ``--password S3CR3T``, ``-token 'a b'`` (a long option after it is no value).
_OPTION = re.compile(
    rf"(?<![\w-])(?P<key>--?(?=[\w-]*?{_SECRET_WORD})[\w-]++)(?P<sep>\s+)(?!--)"
    r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s\"']++)",
    re.IGNORECASE,
)
# The repr of a list or tuple (or a JSON array): ``['--password', 'S3CR3T']``.
_LISTED = re.compile(
    rf"(?P<key>(?P<quote>[\"'])-{{0,2}}(?=[\w-]*?{_SECRET_WORD})[\w-]++(?P=quote))(?P<sep>\s*,\s*)"
    r"(?![\"']?--)(?P<value>\"[^\"]*\"|'[^']*'|[^\s,\])}]++)",
    re.IGNORECASE,
)
# An item of a list or tuple that names a secret, whose next item is its value.
_SECRET_ITEM = re.compile(rf"-{{0,2}}(?=[\w-]*?{_SECRET_WORD})[\w-]++", re.IGNORECASE)
_BEARER = re.compile(r"\b(?P<word>bearer)\s+(?!\*\*\*)[A-Za-z0-9._~+/-]+=*", re.IGNORECASE)
# A text none of the patterns can match skips them (most log lines): _INLINE, _OPTION and
# _LISTED need a secret word, _BEARER its word, _URL_PASSWORD and _EMAIL an "@".
_MAYBE_SECRET = re.compile(rf"{_SECRET_WORD}|bearer", re.IGNORECASE)
_EMAIL = re.compile(r"(?<![\w.%+-])[\w.%+-]+@(?P<domain>(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,})(?![\w-])")
# Celery node names look like addresses (``worker1@host.example.com``); this host's are kept.
_LOCAL_HOSTS = {socket.gethostname().lower()}
_MAX_DEPTH = 8


def _mask_inline(match: re.Match[str]) -> str:
    value = match["value"]
    if value[0] in "\"'":
        masked = f"{value[0]}{MASK}{value[0]}"
    else:
        scheme = match.groupdict().get("scheme")
        masked = f"{scheme}{MASK}" if scheme else MASK
    return f"{match['key']}{match['sep']}{masked}"


def _mask_email(match: re.Match[str]) -> str:
    domain = match["domain"]
    return match[0] if domain.lower() in _LOCAL_HOSTS else f"{MASK}@{domain}"


def is_secret_key(key: object) -> bool:
    """Whether a mapping key names a secret (``password``, ``X-Api-Key``, ``dsn``, …)."""
    return _secret_name(str(key))


@functools.lru_cache(maxsize=2048)
def _secret_name(name: str) -> bool:
    # Every log line asks for the same few keys.
    return _SECRET_KEY.search(name) is not None


def redact_text(text: str) -> str:
    """``text`` with URL passwords, ``key=secret`` pairs, the values of secret options on a
    command line (``--password S3CR3T``) and of listed pairs (``['token', 'S3CR3T']``),
    bearer tokens and the local part of e-mail addresses replaced by ``***``."""
    at = "@" in text
    if at:
        text = _URL_PASSWORD.sub(rf"\g<head>:{MASK}@", text)
    if _MAYBE_SECRET.search(text) is not None:
        text = _INLINE.sub(_mask_inline, text)
        text = _OPTION.sub(_mask_inline, text)
        text = _LISTED.sub(_mask_inline, text)
        text = _BEARER.sub(lambda m: f"{m['word']} {MASK}", text)
    return _EMAIL.sub(_mask_email, text) if at else text


def redact_value(value: Any, _depth: int = 0) -> Any:
    """A copy of ``value`` safe to log: secret keys masked, strings scrubbed, at any depth.

    Objects of other types become their (scrubbed) ``repr``, which is what both renderers
    would print for them anyway, so a secret inside, say, a settings object is caught too.
    """
    if isinstance(value, str):
        return redact_text(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if _depth >= _MAX_DEPTH:
        return redact_text(repr(value))
    if isinstance(value, Mapping):
        return {k: _redact_item(k, v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [redact_value(v, _depth + 1) for v in value]
        _mask_listed_values(value, items)
        return items if isinstance(value, list) else tuple(items)
    return redact_text(repr(value))


def _mask_listed_values(original: Sequence[Any], items: list[Any]) -> None:
    """An argv-like sequence (``["--password", "S3CR3T"]``, ``("token", t)``): the item after
    one that names a secret is its value, unless it is missing or a long option."""
    for i in range(1, len(items)):
        name, value = original[i - 1], original[i]
        if (
            isinstance(name, str)
            and value is not None
            and not (isinstance(value, str) and value.startswith("--"))
            and _SECRET_ITEM.fullmatch(name) is not None
        ):
            items[i] = MASK


def _redact_item(key: object, value: Any, depth: int) -> Any:
    if value is not None and is_secret_key(key):
        return MASK
    return redact_value(value, depth)


def redact(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: :func:`redact_value` over the event dict.

    Keys starting with ``_`` (the formatter's own, e.g. the ``LogRecord``),
    ``exc_info``/``stack_info`` (left to the logging module when Conveyor's logging is
    not configured) and the plain values the shared processors add (logger name, level,
    timestamp, trace ids) are passed through untouched.
    """
    return {
        key: value
        if key.startswith("_") or key in _UNREDACTED or (key in _ADDED and isinstance(value, str))
        else _redact_item(key, value, 0)
        for key, value in event_dict.items()
    }


_UNREDACTED = frozenset({"exc_info", "stack_info"})
# Written by the shared processors from the record itself, never from data: a module path,
# a level name, an ISO time, hex ids.
_ADDED = frozenset({"logger", "level", "timestamp", "trace_id", "span_id"})


def add_trace_ids(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: ``trace_id`` and ``span_id`` (hex, as trace backends show them)
    of the OpenTelemetry span current where the line was logged, if any."""
    from opentelemetry import trace

    current = trace.get_current_span().get_span_context()
    if current.is_valid:
        event_dict.setdefault("trace_id", format(current.trace_id, "032x"))
        event_dict.setdefault("span_id", format(current.span_id, "016x"))
    return event_dict


def _shared_processors() -> list[Processor]:
    """Run on structlog events at the call and on stdlib records in the formatter."""
    import structlog

    return [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        # Tracebacks become text before redaction, so secrets in them are scrubbed too.
        structlog.processors.format_exc_info,
    ]


def _renderer(log_format: str, stream: TextIO | None) -> Processor:
    import structlog

    if log_format == "json":
        return structlog.processors.JSONRenderer()
    isatty = getattr(stream, "isatty", None)
    return structlog.dev.ConsoleRenderer(colors=bool(isatty and isatty()))


def configure_logging(
    settings: ConveyorSettings,
    *,
    level: int | str | None = None,
    stream: TextIO | None = None,
    logfile: str | None = None,
) -> logging.Handler:
    """Send structlog and stdlib logging through one handler on the root logger.

    The format is ``settings.log_format``; the level is ``level`` or else
    ``settings.log_level``. Lines go to ``logfile`` if given, else to ``stream``
    (default: standard error). Calling it again replaces the handler it installed
    before; other handlers on the root logger are left alone. Returns the handler.
    """
    import structlog
    from structlog.stdlib import BoundLogger, ProcessorFormatter

    shared = _shared_processors()
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            # Also here, so the event dict a record carries is clean for any other handler.
            redact,
            ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler: logging.Handler
    if logfile:
        handler = WatchedFileHandler(logfile, encoding="utf-8")
        out: TextIO | None = None
    else:
        out = stream if stream is not None else sys.stderr
        handler = logging.StreamHandler(out)
    handler.setFormatter(
        ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                ProcessorFormatter.remove_processors_meta,
                redact,
                _renderer(settings.log_format, out),
            ],
        )
    )
    handler.set_name(HANDLER_NAME)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    chosen = settings.log_level if level is None else level
    root.setLevel(chosen.upper() if isinstance(chosen, str) else chosen)
    return handler


class _OnFirstRecord(logging.Handler):
    """Stands in for :func:`configure_logging` until a record reaches it (see
    :func:`configure_logging_on_first_record`)."""

    def __init__(self, settings: ConveyorSettings) -> None:
        super().__init__()
        self.settings: ConveyorSettings | None = settings

    def emit(self, record: logging.LogRecord) -> None:
        # Handler.handle holds this handler's lock around emit: one thread sets up.
        settings, self.settings = self.settings, None
        if settings is None:
            return
        root = logging.getLogger()
        if not any(h.get_name() == HANDLER_NAME for h in root.handlers):
            # Appended to the root logger's handlers, the handler renders this very record
            # in the logging call under way; taking this one out mid-call could skip one.
            configure_logging(settings)


def configure_logging_on_first_record(settings: ConveyorSettings) -> None:
    """:func:`configure_logging` once a first record is logged, so a process that logs
    nothing (``conveyor --help``, a ``jobs list``) never imports structlog.

    The level is set now; a stand-in handler on the root logger does the rest when a record
    reaches it, unless Conveyor's logging was configured meanwhile (Celery's
    ``setup_logging`` in a worker): then, and after its first record, it does nothing.
    """
    root = logging.getLogger()
    root.setLevel(settings.log_level)
    root.addHandler(_OnFirstRecord(settings))


# -- per-job context ---------------------------------------------------------------------


def bind_job(job_id: str, stage: str, attempt: int, queue: str | None = None) -> JobTokens:
    """Stamp every log line of this context (thread or task) with the job's fields.

    Returns the tokens for :func:`unbind_job`, which restores what was bound before (a
    stage run inline inside another job gives the outer job its fields back).
    """
    import structlog

    return structlog.contextvars.bind_contextvars(job_id=job_id, stage=stage, attempt=attempt, queue=queue)


def unbind_job(tokens: JobTokens | None = None) -> None:
    """Undo :func:`bind_job`: restore the previous fields with ``tokens``, or else drop them.

    Tokens from another thread or context, or already used, are ignored: nothing of
    theirs is bound here.
    """
    import structlog

    if tokens is None:
        structlog.contextvars.unbind_contextvars(*JOB_KEYS)
        return
    with suppress(ValueError, RuntimeError):
        structlog.contextvars.reset_contextvars(**tokens)


@contextmanager
def job_context(job_id: str, stage: str, attempt: int, queue: str | None = None) -> Iterator[None]:
    """:func:`bind_job` for the duration of a ``with`` block."""
    tokens = bind_job(job_id, stage, attempt, queue)
    try:
        yield
    finally:
        unbind_job(tokens)


def _to_stdlib(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> dict[str, Any]:
    """Last processor when Conveyor's logging is not configured: a plain stdlib call whose
    message carries the bound fields, for whatever handlers the process has."""
    exc_info = event_dict.pop("exc_info", None)
    stack_info = bool(event_dict.pop("stack_info", False))
    event = event_dict.pop("event", "")
    fields = " ".join(f"{k}={v}" for k, v in event_dict.items())
    return {
        "msg": f"{event} [{fields}]" if fields else str(event),
        "exc_info": exc_info,
        "stack_info": stack_info,
    }


def job_logger(*, job_id: str, stage: str, attempt: int, queue: str | None = None) -> BoundLogger:
    """A logger bound to one job: ``log.info("copied %s rows", n)`` or ``log.info("copied", rows=n)``.

    The fields are bound on the logger itself as well as in the context, so lines logged
    from threads a stage starts carry them too.
    """
    import structlog
    from structlog.stdlib import BoundLogger

    fields = {"job_id": job_id, "stage": stage, "attempt": attempt, "queue": queue}
    if structlog.is_configured():
        logger: BoundLogger = structlog.stdlib.get_logger(JOB_LOGGER)
        return logger.bind(**fields)
    # Not configured (e.g. a stage called inline in someone's script): go through their
    # stdlib logging rather than structlog's default printer on stdout.
    wrapped: BoundLogger = structlog.wrap_logger(
        logging.getLogger(JOB_LOGGER),
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.stdlib.PositionalArgumentsFormatter(),
            redact,
            _to_stdlib,
        ],
        wrapper_class=BoundLogger,
    )
    return wrapped.bind(**fields)


class RepeatedFailure:
    """Logs a loop's failures without flooding: the first with its traceback, the same
    failure again only every ``every`` seconds as one line with a count, and the recovery.

    A background loop (the relay) fails on every pass while a service is down; a traceback
    every two seconds buries the log line that says what is wrong.
    """

    def __init__(self, log: logging.Logger, what: str, *, every: float = 60.0) -> None:
        self._log = log
        self._what = what
        self._every = every
        self._count = 0
        self._key: tuple[str, str] | None = None
        self._last = 0.0

    def failed(self, exc: BaseException, now: float) -> None:
        """Note a failure (``now`` from a monotonic clock)."""
        key = (type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        self._count += 1
        if key != self._key:
            self._key, self._last = key, now
            self._log.warning("%s failed", self._what, exc_info=exc)
        elif now - self._last >= self._every:
            self._last = now
            self._log.warning("%s still failing (%d times so far): %s: %s", self._what, self._count, *key)

    def passed(self) -> None:
        """Note a success: the recovery is logged once after failures."""
        if self._count:
            self._log.warning("%s works again after %d failures", self._what, self._count)
        self._count, self._key = 0, None
