"""Email providers: one message out through SMTP, an HTTP email API or Amazon SES.

Each provider calls ``before_commit_point()`` exactly once, right before the point of no
return (SMTP: after MAIL and RCPT succeeded, before DATA; HTTP and SES: before the request is
sent). The stage commits the outbox row ``SENDING`` there. Failures are classified so the
stage knows what happened to the message:

- nothing accepted (network down, 4xx, throttling): :class:`ProviderUnavailable`, retried;
- refused for good: :class:`EmailRejected` (every recipient) or :class:`ProviderRefused`;
- no reply after the point of no return: :class:`DeliveryUncertain` (it may have arrived).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.policy import SMTP, SMTPUTF8, EmailPolicy
from email.utils import formatdate
from html.parser import HTMLParser
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tasks.email.settings import EmailSettings

__all__ = ["Delivery", "OutgoingEmail", "Provider", "build_message", "provider_from", "text_from_html"]


@dataclass(frozen=True)
class OutgoingEmail:
    """One message as the stage hands it to a provider (the HTML resolved, our Message-ID set)."""

    outbox_id: str
    message_id: str  # "<outboxId@domain>"
    from_address: str
    to: str
    cc: tuple[str, ...] = ()
    bcc: tuple[str, ...] = ()
    reply_to: str | None = None
    subject: str = ""
    html: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    tags: tuple[str, ...] = ()

    @property
    def recipients(self) -> list[str]:
        """``to``, ``cc`` and ``bcc`` in that order, each address once (case-insensitively)."""
        seen: set[str] = set()
        out: list[str] = []
        for address in (self.to, *self.cc, *self.bcc):
            if address.lower() not in seen:
                seen.add(address.lower())
                out.append(address)
        return out


@dataclass(frozen=True)
class Delivery:
    """What a provider accepted."""

    provider: str  # "smtp" | "http" | "ses"
    provider_message_id: str  # smtp: our Message-ID; http: the peer's "id"; ses: its MessageId
    refused: tuple[str, ...] = ()  # refused while others were accepted (smtp)


class Provider(Protocol):
    """Sends one message; see the module's docstring for the contract."""

    name: str

    def send(self, email: OutgoingEmail, *, before_commit_point: Callable[[], None]) -> Delivery:
        """Send ``email``, calling ``before_commit_point`` once right before the point of no return."""
        ...


def provider_from(settings: EmailSettings) -> Provider:
    """The provider ``settings.provider`` names, built from its section."""
    if settings.provider == "http":
        from tasks.email.providers.http import HttpProvider

        assert settings.http is not None  # EmailSettings refuses "http" without its section
        return HttpProvider(settings.http)
    if settings.provider == "ses":
        from tasks.email.providers.ses import SesProvider

        assert settings.ses is not None
        return SesProvider(settings.ses)
    from tasks.email.providers.smtp import SmtpProvider

    return SmtpProvider(settings.smtp)


class _TextOf(HTMLParser):
    """The visible text of an HTML document, blocks on their own lines, links kept."""

    BLOCKS = frozenset(
        {
            *("address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "footer"),
            *("h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p"),
            *("pre", "section", "table", "tr", "ul"),
        }
    )
    HIDDEN = frozenset({"script", "style", "head", "title", "template"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0
        self.href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.HIDDEN:
            self.hidden += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")
        elif tag == "a":
            self.href = dict(attrs).get("href")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")
        elif tag == "a" and self.href:
            if self.href.startswith(("http://", "https://")):
                self.parts.append(f" ({self.href})")
            self.href = None

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def text_from_html(html: str) -> str:
    """A plain-text alternative of ``html``: tags dropped, blocks as lines, links in brackets."""
    parser = _TextOf()
    parser.feed(html)
    parser.close()
    lines = (re.sub(r"[ \t\r\f\v\u00a0]+", " ", line).strip() for line in "".join(parser.parts).split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return text + "\n"


def build_message(email: OutgoingEmail) -> EmailMessage:
    """The MIME message: ``multipart/alternative`` with a text part derived from the HTML and
    the HTML itself; From, To, Cc (never Bcc), Subject, Message-ID, Date, Reply-To, the
    payload's headers and ``X-Tags``. Internationalized addresses select the SMTPUTF8 policy."""
    addresses = (email.from_address, *email.recipients, email.reply_to or "")
    policy = email_policy(needs_smtputf8(addresses))
    message = EmailMessage(policy=policy)
    message["From"] = email.from_address
    message["To"] = email.to
    if email.cc:
        message["Cc"] = ", ".join(email.cc)
    message["Subject"] = email.subject
    message["Message-ID"] = email.message_id
    message["Date"] = formatdate(usegmt=True)
    if email.reply_to:
        message["Reply-To"] = email.reply_to
    for name, value in email.headers.items():
        message[name] = value
    if email.tags and not any(name.lower() == "x-tags" for name in email.headers):
        message["X-Tags"] = ", ".join(email.tags)
    message.set_content(text_from_html(email.html))
    message.add_alternative(email.html, subtype="html")
    return message


def needs_smtputf8(addresses: tuple[str, ...] | list[str]) -> bool:
    """True when an address is not ASCII (RFC 6531)."""
    return any(not address.isascii() for address in addresses)


def email_policy(smtputf8: bool) -> EmailPolicy[EmailMessage]:
    """CRLF line endings; UTF-8 headers only when an address needs them."""
    return SMTPUTF8 if smtputf8 else SMTP


_ENHANCED = re.compile(r"^\s*([245]\.\d{1,3}\.\d{1,3})\b")


def enhanced_status(reply: bytes | str | None) -> str:
    """The enhanced status code (``5.1.1``) that starts an SMTP reply, as `` 5.1.1``, or ``""``.
    The rest of the reply is never kept: servers quote addresses in it."""
    if reply is None:
        return ""
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply
    match = _ENHANCED.match(text)
    return f" {match.group(1)}" if match else ""
