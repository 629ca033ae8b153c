"""Search as a user meets it, on both databases: BM25 that is really BM25, ORed words,
scoped to the owner and to ready files inside the index query, hostile query text, clear
errors, and the model check that only vector rankings need."""

from __future__ import annotations

import math
import subprocess
import sys
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text, update

from conveyor.delivery.procs import service_env
from conveyor.errors import PayloadInvalid
from pipelines.files import new_batch, reembed, search
from tasks.files import flow
from tasks.files.chunking import Chunk
from tasks.files.embedding import HashingEmbedder, load_embedder, pack
from tasks.files.errors import EmbeddingModelMismatch
from tasks.files.models import FAILED, READY, chunks, files
from tests.helpers import scratch_database
from tests.integration.files_support import embedded_chunks

pytestmark = pytest.mark.timeout(120)

MODEL = load_embedder("wordllama-256")


def put(
    platform: Any, owner: str, name: str, *texts: str, status: str = READY, model: str | None = None
) -> str:
    """A file of ``owner`` with one chunk per text, embedded (under ``model``'s name)
    unless ``model`` is "", written as the chunk and embed stages leave it."""
    file_id = str(uuid.uuid4())
    now = datetime.now(UTC)
    with platform.engine.begin() as conn:
        conn.execute(
            insert(files).values(
                id=file_id, owner=owner, name=name, size=1, content_ref="-", checksum="-",
                status=status, created_at=now, updated_at=now,
            )
        )  # fmt: skip
        flow.replace_chunks(conn, file_id, owner, chunk_pieces(texts))
        if model != "":
            ids = [chunk_id for chunk_id, _ in flow.chunk_texts(conn, file_id)]
            vectors = [pack(v) for v in MODEL.embed(list(texts))]
            flow.write_vectors(
                conn, file_id, owner, model or MODEL.name, list(zip(ids, vectors, strict=True))
            )
    return file_id


def chunk_pieces(texts: tuple[str, ...]) -> list[Chunk]:
    return [Chunk(i, t, 0, len(t), 1) for i, t in enumerate(texts)]


def names(hits: list[Any]) -> list[str]:
    return [h.name for h in hits]


def test_any_query_word_matches_and_both_words_rank_first(db: Any, tag: str) -> None:
    put(db, tag, "alpha.txt", "the alpha particle left the nucleus")
    put(db, tag, "beta.txt", "a beta decay turned a neutron into a proton")
    put(db, tag, "both.txt", "alpha and beta decay are two kinds of radioactivity")
    put(db, tag, "neither.txt", "sourdough needs a lively starter")
    hits = search(db, "alpha beta", owner=tag, ranking="lexical")
    assert names(hits)[0] == "both.txt" and set(names(hits)) == {"alpha.txt", "beta.txt", "both.txt"}
    assert all(h.score > 0 for h in hits)


def test_only_the_owners_ready_files_are_found_and_the_index_scopes_by_owner(db: Any, tag: str) -> None:
    put(db, tag, "mine.txt", "the xylophone recital was a triumph")
    put(db, tag, "failed.txt", "xylophone xylophone xylophone", status=FAILED)
    # Owners whose tokens overlap the user's (SQLite turns the owner into one token).
    for other in (tag + "x", tag[:-1], f"{tag} other", tag.upper(), "ü" + tag):
        put(db, other, "theirs.txt", "xylophone xylophone xylophone")
    for ranking in ("lexical", "vector", "fused"):
        assert names(search(db, "xylophone", owner=tag, ranking=ranking)) == ["mine.txt"], ranking
    assert names(search(db, "xylophone", owner="ü" + tag, ranking="lexical")) == ["theirs.txt"]


def test_hostile_query_text_is_just_words(db: Any, tag: str) -> None:
    put(db, tag, "notes.txt", "near the column of the okey text, quoted phrases live")
    hostile = [
        'NEAR(near column) "unterminated', "okey : o00 OR text : *", "near* AND NOT -column",
        "!column & (text | okey) <-> near:*", "'; DROP TABLE file_chunks; --", "\\ ' \" \x00 ^",
        "text:near OR okey:o" + "41" * 50, "near \udcff column",
    ]  # fmt: skip
    for query in hostile:
        for ranking in ("lexical", "fused"):
            hits = search(db, query, owner=tag, ranking=ranking)
            assert names(hits) in ([], ["notes.txt"]), (query, ranking)


def test_empty_query_bad_limit_and_unknown_ranking_are_clear_errors(db: Any, tag: str) -> None:
    with pytest.raises(ValueError, match="the query is empty"):
        search(db, "  \n", owner=tag)
    with pytest.raises(ValueError, match="limit must be at least 1, got -1"):
        search(db, "x", owner=tag, limit=-1)
    with pytest.raises(ValueError, match="unknown ranking 'bm25'"):
        search(db, "x", owner=tag, ranking="bm25")  # type: ignore[arg-type]


def test_one_hit_per_file_and_the_limit_counts_files(db: Any, tag: str) -> None:
    put(db, tag, "long.txt", *[f"glacier moraine number {i}" for i in range(130)])
    for i in range(6):
        put(db, tag, f"short-{i}.txt", f"a glacier {i}")
    for ranking in ("lexical", "vector", "fused"):
        hits = search(db, "glacier moraine", owner=tag, limit=4, ranking=ranking)
        assert len(hits) == 4 and len(set(names(hits))) == 4, ranking
        assert names(hits)[0] == "long.txt", ranking
    assert len(search(db, "glacier", owner=tag, limit=50, ranking="vector")) == 7


def test_a_query_with_no_word_finds_nothing_and_an_unrelated_one_scores_low(db: Any, tag: str) -> None:
    put(db, tag, "bees.txt", "the queen bee lays eggs in the brood frames of the hive")
    put(db, tag, "licence.txt", "permission is granted to copy, modify and distribute this software")
    for query in ("(", "🎉", "' -- ?!"):
        for ranking in ("lexical", "vector", "fused"):
            assert search(db, query, owner=tag, ranking=ranking) == [], (query, ranking)
    matched = search(db, "queen bee brood", owner=tag)
    assert names(matched)[0] == "bees.txt" and matched[0].score == pytest.approx(1.0)
    unrelated = search(db, "volcanic eruption lava", owner=tag)
    assert all(h.score < 0.5 for h in unrelated), [(h.name, h.score) for h in unrelated]


def test_wrong_types_are_refused_clearly(db: Any, tag: str) -> None:
    with pytest.raises(TypeError, match="the query must be a str, not NoneType"):
        search(db, None, owner=tag)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="limit must be an int, not float"):
        search(db, "x", owner=tag, limit=1.5)  # type: ignore[arg-type]


def test_vectors_of_another_model_fail_vector_rankings_and_not_lexical(db: Any, tag: str) -> None:
    put(db, tag, "old.txt", "lighthouse keeper", model="hashing-v1")
    put(db, tag, "unembedded.txt", "lighthouse lens", model="")  # embed stage not run: ignored
    with pytest.raises(EmbeddingModelMismatch, match=r"'hashing-v1'.*'wordllama-256'.*reembed --user"):
        search(db, "lighthouse", owner=tag)
    odd = tag + " o'brien"
    put(db, odd, "old.txt", "lighthouse keeper", model="hashing-v1")
    with pytest.raises(EmbeddingModelMismatch) as caught:
        search(db, "lighthouse", owner=odd)
    assert str(caught.value).endswith(f"reembed --user '{tag} o'\"'\"'brien'`")  # pastable
    assert set(names(search(db, "lighthouse", owner=tag, ranking="lexical"))) == {"old.txt", "unembedded.txt"}


def test_bm25_on_postgres_is_the_formula_over_the_owners_chunks(platform: Any, tag: str) -> None:
    """Scores equal a reference BM25 (k1 1.2, b 0.75, idf ln(1 + (N - df + .5)/(df + .5)))
    over the owner's chunks only, from the words Postgres indexed (plain: a dotted name is
    its words)."""
    corpus = [
        "Glaciers carve valleys; a glacier's moraine marks where the ice stopped.",
        "The valley glacier retreated, leaving moraine after moraine after moraine.",
        "Sea ice is not a glacier, though both are ice.",
        "Orchids grow aerial roots with velamen.",
        "Ice cores from a glacier record old air in bubbles of ice and more ice.",
        "See glacier.ice.moraine and https://example.org/ice/glacier for data.",
    ]
    for i, chunk in enumerate(corpus):  # a file each: a ranking lists a file by its best chunk
        put(platform, tag, f"{i}.txt", chunk)
    put(platform, tag + "-other", "other.txt", *["glacier glacier moraine"] * 20)  # not in the stats
    query = "glacier moraine ice"
    with platform.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT split_part(f.name, '.', 1)::int AS i, u.lexeme, array_length(u.positions, 1) AS tf"
                " FROM file_chunks c JOIN files f ON f.id = c.file_id, unnest(c.tsv) u WHERE c.owner = :o"
            ),
            {"o": tag},
        ).all()
        wanted = conn.execute(
            text("SELECT tsvector_to_array(file_chunk_words(:q))"),
            {"q": query},
        ).scalar_one()
    tf: dict[int, Counter[str]] = {i: Counter() for i in range(len(corpus))}
    for r in rows:
        tf[r.i][r.lexeme] = r.tf
    n, avgdl = len(corpus), sum(sum(c.values()) for c in tf.values()) / len(corpus)
    df = {t: sum(1 for c in tf.values() if c[t]) for t in wanted}
    expected = {
        i: sum(
            math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
            * c[t] * 2.2 / (c[t] + 1.2 * (0.25 + 0.75 * sum(c.values()) / avgdl))
            for t in wanted if c[t]
        )
        for i, c in tf.items()
    }  # fmt: skip
    from tasks.files.search import lexical

    with platform.engine.connect() as conn:
        got = lexical(conn, tag, query).ranked
        ordinals = dict(
            conn.execute(
                text(
                    "SELECT c.id, split_part(f.name, '.', 1)::int FROM file_chunks c"
                    " JOIN files f ON f.id = c.file_id WHERE c.owner = :o"
                ),
                {"o": tag},
            ).all()
        )
    assert [ordinals[r.chunk_id] for r in got] == sorted(
        (i for i in expected if expected[i] > 0), key=lambda i: -expected[i]
    )
    for r in got:
        assert r.score == pytest.approx(expected[ordinals[r.chunk_id]], rel=1e-9)


class TinyBudget:
    """An embedder that reads at most 12 tokens (words + 2), to show chunks cut for it."""

    name = "tiny-budget"
    dim = 384
    max_tokens = 12

    def count_tokens(self, texts: Any) -> list[int]:
        return [len(t.split()) + 2 for t in texts]

    def embed(self, texts: Any) -> list[list[float]]:
        return HashingEmbedder().embed(texts)


def test_reembed_for_a_model_with_a_token_budget_cuts_the_chunks_again(
    db: Any, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SQLite the new chunks are staged and swapped in (flow.stage_chunks): the old
    ones leave search and the table."""
    platform = db
    long = " ".join(f"word{i}" for i in range(40)) + " lighthouse"
    file_id = put(platform, tag, "long.txt", long)
    with platform.engine.begin() as conn:
        conn.execute(update(files).where(files.c.id == file_id).values(text=long))
    monkeypatch.setattr(platform.settings.files, "embedder", f"{__name__}:TinyBudget")
    assert reembed(platform, tag) > 1
    with platform.engine.connect() as conn:
        pieces = flow.chunk_texts(conn, file_id)
    assert len(pieces) > 1 and all(len(t.split()) + 2 <= 12 for _, t in pieces)
    assert embedded_chunks(platform, [file_id]) == len(pieces)
    hits = search(platform, "lighthouse", owner=tag, ranking="vector")
    assert [h.name for h in hits] == ["long.txt"] and "lighthouse" in hits[0].text
    with platform.engine.connect() as conn:
        owned = conn.execute(select(func.count()).where(chunks.c.owner == tag)).scalar_one()
    assert owned == len(pieces)  # neither the old chunks nor staged ones are left


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "conveyor", "files", "search", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_cli_search_mistakes_get_one_line_and_exit_2(platform: Any, tag: str) -> None:
    env = service_env(platform.settings)
    unknown = _cli({**env, "CONVEYOR_FILES": '{"embedder": "no-such-model"}'}, "yaml", "--user", tag)
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr, unknown.stderr[-2000:]
    assert "unknown embedder 'no-such-model'" in unknown.stderr
    with scratch_database("conveyor_empty") as url:
        empty = _cli({**env, "CONVEYOR_DATABASE_URL": url}, "yaml", "--user", tag)
    assert empty.returncode == 2 and "Traceback" not in empty.stderr, empty.stderr[-2000:]
    assert "run `conveyor db upgrade`" in empty.stderr


def test_an_owner_both_databases_can_store_or_a_clear_refusal(db: Any) -> None:
    for owner in ("x" * 201, "", "   "):
        with pytest.raises(PayloadInvalid, match="an owner is 1 to 200 characters"):
            new_batch(db, owner)
        with pytest.raises(PayloadInvalid):
            search(db, "lighthouse", owner=owner)
    assert search(db, "lighthouse", owner="x" * 200) == []


def test_accents_and_case_fold_alike_on_both_databases(db: Any, tag: str) -> None:
    put(db, tag, "cafe.txt", "Le Café de Flore sert une crème brûlée")
    put(db, tag, "strasse.txt", "Die STRASSE führt nach Zürich")
    for query, found in (
        ("cafe creme brulee", "cafe.txt"),
        ("CAFÉ", "cafe.txt"),
        ("zurich fuhrt", "strasse.txt"),
    ):
        assert names(search(db, query, owner=tag, ranking="lexical"))[:1] == [found], query
