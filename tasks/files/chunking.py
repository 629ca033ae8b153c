"""Token-aware, overlapping, deterministic chunking of extracted text.

A token is a run of word characters (``\\w``, so non-ASCII letters and digits count, together
with any combining marks inside the word) or a single other non-space character. Chunks are
windows of at most ``max_tokens`` tokens; consecutive windows share exactly ``overlap`` tokens.
A window that does not reach the end of the text ends, where it can, at a natural boundary in
its last fifth (see :func:`chunk_text`). Offsets are character offsets into the input string.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Chunk", "chunk_text", "fit_chunks", "is_word", "iter_tokens", "tokenize"]

_RAW_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD_CHAR = re.compile(r"\w")

# Sentence terminators; the CJK/fullwidth ones end a sentence even with no space after them.
_SPACED_ENDERS = frozenset(".!?…")
_UNSPACED_ENDERS = frozenset("\u3002\uff01\uff1f")  # ideographic full stop, fullwidth ! and ?
# Closing quotes and brackets that may follow a terminator: `He said "stop." Then...`
_CLOSERS = frozenset("\"')]}\u2019\u201d\u00bb\u203a\u300d\u300f")  # curly quotes, guillemets, CJK brackets

_PARAGRAPH, _SENTENCE, _LINE, _NONE = 3, 2, 1, 0


@dataclass(frozen=True)
class Chunk:
    """One window of the text: ``text == source[start:end]``, ``tokens`` tokens long."""

    ordinal: int
    text: str
    start: int
    end: int
    tokens: int


def _is_mark(ch: str) -> bool:
    return unicodedata.category(ch).startswith("M")


def iter_tokens(text: str) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` character spans of the tokens of ``text``, in order, lazily.

    Words are maximal runs of word characters and combining marks (so ``"Gletscher"``,
    ``"café"`` in either normal form, and ``"हिन्दी"`` are one token each); every other
    non-whitespace character is a token of its own.
    """
    pending: tuple[int, int] | None = None
    # Whether the pending span is a word (or a mark glued to one) that a mark or word may extend.
    last_wordish = False
    for match in _RAW_TOKEN.finditer(text):
        start, end = match.span()
        # Python's \w excludes combining marks (category M), which would split decomposed
        # accents and most Indic scripts; glue them, and the letters after them, to the word.
        wordish = end - start > 1 or bool(_WORD_CHAR.match(text, start)) or _is_mark(text[start])
        if pending is not None and wordish and last_wordish and pending[1] == start:
            pending = (pending[0], end)
        else:
            if pending is not None:
                yield pending
            pending = (start, end)
        last_wordish = wordish
    if pending is not None:
        yield pending


def tokenize(text: str) -> list[tuple[int, int]]:
    """Every token span of ``text`` (see :func:`iter_tokens`)."""
    return list(iter_tokens(text))


def is_word(token: str) -> bool:
    """Whether a token produced by :func:`tokenize` is a word rather than punctuation."""
    return len(token) > 1 or bool(_WORD_CHAR.match(token)) or (token != "" and _is_mark(token))


def _boundary_strength(
    text: str, before: tuple[int, int] | None, last: tuple[int, int], following: tuple[int, int]
) -> int:
    """How natural it is to end a chunk after token ``last`` (``following`` comes next,
    ``before`` precedes ``last``, if any)."""
    last_start, last_end = last
    gap = text[last_end : following[0]]
    if gap.count("\n") >= 2:
        return _PARAGRAPH
    ender = text[last_start:last_end]
    if ender in _CLOSERS and before is not None and before[1] == last_start:
        ender = text[before[0] : before[1]]
    if ender in _UNSPACED_ENDERS or (ender in _SPACED_ENDERS and gap):
        return _SENTENCE
    if "\n" in gap:
        return _LINE
    return _NONE


def chunk_text(text: str, *, max_tokens: int = 200, overlap: int = 40) -> list[Chunk]:
    """Split ``text`` into overlapping chunks of at most ``max_tokens`` tokens.

    Every token lies in some chunk and chunks come in text order. Chunk ``i + 1`` starts with
    the last ``overlap`` tokens of chunk ``i``. A chunk that is not the last ends at the best
    boundary among its last ``max(1, max_tokens // 5)`` token positions: a paragraph break
    (blank line) beats a sentence end, which beats a line break; ties go to the latest
    position; with no boundary there, the chunk is cut at ``max_tokens``. Cuts are also kept
    after ``overlap`` tokens so every chunk brings new tokens. Text without tokens gives ``[]``.

    Raises:
        ValueError: ``max_tokens < 1``, ``overlap < 0`` or ``overlap >= max_tokens``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if overlap < 0 or overlap >= max_tokens:
        raise ValueError(f"overlap must be in [0, max_tokens), got {overlap} with max_tokens={max_tokens}")
    tokens = iter_tokens(text)
    # A sliding window over the tokens: ``window[i]`` is token ``base + i``. It holds one
    # token before the chunk being cut (a boundary looks back one) up to one past its end,
    # so memory stays at one chunk's tokens however long the text is.
    window: list[tuple[int, int]] = []
    base = 0
    tail = max(1, max_tokens // 5)
    chunks: list[Chunk] = []
    first = 0
    while True:
        wanted = first + max_tokens + 1 - base
        while len(window) < wanted and (token := next(tokens, None)) is not None:
            window.append(token)
        available = base + len(window)
        cut = min(first + max_tokens, available)
        if cut < available:
            best, best_strength = cut, _NONE
            for candidate in range(max(cut - tail, first + overlap + 1), cut + 1):
                i = candidate - base
                before = window[i - 2] if candidate >= 2 else None
                strength = _boundary_strength(text, before, window[i - 1], window[i])
                if strength and strength >= best_strength:
                    best, best_strength = candidate, strength
            cut = best
        if cut <= first:
            break
        start, end = window[first - base][0], window[cut - 1 - base][1]
        chunks.append(
            Chunk(ordinal=len(chunks), text=text[start:end], start=start, end=end, tokens=cut - first)
        )
        if cut >= available:
            break
        first = cut - overlap
        drop = first - 1 - base
        if drop > 0:
            del window[:drop]
            base += drop
    return chunks


def fit_chunks(
    chunks: Sequence[Chunk], count: Callable[[Sequence[str]], list[int]], limit: int
) -> list[Chunk]:
    """Cut again, smaller, every chunk over ``limit`` tokens as a model counts them
    (``count``: a wordpiece tokenizer, say), so the model reads every chunk whole.

    A chunk over the limit is re-chunked (:func:`chunk_text`) with a window scaled to fit,
    overlap a fifth of it; a single word still over (a long run of symbols) is split by
    characters. Offsets stay offsets into the original text; ordinals are renumbered.

    Raises:
        ValueError: ``limit < 1``.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    fitted: list[Chunk] = []
    pending = list(chunks)
    while pending:
        counts = count([c.text for c in pending])
        over: list[Chunk] = []
        for chunk, n in zip(pending, counts, strict=True):
            if n <= limit:
                fitted.append(chunk)
            else:
                over.extend(_smaller(chunk, n, limit))
        pending = over
    fitted.sort(key=lambda c: (c.start, c.end))
    return [Chunk(i, c.text, c.start, c.end, c.tokens) for i, c in enumerate(fitted)]


def _smaller(chunk: Chunk, size: int, limit: int) -> list[Chunk]:
    """Pieces of ``chunk`` (``size`` model tokens) aimed at ``limit`` each."""
    if chunk.tokens > 1:
        window = max(1, min(chunk.tokens - 1, int(chunk.tokens * limit / size * 0.9)))
        pieces = chunk_text(chunk.text, max_tokens=window, overlap=window // 5)
    else:  # one word: halve it by characters
        middle = max(1, len(chunk.text) // 2)
        pieces = [
            Chunk(0, chunk.text[:middle], 0, middle, 1),
            Chunk(1, chunk.text[middle:], middle, len(chunk.text), 1),
        ]
    return [Chunk(0, p.text, chunk.start + p.start, chunk.start + p.end, p.tokens) for p in pieces if p.text]
