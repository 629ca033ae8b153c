"""The Graph connector against the Graph-like peer over real HTTP: every call, the Instagram
container lifecycle, error classification, the peer's overlap record and its held replies."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest

from conveyor.errors import PermanentError, TransientError
from pipelines.publisher.peers import GraphPeer, RequestRecord
from tasks.publisher.graph import (
    GraphClient,
    GraphRefused,
    GraphTransient,
    format_graph_time,
    parse_graph_time,
)

TOKEN = "EAAB-secret-token-1234567890"
PAGE = "1029384756"
IG = "17841400000000001"
IMAGE = "https://cdn.example.test/pic.jpg"


@pytest.fixture
def peer() -> Iterator[GraphPeer]:
    with GraphPeer(TOKEN) as graph_peer:
        yield graph_peer


@pytest.fixture
def client(peer: GraphPeer) -> GraphClient:
    return GraphClient(peer.url, TOKEN, timeout=5.0)


def _ago(seconds: float = 0.0) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)


def _published(client: GraphClient, caption: str, account: str = IG) -> str:
    container = client.create_container(account, caption, IMAGE)
    return client.media_publish(account, container)


# Happy paths


def test_post_feed_and_find_it(client: GraphClient, peer: GraphPeer) -> None:
    since = _ago()
    post_id = client.post_feed(PAGE, "Promoção de sábado", link="https://shop.example.test/p/1")
    assert post_id.isdigit()
    [post] = peer.posts(PAGE)
    assert post["message"] == "Promoção de sábado" and post["link"] == "https://shop.example.test/p/1"
    assert client.find_feed_post(PAGE, "Promoção de sábado", since) == post_id
    assert client.find_feed_post(PAGE, "Promoção de domingo", since) is None
    assert client.find_feed_post("other-page", "Promoção de sábado", since) is None


def test_find_feed_post_picks_the_newest_and_respects_since(client: GraphClient, peer: GraphPeer) -> None:
    first = client.post_feed(PAGE, "same text")
    second = client.post_feed(PAGE, "same text")
    assert first != second and len(peer.posts(PAGE)) == 2  # no idempotency of its own
    found = client.find_feed_post(PAGE, "same text", _ago(60))
    assert found in (first, second)
    if peer.posts(PAGE)[0]["created_time"] != peer.posts(PAGE)[1]["created_time"]:
        assert found == second
    # Older than since by more than the 5 s skew: not ours.
    assert client.find_feed_post(PAGE, "same text", _ago(-30)) is None
    # Within the skew: still ours (Graph's clock may run a little behind).
    assert client.find_feed_post(PAGE, "same text", _ago(-3)) is not None


def test_find_follows_paging_past_the_first_page(client: GraphClient, peer: GraphPeer) -> None:
    since = _ago()
    target = client.post_feed(PAGE, "the old one")
    for n in range(120):  # the client asks 100 a page; the target is on the second
        client.post_feed(PAGE, f"filler {n}")
    assert client.find_feed_post(PAGE, "the old one", since) == target
    listings = [r for r in peer.requests if r.method == "GET"]
    assert len(listings) == 2  # the first page, then paging.next


def test_instagram_publish_and_comments(client: GraphClient, peer: GraphPeer) -> None:
    since = _ago()
    container = client.create_container(IG, "Nova coleção #verão", IMAGE)
    assert client.container_status(container) == "FINISHED"
    media_id = client.media_publish(IG, container)
    assert client.container_status(container) == "PUBLISHED"
    assert [m["id"] for m in peer.media(IG)] == [media_id]
    assert client.find_media(IG, "Nova coleção #verão", since) == media_id
    assert client.find_media(IG, "Nova coleção", since) is None

    assert client.list_comments(media_id) == []
    comment_id = client.post_comment(media_id, "Link na bio!")
    assert client.list_comments(media_id) == [{"id": comment_id, "text": "Link na bio!"}]
    assert [c["text"] for c in peer.comments(media_id)] == ["Link na bio!"]


def test_version_prefix_in_base_url(peer: GraphPeer) -> None:
    client = GraphClient(peer.url + "/v19.0/", TOKEN)
    post_id = client.post_feed(PAGE, "versioned")
    assert peer.requests[-1].path == f"/v19.0/{PAGE}/feed"
    assert client.find_feed_post(PAGE, "versioned", _ago(5)) == post_id


# The container lifecycle


def test_container_in_progress_then_finished(client: GraphClient, peer: GraphPeer) -> None:
    peer.container_ready_s = 0.4
    container = client.create_container(IG, "slow image", IMAGE)
    assert client.container_status(container) == "IN_PROGRESS"
    with pytest.raises(GraphRefused) as refused:
        client.media_publish(IG, container)  # not ready: 9007
    assert refused.value.code == 9007 and refused.value.status == 400
    assert peer.media(IG) == []
    time.sleep(0.5)
    assert client.container_status(container) == "FINISHED"
    media_id = client.media_publish(IG, container)
    assert client.container_status(container) == "PUBLISHED"
    assert peer.containers[container]["status_code"] == "PUBLISHED"
    # Publishing it again is refused: one container, one media.
    with pytest.raises(GraphRefused) as again:
        client.media_publish(IG, container)
    assert again.value.code == 100
    assert [m["id"] for m in peer.media(IG)] == [media_id]


def test_container_expired_and_error(client: GraphClient, peer: GraphPeer) -> None:
    expired = client.create_container(IG, "late", IMAGE)
    broken = client.create_container(IG, "bad image", IMAGE)
    peer.expire(expired)
    peer.error(broken)
    assert client.container_status(expired) == "EXPIRED"
    assert client.container_status(broken) == "ERROR"
    for container in (expired, broken):
        with pytest.raises(GraphRefused):
            client.media_publish(IG, container)
    assert peer.media() == []


def test_unknown_objects_are_refused(client: GraphClient) -> None:
    with pytest.raises(GraphRefused):
        client.container_status("999")
    with pytest.raises(GraphRefused):
        client.media_publish(IG, "999")
    with pytest.raises(GraphRefused):
        client.post_comment("999", "hello")


# Classification


def test_429_with_retry_after(client: GraphClient, peer: GraphPeer) -> None:
    peer.fail_next(status=429, retry_after=7)
    with pytest.raises(GraphTransient) as caught:
        client.post_feed(PAGE, "throttled")
    assert caught.value.status == 429 and caught.value.retry_after == 7
    assert isinstance(caught.value, TransientError)
    assert f"POST /{PAGE}/feed" in str(caught.value) and "429" in str(caught.value)
    assert peer.posts() == []
    assert client.post_feed(PAGE, "throttled")  # the fault was for one request only


@pytest.mark.parametrize("code", [4, 17, 32, 613])
def test_throttling_codes_are_transient(client: GraphClient, peer: GraphPeer, code: int) -> None:
    peer.fail_next(status=400, code=code)
    with pytest.raises(GraphTransient) as caught:
        client.create_container(IG, "caption", IMAGE)
    assert caught.value.code == code and caught.value.retry_after is None
    assert str(code) in str(caught.value)


def test_is_transient_flag_is_transient(client: GraphClient, peer: GraphPeer) -> None:
    peer.fail_next(status=400, code=2207001, is_transient=True)
    with pytest.raises(GraphTransient):
        client.container_status(client.create_container(IG, "x", IMAGE))


def test_code_100_is_refused_without_the_caption(client: GraphClient, peer: GraphPeer) -> None:
    peer.fail_next(status=400, code=100)
    with pytest.raises(GraphRefused) as caught:
        client.create_container(IG, "Caption that must stay private", IMAGE)
    assert isinstance(caught.value, PermanentError)
    assert caught.value.code == 100 and caught.value.status == 400
    assert "private" not in str(caught.value)
    assert "\n" not in str(caught.value)


def test_500_is_transient(client: GraphClient, peer: GraphPeer) -> None:
    peer.fail_next(2, status=500, path_contains="/comments")
    media_id = _published(client, "m")  # unaffected: the fault matches comments only
    for _ in range(2):
        with pytest.raises(GraphTransient) as caught:
            client.post_comment(media_id, "secret comment text")
        assert caught.value.status == 500 and "secret comment" not in str(caught.value)
    assert client.post_comment(media_id, "third time")
    assert [c["text"] for c in peer.comments(media_id)] == ["third time"]


def test_peer_stopped_is_transient(peer: GraphPeer) -> None:
    client = GraphClient(peer.url, TOKEN, timeout=2.0)
    peer.down()
    with pytest.raises(GraphTransient) as caught:
        client.post_feed(PAGE, "nobody listening")
    assert caught.value.status is None and "ConnectionRefusedError" in str(caught.value)
    peer.up()
    assert client.post_feed(PAGE, "back again")


def test_timeout_is_transient(peer: GraphPeer) -> None:
    peer.latency_s = 1.0
    client = GraphClient(peer.url, TOKEN, timeout=0.3)
    with pytest.raises(GraphTransient) as caught:
        client.list_comments("1")
    assert "may have been accepted" in str(caught.value)


def test_wrong_token_is_refused_and_never_quoted(peer: GraphPeer) -> None:
    for token in ("wrong-token-abcdef", ""):
        client = GraphClient(peer.url, token)
        with pytest.raises(GraphRefused) as caught:
            client.post_feed(PAGE, "hello")
        assert caught.value.code == 190 and caught.value.status == 400
        if token:
            assert token not in str(caught.value) and token not in repr(client)
    assert TOKEN not in repr(GraphClient(peer.url, TOKEN))
    assert peer.posts() == []


def test_malformed_reply_is_transient() -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotJson(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "9")
            self.end_headers()
            self.wfile.write(b"<html/>\r\n")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotJson)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = GraphClient(f"http://127.0.0.1:{server.server_address[1]}", TOKEN)
        with pytest.raises(GraphTransient):
            client.post_feed(PAGE, "x")
    finally:
        server.shutdown()
        server.server_close()


def test_graph_times() -> None:
    expected = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_graph_time("2025-01-02T03:04:05+0000") == expected
    assert parse_graph_time("2025-01-02T03:04:05+00:00") == expected
    assert parse_graph_time("2025-01-02T00:04:05-0300") == expected
    assert format_graph_time(expected) == "2025-01-02T03:04:05+0000"


# The peer's observability


def test_max_overlap_from_concurrent_calls(peer: GraphPeer) -> None:
    peer.latency_s = 0.3
    client = GraphClient(peer.url, TOKEN)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.post_feed, PAGE, f"fb {n}") for n in range(3)]
        futures.append(pool.submit(client.create_container, IG, "ig", IMAGE))
        for future in futures:
            future.result()
    client.post_feed(PAGE, "alone")  # after the others: never overlaps them

    def facebook(record: RequestRecord) -> bool:
        return record.channel == "facebook"

    assert peer.max_overlap(facebook) == 3
    assert peer.max_overlap(lambda r: r.channel == "instagram") == 1
    assert peer.max_overlap() == 4
    assert peer.max_overlap(lambda r: r.target == IG) == 1
    assert all(r.ended is not None and r.status == 200 for r in peer.requests)
    assert {r.target for r in peer.requests} == {PAGE, IG}


def test_max_overlap_of_sequential_calls_is_one(client: GraphClient, peer: GraphPeer) -> None:
    for n in range(3):
        client.post_feed(PAGE, f"seq {n}")
    assert peer.max_overlap(lambda r: r.channel == "facebook") == 1


def test_hold_after_accept_creates_before_replying(client: GraphClient, peer: GraphPeer) -> None:
    peer.hold_after_accept_s = 1.0
    result: dict[str, str] = {}
    thread = threading.Thread(target=lambda: result.update(id=client.post_feed(PAGE, "held")))
    thread.start()
    assert peer.wait_accepted(1, timeout=5)
    assert peer.accepted.is_set()
    # The post exists while the reply is still held back.
    assert [p["message"] for p in peer.posts(PAGE)] == ["held"]
    assert "id" not in result
    thread.join(5)
    assert result["id"] == peer.posts(PAGE)[0]["id"]


def test_held_reply_then_timeout_leaves_the_object(peer: GraphPeer) -> None:
    peer.hold_after_accept_s = 1.0
    client = GraphClient(peer.url, TOKEN, timeout=0.3)
    since = _ago()
    with pytest.raises(GraphTransient):
        client.post_feed(PAGE, "ambiguous")
    assert len(peer.posts(PAGE)) == 1
    peer.hold_after_accept_s = 0.0
    # The reconciliation a caller does before posting again.
    assert client.find_feed_post(PAGE, "ambiguous", since) == peer.posts(PAGE)[0]["id"]
