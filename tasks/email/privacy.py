"""Keeping personal data out of logs, labels, events and errors.

Addresses are masked as the seed does (``user@example.com`` → ``u***@e***.com``); a CPF/CNPJ
travels only as an HMAC keyed by the ``pii_key`` setting: the seed's plain SHA-256 of 11
digits reverses in seconds by enumerating them.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

# Anything that looks like an address inside free text (a server reply, a header value).
_ADDRESS = re.compile(r"[^\s<>()\[\],;:\"']+@[^\s<>()\[\],;:\"']+")
_PUNCTUATION = re.compile(r"[\s.\-/]")
# EmailSendJobData's fields: any other key of a payload shows as "***" in the masked view.
_PAYLOAD_FIELDS = frozenset(
    {
        *("outboxId", "companyId", "requestId", "to", "cc", "bcc", "subject", "htmlRef", "replyTo"),
        *("headers", "tags", "recipient", "attempt", "enqueuedAt"),
    }
)
_RECIPIENT_FIELDS = frozenset({"recipientId", "externalId", "cpfCnpjHash", "razaoSocial", "nome", "email"})


def mask_email(address: object) -> str:
    """The seed's mask: the first character of the local part and of the domain, then the
    domain's last label: ``user@example.com`` → ``u***@e***.com``, ``joao@mail.empresa.com.br``
    → ``j***@m***.br`` (only the last label stays: the middle ones can name the employer).

    Never raises. Odd input degrades to less: no ``@`` gives ``u***``, an empty local part
    ``***@e***.com``, a domain without a dot ``u***@l***``, anything but a string ``***``.
    Masking a masked address gives it back unchanged.
    """
    try:
        if not isinstance(address, str) or not address.strip():
            return MASK
        text = address.strip()
        local, at, domain = text.rpartition("@")
        if not at:
            return _first(text)
        head = _first(local)
        labels = domain.split(".")
        first = _first(labels[0])
        if len(labels) == 1:
            return f"{head}@{first}"
        return f"{head}@{first}.{labels[-1]}"
    except Exception:  # a log line must never fail on its masking
        return MASK


def _first(part: str) -> str:
    # A part already masked ("***") stays as it is, so masking twice changes nothing.
    return part[0] + MASK if part and not part.startswith("*") else MASK


def mask_addresses_in(text: str) -> str:
    """``text`` with every address-looking word masked (for server replies and header values)."""
    return _ADDRESS.sub(lambda m: mask_email(m.group(0)), text)


def cpf_cnpj_hash(digits: str, key: bytes) -> str:
    """HMAC-SHA256 (hex) of a CPF (11 digits) or CNPJ (14 digits), keyed by ``pii_key``.

    Formatting (dots, dashes, slashes, spaces) is dropped first, so ``123.456.789-09`` and
    ``12345678909`` hash alike. Anything else is a ``ValueError`` whose message never holds
    the value.
    """
    if not key:
        raise ValueError("pii_key is empty: a CPF/CNPJ cannot be hashed without it")
    if not isinstance(digits, str):
        raise ValueError("a CPF/CNPJ must be a string of digits")
    bare = _PUNCTUATION.sub("", digits)
    if not bare.isascii() or not bare.isdigit():
        raise ValueError("a CPF/CNPJ may hold only digits and . - / separators")
    if len(bare) not in (11, 14):
        raise ValueError(f"a CPF has 11 digits and a CNPJ 14; this one has {len(bare)}")
    return hmac.new(key, bare.encode("ascii"), hashlib.sha256).hexdigest()


def short_hash(value: object) -> str:
    """A hash cut to its first 8 characters for logs, as the seed does: ``a3c7b8d9...``."""
    if not isinstance(value, str) or not value:
        return MASK
    return value[:8] + "..."


def _mask_any(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        return mask_email(value)
    if isinstance(value, (list, tuple)):
        return [mask_email(v) for v in value]
    return MASK


def masked(data: Mapping[str, Any]) -> dict[str, Any]:
    """A log-safe copy of an ``EmailSendJobData`` payload (valid or not): ``to``, ``cc``,
    ``bcc``, ``replyTo`` and ``recipient.email`` masked, ``cpfCnpjHash`` cut to 8 characters,
    ``nome`` and ``razaoSocial`` dropped, addresses inside header values masked, the values
    of keys the contract does not have hidden (``***``). For
    ``kwargsrepr``, job labels, events and log lines. Never raises."""
    try:
        view: dict[str, Any] = {str(k): v if k in _PAYLOAD_FIELDS else MASK for k, v in dict(data).items()}
    except Exception:
        return {}
    for field in ("to", "cc", "bcc", "replyTo"):
        if field in view:
            view[field] = _mask_any(view[field])
    headers = view.get("headers")
    if isinstance(headers, Mapping):
        view["headers"] = {
            str(k): mask_addresses_in(v) if isinstance(v, str) else MASK for k, v in headers.items()
        }
    elif headers is not None:
        view["headers"] = MASK
    recipient = view.get("recipient")
    if isinstance(recipient, Mapping):
        # Unknown keys are hidden too: an invalid payload may carry a CPF in clear.
        safe = {str(k): v if k in _RECIPIENT_FIELDS else MASK for k, v in recipient.items()}
        safe.pop("nome", None)
        safe.pop("razaoSocial", None)
        if "email" in safe:
            safe["email"] = _mask_any(safe["email"])
        if safe.get("cpfCnpjHash") is not None:
            safe["cpfCnpjHash"] = short_hash(safe["cpfCnpjHash"])
        view["recipient"] = safe
    elif recipient is not None:
        view["recipient"] = MASK
    return view
