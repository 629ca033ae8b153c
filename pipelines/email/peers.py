"""Local stand-ins for the email providers, for the tests, ``conveyor demo`` and the benchmark:
an SMTP server (aiosmtpd) with STARTTLS, AUTH and fault switches, a self-signed certificate
to trust through ``smtp.ca_file``, and an HTTP email API honouring ``Idempotency-Key``.

Like real servers, the SMTP peer quotes the address in its refusals: the family must not
copy that text anywhere.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default as default_policy
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "HttpEmailPeer",
    "ReceivedMessage",
    "SmtpPeer",
    "free_port",
    "make_test_certificate",
    "server_tls_context",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_test_certificate(tmp_dir: Path | str) -> tuple[Path, Path]:
    """A self-signed certificate for ``localhost`` and ``127.0.0.1`` (an IP SAN: the client
    connects by address) in ``tmp_dir``; returns (cert_path, key_path). Trust it with
    ``smtp.ca_file = cert_path``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory = Path(tmp_dir)
    directory.mkdir(parents=True, exist_ok=True)
    cert_path = directory / "smtp-peer.pem"
    key_path = directory / "smtp-peer.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def server_tls_context(cert_path: Path | str, key_path: Path | str) -> ssl.SSLContext:
    """The server side's TLS context for :class:`SmtpPeer` (``tls_context=``)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert_path), str(key_path))
    return context


@dataclass(frozen=True)
class ReceivedMessage:
    """One message the SMTP peer took (or, with ``drop_at_data``, took without answering)."""

    mail_from: str
    rcpt_tos: tuple[str, ...]
    message: EmailMessage
    message_id: str | None
    raw: bytes = field(repr=False)


class _Handler:
    """aiosmtpd's handler hooks, deciding by the peer's switches."""

    def __init__(self, peer: SmtpPeer) -> None:
        self.peer = peer

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: list[str]
    ) -> str:
        code = self.peer.refuse(address) if self.peer.refuse is not None else None
        if code is not None:
            status = "5.1.1" if code >= 500 else "4.2.0"
            return f"{code} {status} <{address}>: Recipient address rejected"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        if self.peer.delay_s:
            await asyncio.sleep(self.peer.delay_s)
        if self.peer.fail_data is not None:
            code = self.peer.fail_data
            status = "5.6.0" if code >= 500 else "4.3.0"
            return f"{code} {status} Message from <{envelope.mail_from}> refused"
        self.peer._record(envelope)
        if self.peer.reply_delay_s:
            # Took the message; the reply is slow (a killed sender never reads it).
            await asyncio.sleep(self.peer.reply_delay_s)
        if self.peer.drop_at_data:
            # Took the message, then the connection dies before the reply: the ambiguous send.
            server.transport.abort()
        return "250 2.0.0 OK: queued"


class SmtpPeer:
    """An SMTP server on 127.0.0.1 and a free port (aiosmtpd's ``Controller``).

    ``tls_context``: STARTTLS offered; with ``credentials`` (username, password) AUTH is
    advertised only after STARTTLS (without TLS it is offered in clear). ``refuse(address)``
    gives a reply code to refuse a recipient with (``None``: accept). ``fail_data``: the reply
    to the message's end. ``drop_at_data``: record the message, then drop the connection
    without replying. ``delay_s``: wait before answering DATA; ``reply_delay_s``: take the
    message, then wait that long before the reply.
    """

    def __init__(
        self,
        *,
        tls_context: ssl.SSLContext | None = None,
        credentials: tuple[str, str] | None = None,
        refuse: Callable[[str], int | None] | None = None,
        fail_data: int | None = None,
        drop_at_data: bool = False,
        delay_s: float = 0.0,
        reply_delay_s: float = 0.0,
    ) -> None:
        self.tls_context = tls_context
        self.credentials = credentials
        self.refuse = refuse
        self.fail_data = fail_data
        self.drop_at_data = drop_at_data
        self.delay_s = delay_s
        self.reply_delay_s = reply_delay_s
        self.port = free_port()
        self.host = "127.0.0.1"
        self.auth_attempts = 0
        self._messages: list[ReceivedMessage] = []
        self._changed = threading.Condition()
        self._controller: Any = None

    @property
    def messages(self) -> list[ReceivedMessage]:
        """A snapshot of the messages taken so far, in order."""
        with self._changed:
            return list(self._messages)

    @property
    def count(self) -> int:
        """How many messages were taken so far (cheap: for a benchmark's polling)."""
        with self._changed:
            return len(self._messages)

    def wait_for(self, count: int, timeout: float = 10.0) -> list[ReceivedMessage]:
        """The messages once there are at least ``count`` (or whatever came within ``timeout``)."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._messages) >= count, timeout)
            return list(self._messages)

    def _record(self, envelope: Any) -> None:
        raw = bytes(envelope.original_content or envelope.content or b"")
        parsed = BytesParser(policy=default_policy).parsebytes(raw)
        assert isinstance(parsed, EmailMessage)
        received = ReceivedMessage(
            mail_from=str(envelope.mail_from),
            rcpt_tos=tuple(envelope.rcpt_tos),
            message=parsed,
            message_id=parsed["Message-ID"],
            raw=raw,
        )
        with self._changed:
            self._messages.append(received)
            self._changed.notify_all()

    def _authenticate(self, server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any) -> Any:
        from aiosmtpd.smtp import AuthResult, LoginPassword

        self.auth_attempts += 1
        if self.credentials is None or not isinstance(auth_data, LoginPassword):
            return AuthResult(success=False, handled=False)
        username, password = self.credentials
        ok = auth_data.login == username.encode() and auth_data.password == password.encode()
        return AuthResult(success=ok, handled=False)

    def start(self) -> SmtpPeer:
        """Start serving; returns the peer."""
        from aiosmtpd.controller import Controller

        # aiosmtpd logs every session at INFO: a demo or benchmark run would drown in it.
        logging.getLogger("mail.log").setLevel(logging.WARNING)

        options: dict[str, Any] = {"enable_SMTPUTF8": True}
        if self.tls_context is not None:
            options["tls_context"] = self.tls_context
            options["auth_require_tls"] = True
        else:
            options["auth_require_tls"] = False
        if self.credentials is not None:
            options["authenticator"] = self._authenticate
        self._controller = Controller(_Handler(self), hostname=self.host, port=self.port, **options)
        self._controller.start()
        return self

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._controller is not None:
            self._controller.stop()
            self._controller = None

    def __enter__(self) -> SmtpPeer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class HttpEmailPeer:
    """An HTTP email API on 127.0.0.1 and a free port: ``POST /emails`` stores the JSON body
    and answers ``{"id": ...}``; the same ``Idempotency-Key`` answers the same id without
    storing twice. ``token``: a ``Bearer`` token to require (401 otherwise).
    ``status_next``: codes to answer first, one per request, storing nothing.
    ``drop_after_accept``: store the message, then close without a response (while set).
    ``reply_delay_s``: answer that long after storing.
    """

    def __init__(self, *, token: str | None = None) -> None:
        self.token = token
        self.status_next: list[int] = []
        self.drop_after_accept = False
        self.reply_delay_s = 0.0
        self.requests = 0
        self._messages: list[dict[str, Any]] = []
        self._by_key: dict[str, str] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(self))
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL to configure (``http.url``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def messages(self) -> list[dict[str, Any]]:
        """A snapshot of the stored messages (each the request's JSON plus ``id`` and
        ``idempotency_key``)."""
        with self._lock:
            return list(self._messages)

    def _answer(self, handler: BaseHTTPRequestHandler) -> tuple[int, dict[str, Any]] | None:
        """The status and JSON to answer with, or ``None`` to drop the connection."""
        with self._lock:
            self.requests += 1
            if handler.path.rstrip("/") != "/emails":
                return 404, {"error": "not found"}
            if self.token is not None and handler.headers.get("Authorization") != f"Bearer {self.token}":
                return 401, {"error": "unauthorized"}
            length = int(handler.headers.get("Content-Length") or 0)
            try:
                body = json.loads(handler.rfile.read(length))
            except ValueError:
                return 400, {"error": "not JSON"}
            if self.status_next:
                status = self.status_next.pop(0)
                return status, {"error": f"status {status} by request"}
            if not isinstance(body, dict) or not body.get("to") or not body.get("from"):
                return 400, {"error": "from and to are required"}
            key = handler.headers.get("Idempotency-Key")
            if key and key in self._by_key:
                return 200, {"id": self._by_key[key], "replayed": True}
            message_id = uuid.uuid4().hex
            self._messages.append({**body, "id": message_id, "idempotency_key": key})
            if key:
                self._by_key[key] = message_id
            if self.drop_after_accept:
                return None
            return 200, {"id": message_id}

    def start(self) -> HttpEmailPeer:
        """Start serving in a thread; returns the peer."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="http-email-peer", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> HttpEmailPeer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _http_handler(peer: HttpEmailPeer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes on a kept-alive connection: with Nagle's
        # algorithm and the client's delayed ACK each answer would wait ~40 ms more.
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            answer = peer._answer(self)
            if answer is None:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            status, body = answer
            if peer.reply_delay_s:
                time.sleep(peer.reply_delay_s)  # stored; the answer is slow
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the tests' output stays readable; requests are counted instead

    return Handler
