"""The email benchmark's pieces (:mod:`bench.email` runs them): the message both sides
send, the raw side (a plain Celery app and task sending with the stage's own SMTP client,
nothing from Conveyor's runtime), and the arithmetic of the rate-limited run.

Importing this module is cheap and reads no settings, except in a worker process started
by the bench (``celery -A bench.email_parts:raw_app``), where ``CONVEYOR_REDIS_URL`` is set
and :data:`raw_app` configures itself from the environment exactly like ``config.celery_app``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

from celery import Celery

from bench.common import BenchError, raw_queue_config
from config.settings import Settings
from tasks.email.providers import OutgoingEmail
from tasks.email.providers.smtp import SmtpProvider

if TYPE_CHECKING:
    from conveyor.settings import ConveyorSettings

T = TypeVar("T")
RAW_QUEUE = "email_raw"
RAW_APP = "bench.email_parts:raw_app"
FROM_ADDRESS = "avisos@conveyor.test"
SUBJECT = "Seu boleto está disponível"

HTML = (
    "<!doctype html><html><head><meta charset='utf-8'><title>Seu boleto</title></head><body>"
    "<table width='600' style='font-family:Arial,sans-serif'><tr><td>"
    "<h1 style='color:#1a4d8f'>Seu boleto está disponível</h1>"
    "<p>Olá, o boleto referente à sua fatura deste mês já pode ser pago. "
    "Use o código de barras abaixo no aplicativo do seu banco ou em qualquer agência.</p><table>"
    + "".join(
        f"<tr><td style='padding:4px'>Item {i}: serviço mensal, parcela {i} de 12</td>"
        f"<td style='text-align:right'>R$ {100 + 7 * i},{i:02d}</td></tr>"
        for i in range(1, 13)
    )
    + "</table><p style='font-size:12px;color:#777'>Esta é uma mensagem automática; não responda.</p>"
    "</td></tr></table></body></html>"
)


def email_env(port: int) -> str:
    """``CONVEYOR_EMAIL`` for a worker sending to the peer on ``port`` (both sides)."""
    return json.dumps(
        {"smtp": {"port": port, "timeout": 10}, "from_address": FROM_ADDRESS, "allow_test_domains": True}
    )


def payload(company: str, index: int) -> dict[str, Any]:
    """A valid ``EmailSendJobData`` payload (its own outboxId), as tests/integration/email_support."""
    to = f"cliente.{index}@empresa.test"
    return {
        "outboxId": str(uuid.uuid4()),
        "companyId": company,
        "requestId": f"bench-{index}",
        "to": to,
        "subject": SUBJECT,
        "htmlRef": "",
        "recipient": {"externalId": f"CUST-{index}", "nome": "Cliente", "email": to},
        "attempt": 1,
        "enqueuedAt": dt.datetime.now(dt.UTC).isoformat(),
    }


# -- the raw side: a plain Celery app and task, nothing from Conveyor's runtime ------------

raw_app = Celery("conveyor_bench_email_raw")


def configure_raw_app(settings: ConveyorSettings) -> None:
    """Give :data:`raw_app` the Celery config the deployment's app gets, on its own queue."""
    raw_app.conf.update(raw_queue_config(settings, RAW_QUEUE, "conveyor_bench_email_raw"))


@cache
def raw_provider() -> tuple[SmtpProvider, str, str]:
    """This process's client, sender and Message-ID domain, from ``CONVEYOR_EMAIL``."""
    email = Settings().email
    return SmtpProvider(email.smtp), email.from_address, email.id_domain


@raw_app.task(name="bench.raw.email.send", queue=RAW_QUEUE)  # type: ignore[untyped-decorator]
def raw_send(outbox_id: str, to: str, subject: str, html: str) -> str:
    """Send one message with the stage's client; the raw counterpart of ``conveyor.email.send``."""
    provider, sender, domain = raw_provider()
    message = OutgoingEmail(
        outbox_id=outbox_id,
        message_id=f"<{outbox_id}@{domain}>",
        from_address=sender,
        to=to,
        subject=subject,
        html=html,
    )
    return provider.send(message, before_commit_point=lambda: None).provider_message_id


if os.environ.get("CONVEYOR_REDIS_URL"):
    # A worker process: same environment as the tracked worker. A fresh Settings(): in the
    # bench process this runs at import, before main() sets the environment.
    configure_raw_app(Settings())


def fan_out(threads: int, count: int, fn: Callable[[int], T]) -> list[T]:
    """``[fn(i) for i in range(count)]`` spread over ``threads`` threads (as bench/throughput.py),
    like a web app's request threads; both sides submit this way."""
    if threads <= 1:
        return [fn(i) for i in range(count)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(fn, range(count), chunksize=max(1, count // (threads * 4))))


def steady_rate(
    samples: Sequence[tuple[float, int]], n: int, warmup: float, window: float
) -> tuple[float, float]:
    """Deliveries per second over ``window`` seconds from ``warmup`` after the first delivery.

    The window ends earlier if every message was delivered before it closed (the rate is
    then over the shorter span, which :class:`Limited` reports).
    """
    first = next((ts for ts, count in samples if count > 0), None)
    if first is None:
        raise BenchError("limited: no delivery sampled")
    done = next((ts for ts, count in samples if count >= n), samples[-1][0])
    begin = first + warmup
    end = min(begin + window, done)
    if end - begin < 1.0:
        raise BenchError(f"limited: the run drained {done - first:.1f}s after its first delivery, too soon")
    return (count_at(samples, end) - count_at(samples, begin)) / (end - begin), end - begin


def count_at(samples: Sequence[tuple[float, int]], when: float) -> float:
    """The peer's count at ``when``, interpolated between the samples around it."""
    before = max((s for s in samples if s[0] <= when), default=samples[0])
    after = min((s for s in samples if s[0] >= when), default=samples[-1])
    if after[0] == before[0]:
        return float(before[1])
    return before[1] + (after[1] - before[1]) * (when - before[0]) / (after[0] - before[0])
