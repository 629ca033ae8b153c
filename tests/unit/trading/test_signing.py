"""HMAC request signing: what a signature covers, the clock-skew window, replayed nonces
and unknown keys, and what a refusal says."""

from __future__ import annotations

import hashlib
import hmac
import threading

import pytest

from tasks.trading.signing import (
    HEADER_KEY_ID,
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    Verifier,
    canonical,
    sign,
)

NOW = 1_760_000_000.0
SECRET = "s3cret-value"
BODY = b'{"userId":"u1","trades":[]}'
PATH = "/v1/bias?x=1"


def _verifier(**kw: float) -> Verifier:
    return Verifier({"dev": SECRET}, **kw)


def test_a_signed_request_verifies_and_its_headers_are_the_four_named_ones() -> None:
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    assert set(headers) == {HEADER_KEY_ID, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE}
    assert headers[HEADER_KEY_ID] == "dev"
    assert headers[HEADER_TIMESTAMP] == str(int(NOW))
    assert len(headers[HEADER_NONCE]) == 32 and int(headers[HEADER_NONCE], 16) >= 0
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) is None


def test_the_signature_is_hmac_sha256_of_the_canonical_string() -> None:
    headers = sign("dev", SECRET, "post", PATH, BODY, now=NOW, nonce="abc")
    message = f"POST\n{PATH}\n{int(NOW)}\nabc\n{hashlib.sha256(BODY).hexdigest()}"
    assert canonical("post", PATH, str(int(NOW)), "abc", BODY) == message
    expected = hmac.new(SECRET.encode(), message.encode(), hashlib.sha256).hexdigest()
    assert headers[HEADER_SIGNATURE] == expected


def test_each_signing_draws_a_fresh_nonce() -> None:
    nonces = {sign("dev", SECRET, "POST", PATH, BODY, now=NOW)[HEADER_NONCE] for _ in range(50)}
    assert len(nonces) == 50


def test_header_names_are_matched_whatever_their_case() -> None:
    headers = {k.lower(): v for k, v in sign("dev", SECRET, "POST", PATH, BODY, now=NOW).items()}
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) is None


@pytest.mark.parametrize("offset", [-300, 300, -299, 299, 0])
def test_a_timestamp_within_five_minutes_either_way_is_accepted(offset: int) -> None:
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW + offset)
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) is None


@pytest.mark.parametrize("offset", [-301, 301, -3600, 86_400])
def test_a_timestamp_beyond_five_minutes_either_way_is_clock_skew(offset: int) -> None:
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW + offset)
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) == "clock skew"


def test_a_replayed_nonce_is_refused_even_with_a_valid_signature() -> None:
    verifier = _verifier()
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    assert verifier.check("POST", PATH, headers, BODY, now=NOW) is None
    assert verifier.check("POST", PATH, headers, BODY, now=NOW + 1) == "replayed nonce"
    # Re-signed with the same nonce and a later timestamp: still the same nonce.
    again = sign("dev", SECRET, "POST", PATH, BODY, now=NOW + 10, nonce=headers[HEADER_NONCE])
    assert verifier.check("POST", PATH, again, BODY, now=NOW + 10) == "replayed nonce"


def test_two_tries_of_one_call_signed_afresh_both_pass() -> None:
    verifier = _verifier()
    for moment in (NOW, NOW + 0.2):
        headers = sign("dev", SECRET, "POST", PATH, BODY, now=moment)
        assert verifier.check("POST", PATH, headers, BODY, now=moment) is None


def test_nonces_are_forgotten_after_their_ttl_once_the_timestamp_is_stale_anyway() -> None:
    verifier = _verifier(skew_s=300, nonce_ttl_s=600)
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    assert verifier.check("POST", PATH, headers, BODY, now=NOW) is None
    assert verifier.remembered() == 1
    later = sign("dev", SECRET, "POST", PATH, BODY, now=NOW + 601)
    assert verifier.check("POST", PATH, later, BODY, now=NOW + 601) is None
    assert verifier.remembered() == 1  # the first one was pruned
    # The first request replayed now fails on its timestamp, not on a forgotten nonce.
    assert verifier.check("POST", PATH, headers, BODY, now=NOW + 601) == "clock skew"


def test_the_nonce_ttl_never_drops_below_twice_the_skew() -> None:
    assert _verifier(skew_s=300, nonce_ttl_s=10).nonce_ttl_s == 600


def test_a_refused_request_does_not_burn_its_nonce() -> None:
    verifier = _verifier()
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    assert verifier.check("POST", PATH, headers, b"tampered", now=NOW) == "bad signature"
    assert verifier.check("POST", PATH, headers, BODY, now=NOW) is None


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", PATH, b'{"userId":"u2","trades":[]}'),  # body
        ("POST", "/v1/indicators?x=1", BODY),  # path
        ("POST", "/v1/bias?x=2", BODY),  # query
        ("PUT", PATH, BODY),  # method
    ],
)
def test_a_tampered_request_is_a_bad_signature(method: str, path: str, body: bytes) -> None:
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    assert _verifier().check(method, path, headers, body, now=NOW) == "bad signature"


def test_the_wrong_secret_is_a_bad_signature() -> None:
    headers = sign("dev", "another-secret", "POST", PATH, BODY, now=NOW)
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) == "bad signature"


def test_a_tampered_timestamp_is_a_bad_signature() -> None:
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    headers[HEADER_TIMESTAMP] = str(int(NOW) + 1)
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) == "bad signature"


def test_an_unknown_key_id_is_refused() -> None:
    headers = sign("other", SECRET, "POST", PATH, BODY, now=NOW)
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) == "unknown key id"


@pytest.mark.parametrize("missing", [HEADER_KEY_ID, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE])
def test_a_missing_header_is_named(missing: str) -> None:
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    del headers[missing]
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) == f"missing header {missing}"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("soon", "bad timestamp"),
        ("1.5e9", "bad timestamp"),
        ("\uff11\uff12\uff13", "bad timestamp"),  # full-width digits
        ("  ", "missing header X-Timestamp"),
    ],
)
def test_a_timestamp_that_is_not_unix_seconds_is_refused(value: str, reason: str) -> None:
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    headers[HEADER_TIMESTAMP] = value
    assert _verifier().check("POST", PATH, headers, BODY, now=NOW) == reason


def test_reasons_never_carry_the_secret_or_the_signature() -> None:
    verifier = _verifier()
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    reasons = [
        verifier.check("POST", PATH, headers, b"x", now=NOW),
        verifier.check("POST", PATH, headers, BODY, now=NOW + 999),
        verifier.check("POST", PATH, {**headers, HEADER_KEY_ID: "nope"}, BODY, now=NOW),
    ]
    for reason in reasons:
        assert reason is not None
        assert SECRET not in reason and headers[HEADER_SIGNATURE] not in reason
    assert SECRET not in repr(verifier)


def test_concurrent_replays_of_one_nonce_let_exactly_one_through() -> None:
    verifier = _verifier()
    headers = sign("dev", SECRET, "POST", PATH, BODY, now=NOW)
    results: list[str | None] = []
    barrier = threading.Barrier(16)

    def attempt() -> None:
        barrier.wait()
        results.append(verifier.check("POST", PATH, headers, BODY, now=NOW))

    threads = [threading.Thread(target=attempt) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(None) == 1
    assert results.count("replayed nonce") == 15
