"""Chunking and the offline embedder: properties, determinism and a small retrieval check."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.files.chunking import Chunk, chunk_text, tokenize
from tasks.files.embedding import (
    HashingEmbedder,
    SentenceTransformerEmbedder,
    cosine,
    load_embedder,
    pack,
    unpack,
)

ROOT = Path(__file__).resolve().parents[2]

DOCUMENTS = {
    "beekeeping": (
        "Beekeeping starts with a healthy colony housed in wooden hives. The queen lays eggs while "
        "worker bees forage for nectar and pollen among clover and lavender. In late summer the "
        "beekeeper lifts the frames, uncaps the honeycomb and spins the honey out in an extractor. "
        "Smoke calms the bees, and a veil protects the face from stings."
    ),
    "lighthouses": (
        "Lighthouses guided ships past dangerous reefs and rocky headlands for centuries. A keeper "
        "climbed the spiral staircase every evening to trim the wick and wind the clockwork that "
        "turned the Fresnel lens. Each tower flashes its own pattern so sailors can identify the "
        "coast at night, and a foghorn sounds when mist hides the beam."
    ),
    "sourdough": (
        "Sourdough bread rises without commercial yeast. The baker feeds a starter of flour and "
        "water until wild yeasts and lactobacilli make it bubble and smell tangy. The dough is "
        "folded, left to ferment slowly overnight, shaped into a loaf and baked in a hot Dutch "
        "oven until the crust is dark and crackling."
    ),
    "volcanoes": (
        "Volcanoes form where molten magma rises through cracks in the crust. Pressure from "
        "dissolved gases drives eruptions that throw ash into the stratosphere and send lava "
        "flowing down the slopes. Geologists monitor tremors, ground deformation and sulfur "
        "dioxide emissions to forecast an eruption of a restless crater."
    ),
    "gletscher": (
        "Gletscher entstehen dort, wo über viele Jahre mehr Schnee fällt als im Sommer schmilzt. "
        "Der Schnee verdichtet sich zu Firn und schließlich zu blauem Eis, das unter seinem eigenen "
        "Gewicht talwärts fließt. Spalten öffnen sich, Moränen aus Geröll markieren den Rand, und "
        "der Rückgang der Alpengletscher zeigt deutlich die Erwärmung des Klimas."
    ),
    "baroque": (
        "Baroque music flourished between 1600 and 1750 with composers such as Bach, Handel and "
        "Vivaldi. A basso continuo of harpsichord and cello supports ornamented melodies above it. "
        "Fugues weave several independent voices through strict counterpoint, and concertos set a "
        "soloist against a small string orchestra."
    ),
}

QUERIES = {
    "beekeeping": "queen worker bees honeycomb frames",
    "lighthouses": "keeper tower lens sailors foghorn",
    "sourdough": "starter flour dough ferment loaf",
    "volcanoes": "magma eruptions lava crater",
    "gletscher": "Schnee Firn Eis Moränen Gletscher",
    "baroque": "harpsichord fugues counterpoint concertos",
}


def _words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def _token_texts(text: str) -> list[str]:
    return [text[s:e] for s, e in tokenize(text)]


def _check_invariants(text: str, chunks: list[Chunk], max_tokens: int, overlap: int) -> None:
    spans = tokenize(text)
    if not spans:
        assert chunks == []
        return
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    assert chunks[0].start == spans[0][0] and chunks[-1].end == spans[-1][1]
    starts = {s: i for i, (s, _) in enumerate(spans)}
    ends = {e: i for i, (_, e) in enumerate(spans)}
    covered: set[int] = set()
    for chunk in chunks:
        assert chunk.text == text[chunk.start : chunk.end]
        assert 1 <= chunk.tokens <= max_tokens
        first, last = starts[chunk.start], ends[chunk.end]
        assert last - first + 1 == chunk.tokens
        covered.update(range(first, last + 1))
    assert covered == set(range(len(spans)))
    for prev, nxt in itertools.pairwise(chunks):
        prev_last, next_first = ends[prev.end], starts[nxt.start]
        assert prev_last - next_first + 1 == overlap
        assert ends[nxt.end] > prev_last


# --- chunking ---------------------------------------------------------------------------------


def test_tokenize_words_and_punctuation() -> None:
    assert _token_texts("Hello, world! It's 3.5km.") == [
        "Hello", ",", "world", "!", "It", "'", "s", "3", ".", "5km", ".",
    ]  # fmt: skip


def test_non_ascii_words_are_single_tokens() -> None:
    text = "Die Gletscher schmelzen; l'été à Zürich, naïve café, Ærø, Straße, 東京, हिन्दी."
    tokens = _token_texts(text)
    for word in ["Gletscher", "été", "Zürich", "naïve", "café", "Ærø", "Straße", "東京", "हिन्दी"]:
        assert word in tokens
    decomposed = unicodedata.normalize("NFD", "naïve café")
    assert _token_texts(decomposed) == decomposed.split()


def test_empty_and_whitespace_give_no_chunks() -> None:
    assert chunk_text("") == []
    assert chunk_text(" \n\t  \n") == []


def test_overlap_must_be_below_max_tokens() -> None:
    for overlap in (10, 11, -1):
        with pytest.raises(ValueError):
            chunk_text("a b c", max_tokens=10, overlap=overlap)
    with pytest.raises(ValueError):
        chunk_text("a b c", max_tokens=0, overlap=0)


def test_short_text_is_one_chunk() -> None:
    text = "  Just a short note.  "
    assert chunk_text(text) == [Chunk(ordinal=0, text="Just a short note.", start=2, end=20, tokens=5)]


def test_cover_overlap_and_bounds_without_boundaries() -> None:
    text = _words(1000)
    chunks = chunk_text(text, max_tokens=100, overlap=20)
    _check_invariants(text, chunks, 100, 20)
    # No boundary anywhere: every chunk but the last is cut at exactly max_tokens.
    assert all(c.tokens == 100 for c in chunks[:-1])
    assert _token_texts(chunks[1].text)[:20] == _token_texts(chunks[0].text)[-20:]


def test_deterministic() -> None:
    text = " ".join(DOCUMENTS.values()) * 5
    assert chunk_text(text, max_tokens=60, overlap=12) == chunk_text(text, max_tokens=60, overlap=12)


def test_prefers_sentence_end_in_last_fifth() -> None:
    sentence = _words(10) + "."  # 11 tokens
    text = " ".join([sentence] * 30)
    chunks = chunk_text(text, max_tokens=50, overlap=10)
    _check_invariants(text, chunks, 50, 10)
    for chunk in chunks[:-1]:
        assert chunk.text.endswith(".")
        assert 40 <= chunk.tokens <= 50


def test_sentence_end_outside_last_fifth_is_ignored() -> None:
    # The only sentence end is after token 11; the window is cut hard at 50.
    text = _words(10) + ". " + _words(200)
    chunks = chunk_text(text, max_tokens=50, overlap=0)
    assert chunks[0].tokens == 50


def test_paragraph_beats_later_sentence_end() -> None:
    para = _words(42) + "\n\n"  # paragraph break after token 42
    text = para + _words(3) + ". " + _words(200)  # sentence end after token 46
    chunks = chunk_text(text, max_tokens=50, overlap=5)
    assert chunks[0].tokens == 42 and chunks[0].text.endswith("w41")
    chunks_no_para = chunk_text(text.replace("\n\n", " "), max_tokens=50, overlap=5)
    assert chunks_no_para[0].tokens == 46 and chunks_no_para[0].text.endswith(".")


def test_sentence_end_after_closing_quote() -> None:
    text = _words(44) + ' "quoted end." ' + _words(100)
    chunks = chunk_text(text, max_tokens=50, overlap=5)
    assert chunks[0].text.endswith('end."')


def test_cut_leaves_room_for_progress_with_large_overlap() -> None:
    sentence = _words(3) + "."
    text = " ".join([sentence] * 100)
    chunks = chunk_text(text, max_tokens=10, overlap=9)
    _check_invariants(text, chunks, 10, 9)


_ALPHABET = st.sampled_from([*"abcxyzäöüßéèç東京", " ", " ", "\n", "\n\n", ".", ",", "!", "?", '"', "-"])


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(_ALPHABET, max_size=400).map("".join),
    max_tokens=st.integers(min_value=1, max_value=40),
    data=st.data(),
)
def test_invariants_hold_for_any_text(text: str, max_tokens: int, data: st.DataObject) -> None:
    overlap = data.draw(st.integers(min_value=0, max_value=max_tokens - 1))
    chunks = chunk_text(text, max_tokens=max_tokens, overlap=overlap)
    _check_invariants(text, chunks, max_tokens, overlap)
    assert chunks == chunk_text(text, max_tokens=max_tokens, overlap=overlap)


# --- embedding --------------------------------------------------------------------------------


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_hashing_embedder_shape_and_unit_norm() -> None:
    emb = HashingEmbedder()
    assert (emb.name, emb.dim) == ("hashing-v1", 384)
    vectors = emb.embed([*DOCUMENTS.values(), "to be or not to be", "x"])
    assert all(len(v) == 384 for v in vectors)
    assert all(abs(_norm(v) - 1.0) < 1e-9 for v in vectors)
    assert emb.embed([]) == []
    assert emb.embed(["", " ... "]) == [[0.0] * 384, [0.0] * 384]
    with pytest.raises(TypeError):
        emb.embed("a single string")


def test_hashing_embedder_deterministic_across_instances() -> None:
    texts = list(DOCUMENTS.values())
    assert HashingEmbedder().embed(texts) == HashingEmbedder().embed(texts)


def test_hashing_embedder_deterministic_across_processes() -> None:
    text = DOCUMENTS["gletscher"]
    code = (
        "import json, sys; from tasks.files.embedding import HashingEmbedder; "
        "print(json.dumps(HashingEmbedder().embed([sys.argv[1]])[0]))"
    )
    # A different hash seed proves no salted hash() is involved.
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    out = subprocess.run(
        [sys.executable, "-c", code, text],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == HashingEmbedder().embed([text])[0]


def test_case_and_accent_folding() -> None:
    emb = HashingEmbedder()
    pairs = [
        ("Gletscher", "gletscher"),
        ("GLETSCHER Eis", "gletscher eis"),
        ("été café", "ete cafe"),
        ("Zürich", "zurich"),
        ("Straße", "STRASSE"),
        (unicodedata.normalize("NFD", "crème brûlée"), "creme brulee"),
    ]
    for a, b in pairs:
        va, vb = emb.embed([a, b])
        assert va == pytest.approx(vb, abs=1e-12), (a, b)
    va, vb = emb.embed(["Gletscher", "Vulkan"])
    assert cosine(va, vb) < 0.5


def test_shared_stems_score_above_unrelated_words() -> None:
    emb = HashingEmbedder()
    erupt, eruptions, harpsichord = emb.embed(["erupting", "eruptions", "harpsichord"])
    assert cosine(erupt, eruptions) > cosine(erupt, harpsichord) + 0.2


@pytest.mark.parametrize("topic", sorted(DOCUMENTS))
def test_query_of_document_words_ranks_it_first(topic: str) -> None:
    emb = HashingEmbedder()
    names = sorted(DOCUMENTS)
    docs = dict(zip(names, emb.embed([DOCUMENTS[n] for n in names]), strict=True))
    query = emb.embed([QUERIES[topic]])[0]
    ranked = sorted(names, key=lambda n: cosine(query, docs[n]), reverse=True)
    assert ranked[0] == topic, [(n, round(cosine(query, docs[n]), 3)) for n in ranked]
    best, second = (cosine(query, docs[n]) for n in ranked[:2])
    assert best > second + 0.1


def test_cosine() -> None:
    assert cosine([1.0, 0.0], [1.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 2.0]) == pytest.approx(0.0)
    assert cosine([1.0, 2.0], [-1.0, -2.0]) == pytest.approx(-1.0)
    assert cosine([0.0, 0.0], [1.0, 1.0]) == 0.0
    with pytest.raises(ValueError):
        cosine([1.0], [1.0, 2.0])


def test_pack_unpack_round_trip() -> None:
    vector = HashingEmbedder().embed([DOCUMENTS["baroque"]])[0]
    blob = pack(vector)
    assert len(blob) == 4 * 384
    restored = unpack(blob)
    assert restored == pytest.approx(vector, abs=1e-7)
    assert pack(restored) == blob  # float32 values survive exactly
    assert pack([1.0, -2.5]) == b"\x00\x00\x80\x3f\x00\x00\x20\xc0"  # little-endian float32
    assert unpack(b"") == []
    with pytest.raises(ValueError):
        unpack(b"\x00\x00\x00")


def test_load_embedder() -> None:
    assert isinstance(load_embedder("hashing-v1"), HashingEmbedder)
    with pytest.raises(ValueError, match="unknown embedder"):
        load_embedder("word2vec")


def test_minilm_without_extra_says_what_to_install() -> None:
    if importlib.util.find_spec("sentence_transformers"):  # the tests install the model package only
        pytest.skip("the embeddings extra is installed")
    with pytest.raises(RuntimeError, match="install the 'embeddings' extra"):
        load_embedder("minilm")
    with pytest.raises(RuntimeError, match="install the 'embeddings' extra"):
        SentenceTransformerEmbedder()
