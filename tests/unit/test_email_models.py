"""The ``email:send`` contract: every valid payload accepted and round-tripped, each kind of
invalid one refused naming the field and never the value."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from conveyor.errors import ConfigurationError, PermanentError, TransientError
from conveyor.stage import readable_validation_error
from tasks.email import models
from tasks.email.errors import (
    DeliveryUncertain,
    DeliveryUnknown,
    EmailRejected,
    HtmlNotFound,
    ProviderRefused,
    ProviderUnavailable,
)
from tasks.email.models import (
    BACKOFF_DELAYS,
    DEFAULT_PRIORITY,
    DEFAULT_TTL_S,
    IDEMPOTENCY_IGNORE,
    MAX_ATTEMPTS,
    QUEUE,
    STAGE,
    EmailSendJobData,
    EmailSendJobResult,
    conveyor_priority,
    html_ref_for,
)
from tasks.email.settings import EmailSettings

TO = "cliente.canary@example.com"
HASH = "a3c7b8d9" + "0" * 56


def payload(**changes: Any) -> dict[str, Any]:
    """The seed's example 1, with a canary address."""
    data: dict[str, Any] = {
        "outboxId": "123e4567-e89b-12d3-a456-426614174000",
        "companyId": "789e4567-e89b-12d3-a456-426614174999",
        "requestId": "req-abc123",
        "to": TO,
        "subject": "Seu boleto está disponível",
        "htmlRef": "123e4567-e89b-12d3-a456-426614174000",
        "recipient": {"externalId": "CUST-12345", "cpfCnpjHash": HASH, "nome": "João da Silva", "email": TO},
        "attempt": 1,
        "enqueuedAt": "2025-10-19T12:00:00.000Z",
    }
    data.update(changes)
    return data


def refusal(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        EmailSendJobData.model_validate(data)
    return readable_validation_error(STAGE, caught.value)


def assert_refused(data: dict[str, Any], field: str, *hidden: str) -> str:
    """Refused once, naming ``field``, without any of ``hidden`` (the bad values)."""
    text = refusal(data)
    assert f"{field}: " in text, text
    for value in hidden:
        assert value not in text, text
    return text


@pytest.fixture
def test_domains() -> Iterator[None]:
    models.allow_test_domains(True)
    try:
        yield
    finally:
        models.allow_test_domains(False)


# -- valid payloads --------------------------------------------------------------------------

label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
addresses = st.builds(
    lambda local, domain, tld: f"{local}@{domain}.{tld}",
    st.from_regex(r"[A-Za-z0-9_+]{1,20}(\.[A-Za-z0-9_+-]{1,10}){0,2}", fullmatch=True),
    label,
    st.sampled_from(["com", "com.br", "org", "net", "io"]),
)
line = st.characters(blacklist_categories=("Cs", "Cc"))
uuids = st.uuids().map(str)


@st.composite
def valid_payloads(draw: st.DrawFn) -> dict[str, Any]:
    to = draw(addresses)
    ids = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "recipientId": uuids,
                "externalId": st.text(line, min_size=1, max_size=64),
                "cpfCnpjHash": st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
            },
        ).filter(bool)
    )
    recipient = {**ids, "email": to}
    for name in ("razaoSocial", "nome"):
        if draw(st.booleans()):
            recipient[name] = draw(st.text(max_size=200))
    data: dict[str, Any] = {
        "outboxId": draw(uuids),
        "companyId": draw(uuids),
        "requestId": draw(st.text(line, min_size=1, max_size=200)),
        "to": to,
        "subject": draw(st.text(line, min_size=1, max_size=150)),
        "htmlRef": draw(st.text(line, min_size=1, max_size=100)),
        "recipient": recipient,
        "attempt": draw(st.integers(1, MAX_ATTEMPTS)),
        "enqueuedAt": draw(st.datetimes(timezones=st.just(UTC))).isoformat(),
    }
    optional = {
        "cc": st.lists(addresses, max_size=5),
        "bcc": st.lists(addresses, max_size=5),
        "replyTo": addresses | st.none(),
        "headers": st.dictionaries(
            st.from_regex(r"X-[A-Za-z0-9-]{1,20}", fullmatch=True), st.text(line, max_size=100), max_size=5
        ),
        "tags": st.lists(st.text(line, min_size=1, max_size=64), max_size=5),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            data[name] = draw(strategy)
    return data


@given(valid_payloads())
def test_valid_payloads_are_accepted_and_round_trip(data: dict[str, Any]) -> None:
    model = EmailSendJobData.model_validate(data)
    assert model.to == data["to"]  # validated, not rewritten
    again = EmailSendJobData.model_validate(model.model_dump())
    assert again == model
    assert EmailSendJobData.model_validate_json(model.model_dump_json()) == model
    json.dumps(EmailSendJobData.model_json_schema())


def test_the_seeds_example_is_valid() -> None:
    model = EmailSendJobData.model_validate(payload())
    assert model.cc == [] and model.bcc == [] and model.tags == [] and model.headers == {}
    assert model.replyTo is None


def test_explicit_nulls_mean_none() -> None:
    model = EmailSendJobData.model_validate(payload(cc=None, bcc=None, tags=None, headers=None, replyTo=None))
    assert model.cc == [] and model.bcc == [] and model.tags == [] and model.headers == {}


def test_case_of_the_domain_does_not_matter_for_recipient_email() -> None:
    EmailSendJobData.model_validate(
        payload(recipient={"externalId": "x", "email": "cliente.canary@EXAMPLE.com"})
    )


# -- each invalid kind -----------------------------------------------------------------------


@pytest.mark.parametrize("field", ["outboxId", "companyId"])
def test_ids_must_be_uuids(field: str) -> None:
    assert_refused(payload(**{field: "not-a-uuid-canary"}), field, "canary")
    assert_refused(payload(**{field: "123e4567-e89b-12d3-a456-426614174000\n"}), field)


@pytest.mark.parametrize(
    "bad",
    [
        "canary",
        "canary@",
        "@canary.com",
        "canary person@example.com",
        "canary@exa_mple.com",
        "canary@localhost",
        "canary..x@example.com",
        "canary@example.com\r\nBcc: victim@example.com",
        '"canary"@example.com',
        "canary@[127.0.0.1]",
    ],
)
def test_to_must_be_an_address(bad: str) -> None:
    text = assert_refused(payload(to=bad), "to", "canary", "victim", "_")
    assert "not a valid email address" in text


def test_to_at_most_254_characters() -> None:
    long = "canary" + "x" * 240 + "@example.com"
    assert_refused(payload(to=long, recipient={"externalId": "x", "email": long}), "to", "canary")


def test_special_use_domains_need_the_test_switch(test_domains: None) -> None:
    models.allow_test_domains(False)
    assert_refused(payload(to="canary@dest.test"), "to", "canary")
    models.allow_test_domains(True)
    EmailSendJobData.model_validate(
        payload(to="canary@dest.test", recipient={"externalId": "x", "email": "canary@dest.test"})
    )


@pytest.mark.parametrize("subject", ["", "x" * 151, "Seu boleto\ncanary", "Seu boleto\rcanary"])
def test_subject(subject: str) -> None:
    assert_refused(payload(subject=subject), "subject", "canary", "xxxx")


def test_html_ref_not_empty() -> None:
    assert_refused(payload(htmlRef=""), "htmlRef")


def test_recipient_email_must_be_to() -> None:
    text = assert_refused(
        payload(recipient={"externalId": "x", "email": "other.canary@example.com"}),
        "recipient.email",
        "canary",
    )
    assert "must be the same address as to" in text


def test_recipient_needs_an_identifier() -> None:
    text = assert_refused(payload(recipient={"nome": "Canary", "email": TO}), "recipient", "canary", "Canary")
    assert "recipientId, externalId or cpfCnpjHash" in text


def test_recipient_fields() -> None:
    assert_refused(
        payload(recipient={"recipientId": "canary-id", "email": TO}), "recipient.recipientId", "canary"
    )
    assert_refused(payload(recipient={"externalId": "c" * 65, "email": TO}), "recipient.externalId", "ccccc")
    for bad in ("A3C7" + "0" * 60, "0" * 63, "canary" + "0" * 58):
        assert_refused(payload(recipient={"cpfCnpjHash": bad, "email": TO}), "recipient.cpfCnpjHash", bad)
    assert_refused(payload(recipient={"externalId": "x", "email": "canary@"}), "recipient.email", "canary")
    assert_refused(
        payload(recipient={"externalId": "x", "email": TO, "cpf": "12345678909"}), "recipient.cpf", "123"
    )


@pytest.mark.parametrize("attempt", [0, 6, -1])
def test_attempt_range(attempt: int) -> None:
    assert_refused(payload(attempt=attempt), "attempt")


@pytest.mark.parametrize("stamp", ["yesterday-canary", "19/10/2025", "", "2025-13-01T00:00:00Z"])
def test_enqueued_at_iso(stamp: str) -> None:
    assert_refused(payload(enqueuedAt=stamp), "enqueuedAt", *(stamp and [stamp]))


@pytest.mark.parametrize("field", ["cc", "bcc"])
def test_copies(field: str) -> None:
    six = [f"canary{i}@example.com" for i in range(6)]
    assert_refused(payload(**{field: six}), field, "canary")
    text = assert_refused(payload(**{field: ["ok@example.com", "canary@"]}), field, "canary")
    assert "item 1" in text


def test_tags() -> None:
    assert_refused(payload(tags=["canary"] * 6), "tags", "canary")
    assert_refused(payload(tags=[""]), "tags")
    assert_refused(payload(tags=["canary\nx"]), "tags", "canary")


def test_reply_to() -> None:
    assert_refused(payload(replyTo="reply.canary@"), "replyTo", "canary")


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Canary\r\nBcc": "x"},
        {"X-Canary\n": "x"},
        {"X Canary": "x"},
        {"X-Canary:": "x"},
        {"": "x"},
        {"X-Ok": "canary\r\nBcc: victim@example.com"},
        {"X-Ok": "canary\n"},
        {"bcc": "victim@example.com"},
        {"MESSAGE-ID": "<canary@x>"},
        {"Content-Type": "text/canary"},
        {"reply-to": "victim@example.com"},
    ],
)
def test_headers(headers: dict[str, str]) -> None:
    assert_refused(payload(headers=headers), "headers", "canary", "Canary", "victim")


def test_unknown_fields_are_refused() -> None:
    assert_refused(payload(cpfCnpj="12345678909"), "cpfCnpj", "12345678909")


def test_every_violation_is_named_once() -> None:
    text = refusal(payload(outboxId="x", subject="", attempt=9, cc=["canary@"] * 6))
    for field in ("outboxId", "subject", "attempt", "cc"):
        assert text.count(f"{field}: ") == 1, text
    assert "canary" not in text


# -- result, constants, errors ---------------------------------------------------------------


def test_result_masks_refused_addresses() -> None:
    result = EmailSendJobResult(
        status="SENT",
        providerMessageId="<id@x>",
        messageId="<id@x>",
        processedAt="2025-10-19T12:00:00Z",
        durationMs=12,
        attempt=1,
        refused=["maria.canary@example.com"],
    )
    assert result.refused == ["m***@e***.com"]
    assert EmailSendJobResult.model_validate(result.model_dump()) == result


def test_constants() -> None:
    assert (QUEUE, STAGE, DEFAULT_TTL_S, DEFAULT_PRIORITY, MAX_ATTEMPTS) == (
        "email",
        "conveyor.email.send",
        86400,
        5,
        5,
    )
    assert BACKOFF_DELAYS == (1, 5, 30, 120, 600)
    assert set(IDEMPOTENCY_IGNORE) == {"attempt", "enqueuedAt", "requestId"}


def test_priority_mapping() -> None:
    assert [conveyor_priority(p) for p in range(1, 11)] == list(range(10, 0, -1))
    assert conveyor_priority(DEFAULT_PRIORITY) == 6
    for bad in (0, 11, -5, True):
        with pytest.raises(ValueError, match=r"1 .* 10"):
            conveyor_priority(bad)


def test_html_ref() -> None:
    assert html_ref_for("<p>olá</p>") == html_ref_for("<p>olá</p>")
    assert html_ref_for("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert len(html_ref_for("<p>x</p>")) == 64


def test_error_classes() -> None:
    for permanent in (EmailRejected("x"), HtmlNotFound("x"), DeliveryUnknown("<a@b>"), ProviderRefused("x")):
        assert isinstance(permanent, PermanentError)
    for transient in (ProviderUnavailable("x"), DeliveryUncertain("x")):
        assert isinstance(transient, TransientError)
    assert str(DeliveryUnknown("<id@x>")) == "delivery state unknown for <id@x>"
    assert EmailRejected("x", code=550).code == 550 and ProviderUnavailable("x").code is None


def test_settings_name_the_missing_section() -> None:
    with pytest.raises(ValueError, match=r"CONVEYOR_EMAIL.*http"):
        EmailSettings.model_validate({"provider": "http"})
    with pytest.raises(ValueError, match=r"CONVEYOR_EMAIL.*ses"):
        EmailSettings.model_validate({"provider": "ses"})
    assert EmailSettings().id_domain == "localhost"
    settings = EmailSettings.model_validate(
        {"provider": "http", "http": {"url": "http://127.0.0.1:1/"}, "from_address": "a@mail.example.com"}
    )
    assert settings.http is not None and settings.http.url == "http://127.0.0.1:1"
    assert settings.id_domain == "mail.example.com"
    with pytest.raises(ValueError, match="from_address"):
        EmailSettings(from_address="nobody")
    with pytest.raises(ConfigurationError, match="CONVEYOR_EMAIL pii_key"):
        EmailSettings().pii_key_bytes()
