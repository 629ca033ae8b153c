"""The ``email:send`` job contract (the seed's ``EmailSendJobData``), its result and constants.

Validation messages name the field and what is wrong, never the value: a payload error ends
in logs, dead letters and HTTP answers, and the values are addresses. pydantic's messages
quote no input (``readable_validation_error`` leaves the input out); email-validator's can
quote characters of the address, so they are rewritten (:func:`_reason`).
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from typing import Any, Literal

from email_validator import EmailNotValidError, validate_email
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from tasks.email.privacy import mask_email

QUEUE = "email"
STAGE = "conveyor.email.send"
DEFAULT_TTL_S = 86400
DEFAULT_PRIORITY = 5
MAX_ATTEMPTS = 5
BACKOFF_DELAYS = (1, 5, 30, 120, 600)
# Fields a resubmission may change without being another message (strict idempotency).
IDEMPOTENCY_IGNORE = ("attempt", "enqueuedAt", "requestId")
MAX_LIST = 5
MAX_ADDRESS = 254

# email-validator refuses special-use domains (RFC 6761/6762: ``.test``, ``.local``, ...)
# unless told it runs in a test environment. Tests and ``conveyor demo`` send to ``.test``
# addresses, which can never reach a real mailbox, so they switch this on; production keeps
# it off, so a producer's reserved-domain address is refused at submit instead of bouncing.
# Process-wide: the stage module sets it from the setting (CONVEYOR_EMAIL's
# allow_test_domains) when it is imported, in workers and callers alike.
ALLOW_TEST_DOMAINS = False

# Headers the message builder sets itself: a payload may not override them.
RESERVED_HEADERS = frozenset(
    name.lower()
    for name in (
        "From",
        "To",
        "Cc",
        "Bcc",
        "Subject",
        "Message-ID",
        "Date",
        "Reply-To",
        "Content-Type",
        "MIME-Version",
        "Content-Transfer-Encoding",
    )
)
MAX_HEADERS = 20
MAX_HEADER_VALUE = 998  # RFC 5322's line limit
_UUID = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")
_FIELD_NAME = re.compile(r"[\x21-\x39\x3b-\x7e]{1,76}")  # RFC 5322 ftext, folded-line sized
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def allow_test_domains(allow: bool) -> None:
    """Accept (``True``) or refuse special-use domains such as ``.test`` in addresses, for
    this process (see :data:`ALLOW_TEST_DOMAINS`)."""
    global ALLOW_TEST_DOMAINS
    ALLOW_TEST_DOMAINS = allow


def _reason(message: str, address: str) -> str:
    """email-validator's message cut to a reason that quotes nothing of ``address``."""
    reason = message.split(":", 1)[0] if "characters" in message else message
    reason = re.sub(r"'[^']*'|\"[^\"]*\"", "", reason).strip().rstrip(".").strip()
    parts = {address, *re.split(r"[@.]", address)}
    if not reason or any(len(p) >= 3 and p in reason for p in parts if p not in ("sign", "com")):
        return "not a valid email address"
    return f"not a valid email address ({reason[:1].lower()}{reason[1:]})"


def check_address(value: str) -> str:
    """Validate one address (email-validator, no DNS); returns its normalized form. Raises
    ``PydanticCustomError`` with a message that never quotes the address."""
    if len(value) > MAX_ADDRESS:
        raise PydanticCustomError(
            "email_too_long", f"not a valid email address (over {MAX_ADDRESS} characters)"
        )
    try:
        result = validate_email(value, check_deliverability=False, test_environment=ALLOW_TEST_DOMAINS)
    except EmailNotValidError as exc:
        raise PydanticCustomError("email", _reason(str(exc), value)) from None
    return str(result.normalized)


def wire_address(value: str) -> str:
    """``value`` as it goes on the wire: its ASCII form (the domain in IDNA) when its local
    part is ASCII, so a server without SMTPUTF8 takes it; else as written."""
    try:
        result = validate_email(value, check_deliverability=False, test_environment=ALLOW_TEST_DOMAINS)
    except EmailNotValidError:
        return value
    return str(result.ascii_email or value)


def _address(value: str) -> str:
    check_address(value)
    return value  # the producer's spelling travels on; only its validity is checked here


def _uuid(value: str) -> str:
    if not _UUID.fullmatch(value):
        raise PydanticCustomError("uuid", "not a UUID (8-4-4-4-12 hexadecimal digits)")
    return value


def _no_newline(value: str) -> str:
    if "\r" in value or "\n" in value:
        raise PydanticCustomError("newline", "must not contain a line break (CR or LF)")
    return value


class Recipient(BaseModel):
    """Who the message is for: at least one identifier, never a CPF/CNPJ in clear."""

    model_config = ConfigDict(extra="forbid")

    recipientId: str | None = None
    externalId: str | None = Field(default=None, min_length=1, max_length=64)
    cpfCnpjHash: str | None = None
    razaoSocial: str | None = Field(default=None, max_length=200)
    nome: str | None = Field(default=None, max_length=200)
    email: str

    @field_validator("recipientId")
    @classmethod
    def _recipient_id(cls, value: str | None) -> str | None:
        return None if value is None else _uuid(value)

    @field_validator("cpfCnpjHash")
    @classmethod
    def _hash(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256_HEX.fullmatch(value):
            raise PydanticCustomError("hash", "must be 64 lowercase hexadecimal characters (an HMAC-SHA256)")
        return value

    @field_validator("email")
    @classmethod
    def _email(cls, value: str) -> str:
        return _address(value)


class EmailSendJobData(BaseModel):
    """The seed's ``EmailSendJobData``, its field names kept. Validations 1-9 of the seed,
    plus at most 5 each of ``cc``, ``bcc`` and ``tags``, a valid ``replyTo`` and headers that
    are RFC 5322 fields without line breaks and not ones the message builder sets.

    The cross-field rules (``recipient.email`` equals ``to``, at least one recipient
    identifier) are here too: a client that submits by stage name only checks the JSON
    Schema, so the worker validates again with this model.
    """

    model_config = ConfigDict(extra="forbid")

    # Lower case: the outboxId is the job's id, and an id spelled two ways would be two jobs.
    # The pattern is the JSON Schema's (a client submitting by name checks it); here the
    # validators below say what is wrong in words.
    outboxId: str = Field(json_schema_extra={"pattern": "^[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$"})
    companyId: str
    requestId: str = Field(min_length=1, max_length=200)
    to: str
    cc: list[str] = Field(default_factory=list, max_length=MAX_LIST)
    bcc: list[str] = Field(default_factory=list, max_length=MAX_LIST)
    subject: str = Field(min_length=1, max_length=150)
    htmlRef: str = Field(min_length=1, max_length=1000)
    replyTo: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    tags: list[str] = Field(default_factory=list, max_length=MAX_LIST)
    recipient: Recipient
    attempt: int = Field(default=1, ge=1, le=MAX_ATTEMPTS)
    enqueuedAt: str

    @field_validator("outboxId", mode="before")
    @classmethod
    def _outbox_id(cls, value: Any) -> Any:
        if isinstance(value, str) and _UUID.fullmatch(value) and value != value.lower():
            raise PydanticCustomError("uuid_case", "a UUID in lower case (it is the job's id)")
        return value

    @field_validator("outboxId", "companyId")
    @classmethod
    def _ids(cls, value: str) -> str:
        return _uuid(value)

    @field_validator("to")
    @classmethod
    def _to(cls, value: str) -> str:
        return _address(value)

    @field_validator("cc", "bcc", "tags", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return [] if value is None else value  # a producer's explicit null means none

    @field_validator("headers", mode="before")
    @classmethod
    def _mapping(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("cc", "bcc")
    @classmethod
    def _copies(cls, value: list[str]) -> list[str]:
        for index, address in enumerate(value):
            try:
                check_address(address)
            except PydanticCustomError as exc:
                raise PydanticCustomError(exc.type, f"item {index}: {exc.message()}") from None
        return value

    @field_validator("replyTo")
    @classmethod
    def _reply_to(cls, value: str | None) -> str | None:
        return None if value is None else _address(value)

    @field_validator("subject", "requestId", "htmlRef")
    @classmethod
    def _single_line(cls, value: str) -> str:
        return _no_newline(value)

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        for index, tag in enumerate(value):
            if not 1 <= len(tag) <= 64 or _CONTROL.search(tag):
                raise PydanticCustomError(
                    "tag", f"item {index}: a tag is 1-64 characters without control characters"
                )
        return value

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        # Checked as a whole so the error's location never carries a header name (a value).
        if len(value) > MAX_HEADERS:
            raise PydanticCustomError("headers", f"at most {MAX_HEADERS} headers")
        for name, text in value.items():
            if not _FIELD_NAME.fullmatch(name):
                raise PydanticCustomError(
                    "header_name",
                    "a header name must be 1-76 printable ASCII characters without ':' or spaces",
                )
            if name.lower() in RESERVED_HEADERS:
                raise PydanticCustomError(
                    "header_reserved",
                    "a header the message builder sets itself cannot be given (From, To, ...)",
                )
            if _CONTROL.search(text.replace("\t", " ")):
                raise PydanticCustomError(
                    "header_value", "a header value must not contain CR, LF or control characters"
                )
            if len(text) > MAX_HEADER_VALUE:
                raise PydanticCustomError(
                    "header_value", f"a header value is at most {MAX_HEADER_VALUE} characters"
                )
        return value

    @field_validator("enqueuedAt")
    @classmethod
    def _iso(cls, value: str) -> str:
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise PydanticCustomError("datetime", "not an ISO 8601 timestamp") from None
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> EmailSendJobData:
        problems: list[InitErrorDetails] = []
        if not (self.recipient.recipientId or self.recipient.externalId or self.recipient.cpfCnpjHash):
            problems.append(
                InitErrorDetails(
                    type=PydanticCustomError(
                        "recipient_id", "at least one of recipientId, externalId or cpfCnpjHash is required"
                    ),
                    loc=("recipient",),
                    input=None,
                )
            )
        if _comparable(self.recipient.email) != _comparable(self.to):
            problems.append(
                InitErrorDetails(
                    type=PydanticCustomError("recipient_email", "must be the same address as to"),
                    loc=("recipient", "email"),
                    input=None,
                )
            )
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self


def _comparable(address: str) -> str:
    # email-validator's normalization (Unicode NFC, the domain lowercased and IDNA-checked);
    # the local part stays case-sensitive, as RFC 5321 has it.
    return check_address(address)


class EmailSendJobResult(BaseModel):
    """The seed's ``EmailSendJobResult``. ``sesMessageId`` became ``providerMessageId`` (the
    provider may be SMTP or an HTTP API); ``messageId`` is our ``Message-ID`` header;
    ``refused`` lists the recipients the server refused while taking the rest, masked (results
    show in Flower and the console; the outbox row keeps them in full)."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["SENT", "ALREADY_SENT"]
    providerMessageId: str | None = None
    messageId: str | None = None
    processedAt: str
    durationMs: int = Field(ge=0)
    attempt: int = Field(ge=1)
    refused: list[str] = Field(default_factory=list)

    @field_validator("refused")
    @classmethod
    def _masked(cls, value: list[str]) -> list[str]:
        return [mask_email(address) for address in value]  # masking is idempotent


def conveyor_priority(seed_priority: int) -> int:
    """The seed's priority (1-10, 1 first, default 5) as Conveyor's (higher first): 11 - p."""
    if isinstance(seed_priority, bool) or not isinstance(seed_priority, int) or not 1 <= seed_priority <= 10:
        raise ValueError("priority must be an integer from 1 (first) to 10 (last)")
    return 11 - seed_priority


def html_ref_for(html: str) -> str:
    """The ``htmlRef`` (and ``email_html`` id) of an HTML body: its UTF-8 bytes' SHA-256, hex.
    The same body twice is the same reference, so a message sent twice is the same payload."""
    return hashlib.sha256(html.encode("utf-8")).hexdigest()
