"""Masking addresses, hashing CPF/CNPJ and the log-safe view of an email payload."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.email.privacy import cpf_cnpj_hash, mask_addresses_in, mask_email, masked, short_hash

KEY = b"conveyor-test-key"
# openssl dgst -sha256 -hmac conveyor-test-key, over the bare digits.
CPF_VECTOR = "5de79b08022f233930a7b60853802949c4baca3bee344ffbd6d2e2d957163eec"
CNPJ_VECTOR = "e8036ac4ed5494c0d44e4014ea53a118c47b10114e826e3f1ebead6240ca131b"


@pytest.mark.parametrize(
    ("address", "mask"),
    [
        ("user@example.com", "u***@e***.com"),  # the seed's example
        ("joao@mail.empresa.com.br", "j***@m***.br"),  # only the last label stays
        ("a@b.co", "a***@b***.co"),
        ("user@localhost", "u***@l***"),
        ("@example.com", "***@e***.com"),
        ("user@", "u***@***"),
        ("user", "u***"),
        ("", "***"),
        ("   ", "***"),
        ('"odd@local"@example.com', '"***@e***.com'),
        ("user@.com", "u***@***.com"),
        ("joão@exemplo.com.br", "j***@e***.br"),
    ],
)
def test_mask_email(address: str, mask: str) -> None:
    assert mask_email(address) == mask


def test_mask_email_of_non_strings() -> None:
    assert mask_email(None) == "***"
    assert mask_email(42) == "***"
    assert mask_email(["user@example.com"]) == "***"


@given(st.text())
def test_mask_email_never_raises_and_is_idempotent(text: str) -> None:
    once = mask_email(text)
    assert mask_email(once) == once


@given(
    st.from_regex(r"[a-z0-9._]{2,30}", fullmatch=True),
    st.from_regex(r"[a-z0-9]{2,20}", fullmatch=True),
)
def test_mask_email_hides_all_but_first_characters(local: str, domain: str) -> None:
    mask = mask_email(f"{local}@{domain}.com.br")
    assert mask == f"{local[0]}***@{domain[0]}***.br"


def test_mask_addresses_in_text() -> None:
    text = "550 5.1.1 <maria.canary@dest.test>: Recipient rejected; cc copy@x.org"
    assert mask_addresses_in(text) == "550 5.1.1 <m***@d***.test>: Recipient rejected; cc c***@x***.org"


def test_cpf_cnpj_hash_known_vectors() -> None:
    assert cpf_cnpj_hash("12345678909", KEY) == CPF_VECTOR
    assert cpf_cnpj_hash("123.456.789-09", KEY) == CPF_VECTOR
    assert cpf_cnpj_hash("11.222.333/0001-81", KEY) == CNPJ_VECTOR
    assert cpf_cnpj_hash("12345678909", b"another key") != CPF_VECTOR


@pytest.mark.parametrize("digits", ["1234567890", "123456789012", "123456789012345", "", "123.456.789-0X"])
def test_cpf_cnpj_hash_refuses_without_echoing(digits: str) -> None:
    with pytest.raises(ValueError) as caught:
        cpf_cnpj_hash(digits, KEY)
    if digits:
        assert digits not in str(caught.value)
        assert "123456789" not in str(caught.value)


def test_cpf_cnpj_hash_needs_a_key() -> None:
    with pytest.raises(ValueError, match="pii_key"):
        cpf_cnpj_hash("12345678909", b"")


def test_short_hash() -> None:
    assert short_hash(CPF_VECTOR) == "5de79b08..."
    assert short_hash(None) == "***"


def test_masked_payload() -> None:
    data = {
        "outboxId": "123e4567-e89b-12d3-a456-426614174000",
        "to": "maria.canary@dest.test",
        "cc": ["copy.canary@dest.test"],
        "bcc": ["hidden.canary@dest.test"],
        "replyTo": "reply.canary@sender.test",
        "subject": "Seu boleto",
        "headers": {"X-Contact": "write to contact.canary@sender.test"},
        "recipient": {
            "externalId": "CUST-1",
            "cpfCnpjHash": CPF_VECTOR,
            "razaoSocial": "Canary Razao Ltda",
            "nome": "Maria Canary",
            "email": "maria.canary@dest.test",
        },
    }
    view = masked(data)
    text = json.dumps(view)
    assert "canary" not in text.lower()
    assert CPF_VECTOR not in text
    assert view["to"] == "m***@d***.test"
    assert view["cc"] == ["c***@d***.test"] and view["bcc"] == ["h***@d***.test"]
    assert view["replyTo"] == "r***@s***.test"
    assert view["recipient"] == {
        "externalId": "CUST-1",
        "cpfCnpjHash": "5de79b08...",
        "email": "m***@d***.test",
    }
    assert view["subject"] == "Seu boleto" and view["outboxId"] == data["outboxId"]
    assert data["to"] == "maria.canary@dest.test"  # the original is untouched


@given(
    st.dictionaries(
        st.sampled_from(["to", "cc", "bcc", "replyTo", "recipient", "headers", "x"]),
        st.none() | st.integers() | st.text() | st.lists(st.text()),
    )
)
def test_masked_never_raises_on_odd_payloads(data: dict[str, object]) -> None:
    masked(data)


def test_masked_hides_what_the_contract_does_not_have() -> None:
    view = masked(
        {"to": "a@b.com", "cpfCnpj": "12345678909", "recipient": {"email": "a@b.com", "cpf": "12345678909"}}
    )
    assert "12345678909" not in json.dumps(view)
    assert view["cpfCnpj"] == "***" and view["recipient"]["cpf"] == "***"
