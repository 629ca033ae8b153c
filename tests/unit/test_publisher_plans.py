"""The publisher family's pure logic: the seed's key, captions from templates, comment
hashes, refusals naming their field, and its settings."""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest
from pydantic import ValidationError

from tasks.publisher.plans import (
    PlanInvalid,
    comment_hash,
    idempotency_key,
    media_hash,
    normalize,
    normalize_comment,
    render,
)
from tasks.publisher.settings import PublisherSettings

AT = dt.datetime(2026, 3, 29, 7, 0, tzinfo=dt.UTC)


def _plan(**changes: object) -> dict[str, object]:
    values: dict[str, object] = {
        "brand": "acme",
        "channel": "facebook",
        "account": "page-1",
        "caption": "Hello",
        "scheduled_at": AT,
    }
    values.update(changes)
    return values


def test_the_key_is_the_seeds_sha256_of_the_plan_in_utc_with_the_account() -> None:
    caption_hash = hashlib.sha256(b"Hello").hexdigest()
    parts = ("acme", "facebook", "page-1", "2026-03-29T07:00:00Z", media_hash(()), caption_hash)
    expected = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    assert idempotency_key("acme", "facebook", "page-1", AT, (), "Hello") == expected
    # The same copy on another page at the same time is another post.
    assert idempotency_key("acme", "facebook", "page-2", AT, (), "Hello") != expected
    rome = normalize(**_plan(scheduled_at="2026-03-29T09:00:00+02:00"))  # type: ignore[arg-type]
    assert rome.idempotency_key == expected and rome.derived_key
    other = normalize(**_plan(caption="Hello!"))  # type: ignore[arg-type]
    assert other.idempotency_key != expected
    mine = normalize(**_plan(idempotency_key_given="mine"))  # type: ignore[arg-type]
    assert mine.idempotency_key == "mine" and not mine.derived_key


def test_a_caption_template_is_rendered_before_it_is_hashed() -> None:
    assert render("Hi {name}, {{literally}}", {"name": "Ana"}) == "Hi Ana, {literally}"
    a = normalize(**_plan(caption="Hi {name}", placeholders={"name": "Ana"}))  # type: ignore[arg-type]
    b = normalize(**_plan(caption="Hi Ana"))  # type: ignore[arg-type]
    assert a.caption == "Hi Ana" and a.idempotency_key == b.idempotency_key
    with pytest.raises(PlanInvalid, match=r"^placeholders: .*\{name\}"):
        render("Hi {name}", {})
    with pytest.raises(PlanInvalid, match=r"^caption: .*formats"):
        render("Hi {name!r}", {"name": "x"})
    with pytest.raises(PlanInvalid, match=r"^caption: unbalanced"):
        render("Hi {name", {})


def test_a_first_comment_keeps_its_line_breaks_and_compares_normalised() -> None:
    plan = normalize(  # type: ignore[arg-type]
        **_plan(channel="instagram", media=("https://x/a.jpg",), first_comment="  Line one\n\n#a\n#b ")
    )
    assert plan.first_comment == "Line one\n\n#a\n#b"
    assert comment_hash("m", plan.first_comment) == comment_hash("m", "Line one #a #b")


def test_comments_compare_normalised() -> None:
    assert normalize_comment("  Caf\u0065\u0301   au\tlait ") == "Caf\u00e9 au lait"
    assert comment_hash("m1", "Café  au lait") == comment_hash("m1", " Cafe\u0301 au lait")
    assert comment_hash("m1", "x") != comment_hash("m2", "x")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"channel": "tiktok"}, "channel"),
        ({"brand": ""}, "brand"),
        ({"account": "a b"}, "account"),
        ({"caption": ""}, "caption"),
        ({"caption": "x" * 2201}, "caption"),
        ({"channel": "instagram"}, "media"),
        ({"media": ("ftp://x",)}, "media[0]"),
        ({"scheduled_at": "2026-03-29T09:00:00"}, "scheduled_at"),
        ({"scheduled_at": dt.datetime(2026, 3, 29, 9)}, "scheduled_at"),
        ({"scheduled_at": "soon"}, "scheduled_at"),
        ({"caption": "nul\x00here"}, "caption"),
        ({"scheduled_at": "0001-01-01T00:30:00+01:00"}, "scheduled_at"),
        ({"scheduled_at": "9999-12-31T23:30:00+00:00"}, "scheduled_at"),
        ({"first_comment": "hi"}, "first_comment"),
        ({"channel": "instagram", "media": ("https://x/a.jpg",), "first_comment": "   "}, "first_comment"),
    ],
)
def test_bad_plans_name_their_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(PlanInvalid) as refused:
        normalize(**_plan(**changes))  # type: ignore[arg-type]
    assert refused.value.field == field and str(refused.value).startswith(f"{field}: ")


def test_settings_pick_windows_by_brand_and_channel_and_tokens_by_account() -> None:
    settings = PublisherSettings.model_validate(
        {
            "tokens": {"*": "default", "page-1": "own"},
            "blackout_windows": [
                {"name": "all", "start": "22:00", "end": "06:00", "timezone": "Europe/Rome"},
                {
                    "name": "ig",
                    "start": "12:00",
                    "end": "13:00",
                    "timezone": "UTC",
                    "channels": ["instagram"],
                },
                {"name": "acme", "start": "09:00", "end": "10:00", "timezone": "UTC", "brands": ["acme"]},
            ],
            "channel_concurrency": {"instagram": 3},
        }
    )
    assert [w.name for w in settings.windows_for("acme", "facebook")] == ["all", "acme"]
    assert [w.name for w in settings.windows_for("other", "instagram")] == ["all", "ig"]
    assert settings.token_for("page-1") == "own" and settings.token_for("page-2") == "default"
    assert settings.channel_concurrency == {"facebook": 2, "instagram": 3}
    assert PublisherSettings().token_for("x") is None


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (
            {"blackout_windows": [{"name": "x", "start": "1:00", "end": "2:00", "timezone": "Mars/Base"}]},
            "timezone",
        ),
        (
            {
                "blackout_windows": [
                    {"name": "x", "start": "01:00", "end": "02:00", "timezone": "UTC", "days": ["Mon"]}
                ]
            },
            "days[0]",
        ),
        (
            {
                "blackout_windows": [
                    {"name": "x", "start": "01:00", "end": "02:00", "timezone": "UTC", "channels": ["x"]}
                ]
            },
            "channels",
        ),
        ({"channel_concurrency": {"facebook": 0}}, "channel_concurrency.facebook"),
        ({"graph_url": "graph.facebook.com"}, "graph_url"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(data: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=named.replace("[", r"\[").replace("]", r"\]")):
        PublisherSettings.model_validate(data)
