"""The ranking parts without a database: reciprocal rank fusion, chunks cut to a model's
token budget, and the default model running with the network blocked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.files.chunking import chunk_text, fit_chunks, iter_tokens
from tasks.files.embedding import (
    SentenceTransformerEmbedder,
    TokenBudget,
    WordLlamaEmbedder,
    is_semantic,
    load_embedder,
    minilm_tokenizer,
)
from tasks.files.search import Lexical, Ranked, Vector, blend, words

ROOT = Path(__file__).resolve().parents[2]
# The model package pulls torch; its tokenizer file is all these tests need.
TOKENIZER = minilm_tokenizer(ROOT / "tests" / "data" / "minilm" / "tokenizer.json")


def wordpieces(texts: list[str] | tuple[str, ...]) -> list[int]:
    return [len(e.ids) for e in TOKENIZER.encode_batch(list(texts))]


def test_blend_weighs_lexical_by_coverage_and_drops_what_neither_ranks() -> None:
    lexical = Lexical([Ranked(1, "a", 8.0), Ranked(2, "b", 4.0)], {"glacier": 2.0})
    vector = Vector([Ranked(3, "c", 1.5), Ranked(20, "b", 1.1), Ranked(4, "d", 0.2)], median=0.5)
    assert [r.file_id for r in blend(lexical, vector, 1.0)] == ["a", "b"]  # all words in one file
    assert [r.file_id for r in blend(lexical, vector, 0.0)] == ["c", "b"]  # below the median drops
    mixed = blend(lexical, vector, 0.5)
    assert [(r.file_id, r.chunk_id) for r in mixed] == [
        ("b", 2),
        ("a", 1),
        ("c", 3),
    ]  # b shows its lexical chunk
    confidence = 0.5 + 0.5 * min(1.0, 1.5 / 2)
    assert mixed[0].score == pytest.approx((0.5 * 4 / 8 + 0.5 * (1.1 - 0.5) / (1.5 - 0.5)) * confidence)
    assert blend(Lexical([]), Vector([]), 0.3) == []


def test_a_query_only_the_vectors_answer_weakly_scores_low() -> None:
    weak = blend(Lexical([]), Vector([Ranked(1, "a", 0.3), Ranked(2, "b", 0.1)], median=0.05), 0.0)
    assert [r.file_id for r in weak] == ["a", "b"] and weak[0].score == pytest.approx(0.15)
    strong = blend(Lexical([Ranked(1, "a", 3.0)]), Vector([], median=0.0), 1.0)
    assert strong[0].score == 1.0


def test_words_are_plain_case_and_accent_folded() -> None:
    assert words("os.path.JOIN(Straße) /dev/urandom naïve_x") == [
        "os",
        "path",
        "join",
        "strasse",
        "dev",
        "urandom",
        "naive_x",
    ]


def test_the_default_embedder_is_the_packaged_model() -> None:
    from config.settings import FilesSettings

    embedder = load_embedder(FilesSettings().embedder)
    assert isinstance(embedder, WordLlamaEmbedder) and is_semantic(embedder)
    assert load_embedder("wordllama-256") is embedder  # loaded once per process
    assert not is_semantic(load_embedder("hashing-v1"))


def test_the_model_runs_with_the_network_blocked() -> None:
    """A fresh process in a network namespace of its own (no interface but a down
    loopback): loading and embedding must not try to download anything."""
    script = (
        "import socket, sys\n"
        "from tasks.files.embedding import load_embedder\n"
        "e = load_embedder('wordllama-256')\n"
        "v = e.embed(['how do I pause a function and resume it later', ''])\n"
        "assert len(v[0]) == 256 and abs(sum(x * x for x in v[0]) - 1) < 1e-6 and not any(v[1])\n"
        "try:\n"
        "    socket.create_connection(('huggingface.co', 443), timeout=3)\n"
        "    sys.exit('the network was reachable')\n"
        "except OSError:\n"
        "    print('offline-ok')\n"
    )
    if shutil.which("unshare") and subprocess.run(["unshare", "-rn", "true"]).returncode == 0:
        command = ["unshare", "-rn", sys.executable, "-c", script]
    else:  # no user namespaces here: refuse every connection inside the process instead
        guard = (
            "import socket\n"
            "def refuse(*a, **k):\n    raise OSError('blocked')\n"
            "socket.socket.connect = refuse\n"
        )
        command = [sys.executable, "-c", guard + script]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "offline-ok" in out.stdout, out.stderr[-2000:]


def test_minilm_declares_its_wordpiece_budget() -> None:
    # What the chunk stage checks (an instance needs sentence-transformers installed).
    assert isinstance(object.__new__(SentenceTransformerEmbedder), TokenBudget)
    assert SentenceTransformerEmbedder.max_tokens == 256
    assert not isinstance(load_embedder("wordllama-256"), TokenBudget)


def test_chunks_over_the_budget_are_cut_and_the_rest_left_alone() -> None:
    text = (
        "Plain English words make few wordpieces each. " * 60
        + "\n\n"
        + "Ωμέγα-∑∫≈ Zürich-Ångström ꙮꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 80  # noqa: RUF001
        + " "
        + "x" * 4000
    )
    pieces = chunk_text(text, max_tokens=200, overlap=40)
    assert max(wordpieces([p.text for p in pieces])) > 256
    fitted = fit_chunks(pieces, wordpieces, 256)
    assert max(wordpieces([p.text for p in fitted])) <= 256
    assert [p.ordinal for p in fitted] == list(range(len(fitted)))
    assert all(text[p.start : p.end] == p.text for p in fitted)
    ok = [p for p in pieces if wordpieces([p.text])[0] <= 256]
    assert {(p.start, p.end) for p in ok} <= {(p.start, p.end) for p in fitted}


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(["word", "naïve", "∑", "x" * 300, "\n\n", ".", "Ωμέγα"]),
            st.text(max_size=30),
        ),
        max_size=400,
    ),
    st.integers(min_value=8, max_value=300),
)
def test_fitted_chunks_fit_and_cover_every_token(parts: list[str], limit: int) -> None:
    text = " ".join(parts)
    fitted = fit_chunks(chunk_text(text, max_tokens=120, overlap=20), wordpieces, limit)
    assert all(n <= limit for n in wordpieces([p.text for p in fitted]))
    covered = [(p.start, p.end) for p in fitted]
    for start, end in iter_tokens(text):
        assert any(s <= start and end <= e for s, e in covered) or all(
            any(s <= i < e for s, e in covered) for i in range(start, end)
        )
