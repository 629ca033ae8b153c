"""The email providers against real local peers: aiosmtpd (STARTTLS, AUTH, refusals, a
dropped DATA), an HTTP email API honouring Idempotency-Key, and moto's SES server."""

from __future__ import annotations

import smtplib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipelines.email.peers import (
    HttpEmailPeer,
    SmtpPeer,
    free_port,
    make_test_certificate,
    server_tls_context,
)
from tasks.email.errors import DeliveryUncertain, EmailRejected, ProviderRefused, ProviderUnavailable
from tasks.email.providers import Delivery, OutgoingEmail, provider_from
from tasks.email.providers.http import HttpProvider
from tasks.email.providers.ses import SesProvider
from tasks.email.providers.smtp import SmtpProvider
from tasks.email.settings import EmailSettings, HttpSettings, SesSettings, SmtpSettings

SENDER = "no-reply@sender.test"
TO = "maria.canary@dest.test"
CC = ("copy.one@dest.test", "copy.two@dest.test")
BCC = ("hidden.canary@dest.test",)
HTML = "<html><body><h1>Boleto</h1><p>Seu boleto est&aacute; <a href='https://x.test/b'>aqui</a>.</p></body></html>"
ADDRESSES = (TO, *CC, *BCC, "maria.canary", "hidden.canary", "copy.one")


def outgoing(**changes: Any) -> OutgoingEmail:
    outbox_id = str(uuid.uuid4())
    fields: dict[str, Any] = {
        "outbox_id": outbox_id,
        "message_id": f"<{outbox_id}@sender.test>",
        "from_address": SENDER,
        "to": TO,
        "cc": CC,
        "bcc": BCC,
        "reply_to": "support@sender.test",
        "subject": "Seu boleto está disponível",
        "html": HTML,
        "headers": {"X-Campaign": "october", "List-Id": "<boletos.sender.test>"},
        "tags": ("boleto", "october"),
    }
    fields.update(changes)
    return OutgoingEmail(**fields)


class Commits:
    """Counts before_commit_point calls (the stage commits SENDING there)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls = 0
        self.fail = fail

    def __call__(self) -> None:
        self.calls += 1
        if self.fail is not None:
            raise self.fail


def assert_no_address(exc: BaseException) -> None:
    text = str(exc)
    for fragment in ADDRESSES:
        assert fragment not in text, text
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)


def smtp(peer: SmtpPeer, **settings: Any) -> SmtpProvider:
    return SmtpProvider(SmtpSettings(host=peer.host, port=peer.port, timeout=5, **settings))


@pytest.fixture
def peer() -> Iterator[SmtpPeer]:
    with SmtpPeer() as running:
        yield running


# -- SMTP ------------------------------------------------------------------------------------


def test_smtp_plain_send(peer: SmtpPeer) -> None:
    email = outgoing()
    commits = Commits()
    delivery = smtp(peer).send(email, before_commit_point=commits)
    assert delivery == Delivery("smtp", email.message_id, ())
    assert commits.calls == 1
    [received] = peer.messages
    assert received.mail_from == SENDER
    assert set(received.rcpt_tos) == {TO, *CC, *BCC}
    message = received.message
    assert received.message_id == email.message_id
    assert message["To"] == TO
    assert "copy.one@dest.test" in message["Cc"]
    assert message["Bcc"] is None and b"hidden.canary" not in received.raw
    assert message["Subject"] == "Seu boleto está disponível"
    assert message["Reply-To"] == "support@sender.test"
    assert message["X-Campaign"] == "october"
    assert message["X-Tags"] == "boleto, october"
    assert message["Date"]
    html = message.get_body(("html",))
    text = message.get_body(("plain",))
    assert html is not None and text is not None
    assert "<h1>Boleto</h1>" in html.get_content()
    plain = text.get_content()
    assert "Boleto" in plain and "está" in plain and "https://x.test/b" in plain and "<" not in plain


def test_smtp_internationalized_address(peer: SmtpPeer) -> None:
    delivery = smtp(peer).send(outgoing(to="joão@dest.test", cc=(), bcc=()), before_commit_point=Commits())
    [received] = peer.messages
    assert received.rcpt_tos == ("joão@dest.test",) and received.message["To"] == "joão@dest.test"
    assert delivery.refused == ()


def test_smtp_some_recipients_refused(peer: SmtpPeer) -> None:
    peer.refuse = lambda address: 550 if address.startswith("copy.") else None
    commits = Commits()
    delivery = smtp(peer).send(outgoing(), before_commit_point=commits)
    assert set(delivery.refused) == set(CC)
    assert commits.calls == 1
    [received] = peer.messages
    assert set(received.rcpt_tos) == {TO, *BCC}


def test_smtp_every_recipient_refused_permanently(peer: SmtpPeer) -> None:
    peer.refuse = lambda address: 550
    commits = Commits()
    with pytest.raises(EmailRejected) as caught:
        smtp(peer).send(outgoing(), before_commit_point=commits)
    assert caught.value.code == 550
    assert commits.calls == 0  # nothing reached DATA: the row never becomes SENDING
    assert peer.messages == []
    assert_no_address(caught.value)


def test_smtp_recipients_refused_for_now(peer: SmtpPeer) -> None:
    peer.refuse = lambda address: 450
    commits = Commits()
    with pytest.raises(ProviderUnavailable) as caught:
        smtp(peer).send(outgoing(), before_commit_point=commits)
    assert caught.value.code == 450 and commits.calls == 0
    assert_no_address(caught.value)


def test_smtp_mixed_temporary_and_permanent_refusals_are_retried(peer: SmtpPeer) -> None:
    peer.refuse = lambda address: 550 if address == TO else 451
    with pytest.raises(ProviderUnavailable):
        smtp(peer).send(outgoing(), before_commit_point=Commits())


@pytest.mark.parametrize(("code", "error"), [(554, ProviderRefused), (451, ProviderUnavailable)])
def test_smtp_data_refused(peer: SmtpPeer, code: int, error: type[Exception]) -> None:
    peer.fail_data = code
    commits = Commits()
    with pytest.raises(error) as caught:
        smtp(peer).send(outgoing(), before_commit_point=commits)
    assert getattr(caught.value, "code", None) == code
    assert commits.calls == 1  # DATA was reached; the reply code says nothing was taken
    assert_no_address(caught.value)


def test_smtp_connection_lost_at_data_is_uncertain(peer: SmtpPeer) -> None:
    peer.drop_at_data = True
    email = outgoing()
    commits = Commits()
    with pytest.raises(DeliveryUncertain) as caught:
        smtp(peer).send(email, before_commit_point=commits)
    assert commits.calls == 1
    assert [m.message_id for m in peer.wait_for(1)] == [email.message_id]
    assert_no_address(caught.value)


def test_smtp_connection_refused() -> None:
    provider = SmtpProvider(SmtpSettings(host="127.0.0.1", port=free_port(), timeout=5))
    commits = Commits()
    with pytest.raises(ProviderUnavailable, match="nothing was sent"):
        provider.send(outgoing(), before_commit_point=commits)
    assert commits.calls == 0


def test_smtp_commit_point_failure_sends_nothing(peer: SmtpPeer) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        smtp(peer).send(outgoing(), before_commit_point=Commits(fail=Boom()))
    assert peer.messages == []


def test_smtp_timeout_at_data_is_uncertain(peer: SmtpPeer) -> None:
    peer.delay_s = 2
    provider = SmtpProvider(SmtpSettings(host=peer.host, port=peer.port, timeout=0.5))
    with pytest.raises(DeliveryUncertain):
        provider.send(outgoing(), before_commit_point=Commits())


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    return make_test_certificate(tmp_path / "tls")


def test_smtp_starttls_and_auth(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    with SmtpPeer(tls_context=server_tls_context(cert, key), credentials=("mailer", "s3cret")) as peer:
        provider = smtp(peer, starttls=True, ca_file=cert, username="mailer", password="s3cret")
        email = outgoing()
        provider.send(email, before_commit_point=Commits())
        assert [m.message_id for m in peer.messages] == [email.message_id]
        assert peer.auth_attempts == 1
        with pytest.raises(ProviderRefused) as caught:
            smtp(peer, starttls=True, ca_file=cert, username="mailer", password="wrong").send(
                outgoing(), before_commit_point=Commits()
            )
        assert caught.value.code == 535 and "wrong" not in str(caught.value)


def test_smtp_auth_is_offered_only_after_starttls(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    with SmtpPeer(tls_context=server_tls_context(cert, key), credentials=("mailer", "s3cret")) as peer:
        client = smtplib.SMTP(peer.host, peer.port, timeout=5)
        try:
            client.ehlo()
            assert client.has_extn("starttls") and not client.has_extn("auth")
        finally:
            client.quit()
        with pytest.raises(ProviderRefused, match="AUTH"):
            smtp(peer, username="mailer", password="s3cret").send(outgoing(), before_commit_point=Commits())


def test_smtp_untrusted_certificate_is_unavailable(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    """Decision: an untrusted certificate is ProviderUnavailable (retried on the schedule,
    then dead-lettered with this message), not a configuration error at start-up: the
    certificate is the server's and can be fixed on either side while the job waits."""
    cert, key = certificate
    other_cert, _ = make_test_certificate(tmp_path / "other")
    with SmtpPeer(tls_context=server_tls_context(cert, key)) as peer:
        commits = Commits()
        with pytest.raises(ProviderUnavailable, match=r"not trusted .*smtp\.ca_file"):
            smtp(peer, starttls=True, ca_file=other_cert).send(outgoing(), before_commit_point=commits)
        assert commits.calls == 0 and peer.messages == []


def test_smtp_unreadable_ca_file(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    with (
        SmtpPeer(tls_context=server_tls_context(cert, key)) as peer,
        pytest.raises(ProviderUnavailable, match=r"smtp\.ca_file"),
    ):
        smtp(peer, starttls=True, ca_file=tmp_path / "missing.pem").send(
            outgoing(), before_commit_point=Commits()
        )


def test_smtp_starttls_required_but_not_offered(peer: SmtpPeer) -> None:
    with pytest.raises(ProviderUnavailable, match="STARTTLS"):
        smtp(peer, starttls=True).send(outgoing(), before_commit_point=Commits())
    assert peer.messages == []


def test_provider_from_settings(peer: SmtpPeer) -> None:
    settings = EmailSettings.model_validate({"smtp": {"host": peer.host, "port": peer.port}})
    provider = provider_from(settings)
    assert provider.name == "smtp"
    provider.send(outgoing(), before_commit_point=Commits())
    assert len(peer.messages) == 1


# -- HTTP ------------------------------------------------------------------------------------


@pytest.fixture
def api() -> Iterator[HttpEmailPeer]:
    with HttpEmailPeer(token="t0ken") as running:
        yield running


def http_provider(api: HttpEmailPeer, token: str | None = "t0ken") -> HttpProvider:
    return HttpProvider(HttpSettings(url=api.url, token=token, timeout=5))


def test_http_send_and_idempotent_resend(api: HttpEmailPeer) -> None:
    email = outgoing()
    commits = Commits()
    first = http_provider(api).send(email, before_commit_point=commits)
    again = http_provider(api).send(email, before_commit_point=commits)
    assert first.provider == "http" and first.provider_message_id == again.provider_message_id
    assert commits.calls == 2
    [stored] = api.messages
    assert stored["idempotency_key"] == email.outbox_id
    assert stored["headers"]["Message-ID"] == email.message_id
    assert stored["to"] == TO and stored["bcc"] == list(BCC) and stored["html"] == HTML


@pytest.mark.parametrize("status", [429, 503])
def test_http_unavailable(api: HttpEmailPeer, status: int) -> None:
    api.status_next = [status]
    with pytest.raises(ProviderUnavailable) as caught:
        http_provider(api).send(outgoing(), before_commit_point=Commits())
    assert caught.value.code == status and api.messages == []


def test_http_refused(api: HttpEmailPeer) -> None:
    api.status_next = [400]
    with pytest.raises(ProviderRefused) as caught:
        http_provider(api).send(outgoing(), before_commit_point=Commits())
    assert caught.value.code == 400
    with pytest.raises(ProviderRefused) as caught:
        http_provider(api, token="wrong").send(outgoing(), before_commit_point=Commits())
    assert caught.value.code == 401 and "wrong" not in str(caught.value)


def test_http_drop_after_accept_is_uncertain_then_resend_finds_it(api: HttpEmailPeer) -> None:
    api.drop_after_accept = True
    email = outgoing()
    with pytest.raises(DeliveryUncertain) as caught:
        http_provider(api).send(email, before_commit_point=Commits())
    assert_no_address(caught.value)
    api.drop_after_accept = False
    delivery = http_provider(api).send(email, before_commit_point=Commits())
    [stored] = api.messages
    assert delivery.provider_message_id == stored["id"]


def test_http_connection_refused() -> None:
    provider = HttpProvider(HttpSettings(url=f"http://127.0.0.1:{free_port()}", timeout=5))
    commits = Commits()
    with pytest.raises(ProviderUnavailable):
        provider.send(outgoing(), before_commit_point=commits)
    assert commits.calls == 0


# -- SES -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def ses_provider(moto_url: str) -> SesProvider:
    return SesProvider(
        SesSettings(endpoint_url=moto_url, access_key_id="testing", secret_access_key="testing")
    )


def test_ses_send(moto_url: str) -> None:
    provider = ses_provider(moto_url)
    provider.client.create_email_identity(EmailIdentity=SENDER)
    commits = Commits()
    delivery = provider.send(outgoing(), before_commit_point=commits)
    assert delivery.provider == "ses" and delivery.provider_message_id
    assert commits.calls == 1


def test_ses_unverified_sender_is_rejected(moto_url: str) -> None:
    with pytest.raises(EmailRejected) as caught:
        ses_provider(moto_url).send(
            outgoing(from_address="nobody@unverified.test"), before_commit_point=Commits()
        )
    assert "unverified" not in str(caught.value)


def _stubbed(moto_url: str, code: str, status: int) -> tuple[SesProvider, Callable[[], None]]:
    from botocore.stub import Stubber

    provider = ses_provider(moto_url)
    stubber = Stubber(provider.client)
    stubber.add_client_error("send_email", service_error_code=code, http_status_code=status)
    stubber.activate()
    return provider, stubber.deactivate


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        ("TooManyRequestsException", 429, ProviderUnavailable),
        ("Throttling", 400, ProviderUnavailable),
        ("InternalFailure", 500, ProviderUnavailable),
        ("MessageRejected", 400, EmailRejected),
        ("BadRequestException", 400, ProviderRefused),
    ],
)
def test_ses_errors(moto_url: str, code: str, status: int, error: type[Exception]) -> None:
    provider, done = _stubbed(moto_url, code, status)
    try:
        with pytest.raises(error):
            provider.send(outgoing(), before_commit_point=Commits())
    finally:
        done()


@pytest.mark.parametrize(
    ("fault", "error"),
    [("read_timeout", DeliveryUncertain), ("closed", DeliveryUncertain), ("connect", ProviderUnavailable)],
)
def test_ses_network_faults(moto_url: str, fault: str, error: type[Exception]) -> None:
    """botocore's own before-send hook stands in for the network failing at that point
    (moto never times out): after the request left, no answer is an unknown outcome."""
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

    faults = {
        "read_timeout": ReadTimeoutError(endpoint_url=moto_url),
        "closed": ConnectionClosedError(endpoint_url=moto_url),
        "connect": EndpointConnectionError(endpoint_url=moto_url),
    }

    def fail(**_: Any) -> None:
        raise faults[fault]

    provider = ses_provider(moto_url)
    provider.client.meta.events.register("before-send.sesv2.SendEmail", fail)
    commits = Commits()
    with pytest.raises(error):
        provider.send(outgoing(), before_commit_point=commits)
    assert commits.calls == 1


def test_ses_unreachable() -> None:
    provider = SesProvider(
        SesSettings(
            endpoint_url=f"http://127.0.0.1:{free_port()}",
            access_key_id="testing",
            secret_access_key="testing",
        )
    )
    with pytest.raises(ProviderUnavailable):
        provider.send(outgoing(), before_commit_point=Commits())
