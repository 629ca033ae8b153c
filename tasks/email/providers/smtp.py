"""The SMTP provider: ``smtplib`` driven step by step (``mail``, ``rcpt``, ``data``; never
``sendmail``), so the outbox row is committed ``SENDING`` only once every recipient is known
and only a lost reply to DATA leaves the outcome unknown."""

from __future__ import annotations

import contextlib
import smtplib
import ssl
from collections.abc import Callable

from tasks.email.errors import DeliveryUncertain, EmailRejected, ProviderRefused, ProviderUnavailable
from tasks.email.providers import Delivery, OutgoingEmail, build_message, email_policy, enhanced_status
from tasks.email.settings import SmtpSettings

_ACCEPTED = (250, 251)


class SmtpProvider:
    """Sends through one SMTP relay (:class:`SmtpSettings`), a connection per message.

    STARTTLS verifies the server against ``ca_file`` (or the system's store): smtplib's own
    default context verifies nothing. An untrusted certificate is :class:`ProviderUnavailable`,
    not a configuration error: it is retried on the schedule (a certificate renewed on the
    server, or a ``ca_file`` fixed, lets the job through), then dead-letters naming the cause.
    """

    name = "smtp"

    def __init__(self, settings: SmtpSettings) -> None:
        self.settings = settings

    def _tls_context(self) -> ssl.SSLContext:
        cafile = str(self.settings.ca_file) if self.settings.ca_file else None
        try:
            return ssl.create_default_context(cafile=cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ProviderUnavailable(
                f"smtp.ca_file cannot be loaded ({type(exc).__name__}); check CONVEYOR_EMAIL"
            ) from None

    def send(self, email: OutgoingEmail, *, before_commit_point: Callable[[], None]) -> Delivery:
        """Send ``email``; see :mod:`tasks.email.providers` for the contract."""
        message = build_message(email)
        smtputf8 = message.policy is email_policy(True)
        payload = message.as_bytes(policy=message.policy)
        smtp: smtplib.SMTP | None = None
        healthy = False  # the connection last answered: QUIT politely
        try:
            try:
                smtp = smtplib.SMTP(self.settings.host, self.settings.port, timeout=self.settings.timeout)
                refused = self._envelope(smtp, email, smtputf8)
            except (EmailRejected, ProviderRefused, ProviderUnavailable):
                healthy = True
                raise
            except BaseException as exc:
                mapped = _classify(exc, committed=False)
                if mapped is None:
                    raise
                healthy = isinstance(exc, smtplib.SMTPResponseException)
                raise mapped from None
            # The stage commits SENDING here; if that fails nothing is sent and its error stands.
            before_commit_point()
            try:
                code, reply = smtp.data(payload)
                if code != 250:  # smtplib raises only for the reply to DATA itself, not the end's
                    raise smtplib.SMTPDataError(code, reply)
            except BaseException as exc:
                mapped = _classify(exc, committed=True)
                if mapped is None:
                    raise
                healthy = isinstance(exc, smtplib.SMTPResponseException)
                raise mapped from None
            healthy = True
            return Delivery(self.name, email.message_id, tuple(refused))
        finally:
            if smtp is not None:
                _hang_up(smtp, polite=healthy)

    def _envelope(self, smtp: smtplib.SMTP, email: OutgoingEmail, smtputf8: bool) -> list[str]:
        """EHLO, STARTTLS, AUTH, MAIL and one RCPT per recipient; returns the refused ones
        (raising when none was accepted)."""
        settings = self.settings
        smtp.ehlo()
        if settings.starttls:
            if not smtp.has_extn("starttls"):
                raise ProviderUnavailable("the SMTP server does not offer STARTTLS (smtp.starttls is on)")
            smtp.starttls(context=self._tls_context())
            smtp.ehlo()
        if settings.username:
            if not smtp.has_extn("auth"):
                raise ProviderRefused("the SMTP server does not offer AUTH (smtp.username is set)")
            password = settings.password.get_secret_value() if settings.password else ""
            smtp.login(settings.username, password)
        options: list[str] = []
        if smtputf8:
            if not smtp.has_extn("smtputf8"):
                raise EmailRejected(
                    "an internationalized address needs SMTPUTF8, which the server does not offer"
                )
            options.append("SMTPUTF8")
        code, reply = smtp.mail(email.from_address, options)
        if code not in _ACCEPTED:
            raise _by_code(code, f"the SMTP server refused the sender ({code}{enhanced_status(reply)})")
        accepted: list[str] = []
        refused: list[tuple[str, int]] = []
        for address in email.recipients:
            code, reply = smtp.rcpt(address)
            if code in _ACCEPTED:
                accepted.append(address)
            else:
                refused.append((address, code))
        if not accepted:
            raise _all_refused([code for _, code in refused])
        return [address for address, _ in refused]


def _by_code(code: int, message: str) -> ProviderRefused | ProviderUnavailable:
    """5xx: refused for good; anything else (4xx, odd codes): try again later."""
    if 500 <= code < 600:
        return ProviderRefused(message, code=code)
    return ProviderUnavailable(message, code=code)


def _all_refused(codes: list[int]) -> EmailRejected | ProviderUnavailable:
    summary = ", ".join(str(code) for code in sorted(set(codes)))
    if codes and all(500 <= code < 600 for code in codes):
        return EmailRejected(f"the SMTP server refused every recipient ({summary})", code=codes[0])
    transient = next((code for code in codes if not 500 <= code < 600), None)
    return ProviderUnavailable(f"the SMTP server refused every recipient for now ({summary})", code=transient)


def _classify(exc: BaseException, *, committed: bool) -> Exception | None:
    """The family's error for what smtplib or the network raised, ``None`` for anything else.
    Order matters: every ``SMTPException`` is an ``OSError``."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        return _all_refused([code for code, _ in exc.recipients.values()])
    if isinstance(exc, smtplib.SMTPResponseException):
        # A reply code came back, so the outcome is known even after DATA.
        what = {
            smtplib.SMTPSenderRefused: "refused the sender",
            smtplib.SMTPDataError: "refused the message",
            smtplib.SMTPAuthenticationError: "refused the login",
            smtplib.SMTPConnectError: "refused the connection",
            smtplib.SMTPHeloError: "refused EHLO",
        }.get(type(exc), "answered with an error")
        code = exc.smtp_code
        return _by_code(code, f"the SMTP server {what} ({code}{enhanced_status(exc.smtp_error)})")
    if isinstance(exc, smtplib.SMTPServerDisconnected):
        # smtplib reports a read that timed out as a disconnection ("...closed: timed out").
        if "timed out" in str(exc):
            return _lost(committed, "the SMTP server did not answer in time")
        return _lost(committed, "the SMTP server closed the connection")
    if isinstance(exc, smtplib.SMTPNotSupportedError):
        return ProviderRefused("the SMTP server does not support a command we need (AUTH or SMTPUTF8)")
    if isinstance(exc, smtplib.SMTPException):
        if committed:
            return DeliveryUncertain(
                "the SMTP exchange failed after DATA; the message may have been delivered"
            )
        return ProviderRefused(f"the SMTP exchange failed ({type(exc).__name__})")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ProviderUnavailable(
            f"the SMTP server's TLS certificate is not trusted ({exc.verify_message}); check smtp.ca_file"
        )
    if isinstance(exc, TimeoutError):
        return _lost(committed, "the SMTP server did not answer in time")
    if isinstance(exc, OSError):  # ConnectionError, ssl.SSLError, unreachable hosts
        return _lost(committed, f"the SMTP connection failed ({type(exc).__name__}: {exc.strerror or exc})")
    return None


def _lost(committed: bool, what: str) -> Exception:
    if committed:
        return DeliveryUncertain(f"{what} during DATA; the message may have been delivered")
    return ProviderUnavailable(f"{what}; nothing was sent")


def _hang_up(smtp: smtplib.SMTP, *, polite: bool) -> None:
    """QUIT when the server is still talking to us, else just close; never raises."""
    try:
        if polite:
            smtp.quit()
            return
    except Exception:  # a failing QUIT must not mask the error being raised
        pass
    with contextlib.suppress(Exception):
        smtp.close()
