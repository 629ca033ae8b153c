"""Turn an uploaded file's bytes into normalized plain text.

Everything here is a pure function of the bytes (and, for Markdown only, the file name): no I/O, no
globals that change. The type is always detected from the content; the name never overrides what the
bytes say, it only tells Markdown apart from plain text, which no magic number can.

Detection order (first match wins), see :func:`detect_mime`:

====================  =========================================================================
``application/pdf``   starts with ``%PDF-``
DOCX                  a ZIP archive holding ``word/document.xml``
``text/html``         ``<!doctype html`` or ``<html`` first, after an optional BOM and whitespace
``text/markdown``     UTF-8 text named ``*.md`` / ``*.markdown``, or with an ATX heading line
                      (``# Title``) *and* another Markdown construct (link, image, code, bold)
``text/plain``        UTF-8 text (BOM allowed) without NUL bytes
``application/...``   ``application/octet-stream`` for everything else: rejected by :func:`extract`
====================  =========================================================================

Every failure raises one of the :mod:`tasks.files.errors` classes with a short message meant for a
person; messages never quote the document's content.
"""

from __future__ import annotations

import codecs
import io
import re
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser

import docx
from docx.opc.exceptions import OpcError
from docx.table import Table
from docx.text.paragraph import Paragraph
from lxml.etree import LxmlError
from pypdf import PdfReader
from pypdf.errors import DependencyError, FileNotDecryptedError, PyPdfError

from tasks.files.errors import (
    CorruptFile,
    EncryptedPdf,
    FileTooLarge,
    NoTextLayer,
    TooManyPages,
    UnsupportedFile,
)

PDF = "application/pdf"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
HTML = "text/html"
MARKDOWN = "text/markdown"
TEXT = "text/plain"
OCTET_STREAM = "application/octet-stream"

NO_TEXT_LAYER = "no text layer (OCR not supported)"

_KB = 1024
_MB = 1024 * 1024
# A DOCX is a ZIP; its declared unpacked size (which zipfile enforces while reading) may be at most this
# many times the size limit, so a small zip bomb cannot expand into gigabytes of XML.
_MAX_UNPACK_RATIO = 20


@dataclass(frozen=True)
class Limits:
    """Upper bounds checked before (size) and while (pages) a file is parsed."""

    max_bytes: int = 25 * _MB
    max_pages: int = 500


@dataclass(frozen=True)
class Extracted:
    """The text of a document and what was learned about it on the way.

    ``text`` is normalized: NFC, every line break is ``\\n``, trailing whitespace is stripped from each
    line, runs of blank lines are collapsed into one and leading/trailing blank lines are removed.
    """

    text: str
    mime: str
    pages: int | None  # PDFs only


# --------------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------------

_HTML_START = re.compile(rb"\s*(?:<!doctype\s+html|<html)", re.IGNORECASE)
_MD_SUFFIXES = (".md", ".markdown")
_MD_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+\S", re.MULTILINE)
_MD_OTHER = re.compile(
    r"\]\([^()\s]*\)"  # [text](url) or ![alt](url)
    r"|^ {0,3}(?:```|~~~)"  # fenced code
    r"|`[^`\n]+`"  # inline code
    r"|\*\*[^*\n]+\*\*"  # bold
    r"|^ {0,3}> ",  # blockquote
    re.MULTILINE,
)


def detect_mime(data: bytes, name: str | None = None) -> str:
    """Return the MIME type of ``data``, judged from its content.

    ``name`` is only consulted to tell Markdown from plain text once the bytes are known to be UTF-8
    text; a PDF called ``notes.txt`` is still ``application/pdf``. See the module docstring for the
    rules and their order.
    """
    if data.startswith(b"%PDF-"):
        return PDF
    if data.startswith(b"PK\x03\x04") and _is_docx(data):
        return DOCX
    if _HTML_START.match(data.removeprefix(codecs.BOM_UTF8)):
        return HTML
    text = _decode_utf8(data)
    if text is None:
        return OCTET_STREAM
    if name is not None and name.lower().endswith(_MD_SUFFIXES):
        return MARKDOWN
    if _MD_HEADING.search(text) and _MD_OTHER.search(text):
        return MARKDOWN
    return TEXT


def _is_docx(data: bytes) -> bool:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return "word/document.xml" in archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        # A truncated ZIP has lost its central directory (at the end) but still has the local headers,
        # which name each member in clear: enough to say "this was a DOCX" and report it as corrupt.
        return b"word/document.xml" in data


def _decode_utf8(data: bytes) -> str | None:
    """The text of UTF-8 (optionally BOM-prefixed) bytes without NULs, else ``None``."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def extract(data: bytes, *, name: str | None = None, limits: Limits = Limits()) -> Extracted:
    """Detect the type of ``data`` and return its normalized text.

    Raises:
        FileTooLarge: ``data`` is over ``limits.max_bytes`` (checked before anything else), or a DOCX
            would unpack to more than ``_MAX_UNPACK_RATIO`` times that.
        TooManyPages: a PDF has more than ``limits.max_pages`` pages.
        EncryptedPdf: a PDF needs a password to be opened.
        NoTextLayer: a PDF has pages but no text on any of them (a scan).
        CorruptFile: a PDF or DOCX that cannot be parsed.
        UnsupportedFile: any other type, or text that is not valid UTF-8.
    """
    if len(data) > limits.max_bytes:
        raise FileTooLarge(f"file is {_size_up(len(data))}, over the {_size(limits.max_bytes)} limit")
    mime = detect_mime(data, name)
    if mime == PDF:
        text, pages = _pdf_text(data, limits)
        return Extracted(text=text, mime=mime, pages=pages)
    handlers: dict[str, Callable[[bytes, Limits], str]] = {
        DOCX: _docx_text,
        HTML: _html_text,
        MARKDOWN: _markdown_text,
        TEXT: _plain_text,
    }
    handler = handlers.get(mime)
    if handler is None:
        raise UnsupportedFile(f"unsupported file type (detected {mime})")
    return Extracted(text=normalize(handler(data, limits)), mime=mime, pages=None)


def normalize(text: str) -> str:
    """Apply the normalization documented on :class:`Extracted`."""
    lines = [line.rstrip() for line in unicodedata.normalize("NFC", text).splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def _size(n: int) -> str:
    """``n`` bytes for a person: ``25 MB``, ``1.5 kB``, ``100 B``."""
    for unit, scale in (("MB", _MB), ("kB", _KB)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} B"


def _size_up(n: int) -> str:
    """Like :func:`_size` but rounded up, so a file just over the limit never reads as equal to it."""
    for unit, scale in (("MB", _MB), ("kB", _KB)):
        if n >= scale:
            tenths = -(-n * 10 // scale)
            return f"{tenths // 10}.{tenths % 10} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------------------------------
# PDF
# --------------------------------------------------------------------------------------------------

# Besides its own errors, a malformed PDF can make pypdf raise any of these; a parse failure of the same
# bytes will not go away on retry, so all of them become CorruptFile.
_PDF_FAILURES: tuple[type[Exception], ...] = (
    PyPdfError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    AssertionError,
    RecursionError,
    OverflowError,
    NotImplementedError,  # a stream filter or encryption handler pypdf does not implement
    zlib.error,
)
_PDF_REASONS = (
    ("EOF marker not found", "end-of-file marker missing"),
    ("startxref not found", "cross-reference table missing"),
    ("Cannot find Root object", "document catalog missing"),
    ("Invalid Elementary Object", "malformed object"),
    ("Stream has ended unexpectedly", "file ends unexpectedly"),
    ("Unsupported filter", "unsupported stream compression"),
)
_SPACE_RUNS = re.compile(r"(?<=\S)[ \t]{2,}")


def _pdf_text(data: bytes, limits: Limits) -> tuple[str, int]:
    try:
        reader = PdfReader(io.BytesIO(data))
        # Encrypted with an empty user password means "restrictions only": every viewer opens such a
        # file without asking, so it is not password-protected for our purposes.
        if reader.is_encrypted and not reader.decrypt(""):
            raise EncryptedPdf("PDF is password-protected")
        count = len(reader.pages)
    except (FileNotDecryptedError, DependencyError) as exc:
        raise EncryptedPdf("PDF is password-protected") from exc
    except _PDF_FAILURES as exc:
        if isinstance(exc, NotImplementedError) and b"/Encrypt" in data:
            # An encryption handler other than the standard password one (certificates, DRM): the
            # file is locked to us just the same.
            raise EncryptedPdf("PDF is password-protected") from exc
        raise CorruptFile(f"corrupt or truncated PDF: {_pdf_reason(exc)}") from exc
    if count == 0:
        raise CorruptFile("corrupt or truncated PDF: no pages found")
    if count > limits.max_pages:
        raise TooManyPages(f"PDF has {count} pages, over the {limits.max_pages}-page limit")
    texts: list[str] = []
    for index in range(count):
        try:
            texts.append(reader.pages[index].extract_text())
        except _PDF_FAILURES as exc:
            raise CorruptFile(f"corrupt or truncated PDF: page {index + 1} cannot be read") from exc
    # Justified lines come out with the stretched word gaps as runs of spaces.
    text = normalize("\n\n".join(_SPACE_RUNS.sub(" ", t) for t in texts))
    if not text.strip():
        raise NoTextLayer(NO_TEXT_LAYER)
    return text, count


def _pdf_reason(exc: Exception) -> str:
    """A fixed phrase for the failure: pypdf's own messages may quote bytes of the document."""
    message = str(exc)
    for prefix, reason in _PDF_REASONS:
        if message.startswith(prefix):
            return reason
    if not message or type(exc).__name__ == "EmptyFileError":
        return "empty file"
    return "unreadable structure"


# --------------------------------------------------------------------------------------------------
# DOCX
# --------------------------------------------------------------------------------------------------


# What python-docx and zipfile raise on a damaged archive or part; RuntimeError covers encrypted members.
_DOCX_FAILURES: tuple[type[Exception], ...] = (
    zipfile.BadZipFile,
    OpcError,
    LxmlError,
    KeyError,
    ValueError,
    OSError,
    EOFError,
    NotImplementedError,
    RuntimeError,
    zlib.error,
)


def _docx_text(data: bytes, limits: Limits) -> str:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            unpacked = sum(info.file_size for info in archive.infolist())
        if unpacked > limits.max_bytes * _MAX_UNPACK_RATIO:
            raise FileTooLarge(
                f"DOCX unpacks to {_size_up(unpacked)}, "
                f"over the {_size(limits.max_bytes * _MAX_UNPACK_RATIO)} limit"
            )
        document = docx.Document(io.BytesIO(data))
    except _DOCX_FAILURES as exc:
        raise CorruptFile("corrupt or truncated DOCX: the archive or its XML cannot be read") from exc

    seen: set[object] = set()  # a merged cell is reported once per grid position it spans

    def blocks(items: Iterator[Paragraph | Table]) -> Iterator[str]:
        for item in items:
            if isinstance(item, Paragraph):
                yield item.text
                continue
            for row in item.rows:
                cells: list[str] = []
                for cell in row.cells:
                    if cell._tc in seen:
                        continue
                    seen.add(cell._tc)
                    cells.append(" ".join(blocks(cell.iter_inner_content())))
                yield "\t".join(cells)

    try:
        return "\n".join(blocks(document.iter_inner_content()))
    except _DOCX_FAILURES as exc:
        raise CorruptFile("corrupt or truncated DOCX: the document body cannot be read") from exc


# --------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------

_SKIPPED = frozenset({"script", "style", "head", "template", "noscript"})
_PARAGRAPHS = frozenset(
    {"p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "table", "ul", "ol", "dl", "figure"}
)
_LINES = frozenset(
    {
        "br", "div", "li", "tr", "section", "article", "header", "footer", "nav", "aside", "main",
        "hr", "dt", "dd", "figcaption", "caption", "form", "fieldset", "address", "details",
        "summary", "title", "body", "html", "option", "legend",
    }
)  # fmt: skip
_CELLS = frozenset({"td", "th"})
_HTML_SPACE = re.compile(r"[ \t\n\r\f]+")
# A start or end tag as the HTML tokenizer ends it: at the first ">" outside a quoted attribute value.
# Atomic groups and possessive quantifiers: a failed match costs one scan, never backtracking.
_TAG = re.compile(r"""</?([A-Za-z][^\s/>]*+)(?>[^>"'=]++|=\s*+(?>"[^"]*+"|'[^']*+')?+|["'])*+>""")
# script and style content is raw text up to the matching end tag (html.parser's CDATA mode).
_RAW_TEXT_END = {name: re.compile(rf"</{name}(?=[\s/>])", re.IGNORECASE) for name in ("script", "style")}
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


class _HtmlText(HTMLParser):
    """Collects visible text; block elements become line breaks, whitespace collapses as in a browser."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping: list[str] = []
        self._pre = 0

    def _ends_line(self) -> bool:
        return not self.parts or self.parts[-1].endswith("\n")

    def _break(self, newlines: int) -> None:
        """End the current line (1) or paragraph (2), counting the line breaks already written."""
        have = 0
        for part in reversed(self.parts):
            stripped = part.rstrip("\n")
            have += len(part) - len(stripped)
            if stripped or have >= newlines:
                break
        if self.parts and have < newlines:
            self.parts.append("\n" * (newlines - have))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body" and "head" in self._skipping:
            # An unclosed <head> must not swallow the whole page.
            self._skipping.clear()
        if tag in _SKIPPED:
            self._skipping.append(tag)
        elif self._skipping:
            return
        elif tag == "br":
            self.parts.append("\n")
        elif tag in _PARAGRAPHS:
            self._break(2)
        elif tag in _LINES:
            self._break(1)
        elif tag in _CELLS and not self._ends_line():
            self.parts.append("\t")
        if tag == "pre":
            self._pre += 1

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in _SKIPPED:  # <script/> opens nothing to skip
            self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._skipping:
            while self._skipping.pop() != tag:
                pass
        elif self._skipping:
            return
        elif tag in _PARAGRAPHS:
            self._break(2)
        elif tag in _LINES:
            self._break(1)
        if tag == "pre" and self._pre:
            self._pre -= 1

    def handle_data(self, data: str) -> None:
        if self._skipping:
            return
        if not self._pre:
            data = _HTML_SPACE.sub(" ", data)
            if self._ends_line():
                data = data.lstrip(" ")
        if data:
            self.parts.append(data)


def _html_text(data: bytes, limits: Limits) -> str:
    parser = _HtmlText()
    parser.feed(_defuse_html(_decode_html(data)))
    parser.close()
    return "".join(parser.parts)


def _defuse_html(html: str) -> str:
    """Cut the markup down to constructs that end, in one linear pass, so html.parser stays linear.

    The stdlib parser rescans to the end of the input for every unterminated construct (CPython
    gh-135462, CVE-2025-6069; not fixed in Python 3.11.7, and similar inputs have been reported since):
    40 kB of ``<a <a <a ...`` took 20 s here, a few MB would keep a worker busy for hours.

    So the input is read the way a browser reads it first: comments and bogus comments (``<!...>``,
    ``<?...>``, ``</ ...>``) are dropped, a tag, comment or script that never ends runs to the end of
    the input and is dropped with it, and a ``<`` that starts nothing is text.
    """
    kept: list[str] = []
    position = 0
    while (start := html.find("<", position)) != -1:
        kept.append(html[position:start])
        head = html[start + 1 : start + 4]
        if head.startswith("!--"):
            end = html.find("-->", start + 2)
            position = end + 3 if end != -1 else len(html)
            continue
        if head[:1] in ("!", "?") or (head[:1] == "/" and not _is_letter(head[1:2])):
            end = html.find(">", start + 1)
            position = end + 1 if end != -1 else len(html)
            continue
        tag = _TAG.match(html, start)
        if tag is None:
            if _is_letter(head[:1]) or head[:1] == "/":
                break  # an unterminated tag swallows the rest of the input
            kept.append("&lt;")
            position = start + 1
            continue
        kept.append(tag.group())
        position = tag.end()
        raw_text = _RAW_TEXT_END.get(tag.group(1).lower()) if not tag.group().startswith("</") else None
        if raw_text is not None:
            closing = raw_text.search(html, position)
            if closing is None:
                break
            kept.append(html[position : closing.start()])
            position = closing.start()
    else:
        kept.append(html[position:])
    return "".join(kept)


def _is_letter(char: str) -> bool:
    return char.isascii() and char.isalpha()


def _decode_html(data: bytes) -> str:
    """UTF-8 first; otherwise the charset a ``<meta>`` tag declares; otherwise UTF-8 with replacements."""
    text = _decode_utf8(data)
    if text is not None:
        return text
    declared = _META_CHARSET.search(data[:4096])
    if declared:
        try:
            return data.decode(declared.group(1).decode("ascii"), errors="replace")
        except LookupError:
            pass
    return data.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------

# Every pattern below scans a bounded stretch from each position (delimiter classes exclude the
# delimiter itself), so stripping stays linear even on a hostile 25 MB single-line file.
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_RULE = re.compile(r"^ {0,3}([-*_=])(?:[ \t]*\1){2,}[ \t]*$")  # thematic break or setext underline
_REF_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s+\S")
_TABLE_SEPARATOR = re.compile(r"^ {0,3}\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)+\|?[ \t]*$")
_BLOCKQUOTE = re.compile(r"^ {0,3}(?:>[ \t]?)+")
_HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+|$)")
_LIST_MARKER = re.compile(r"^[ \t]*(?:[-*+]|\d{1,9}[.)])[ \t]+(?:\[[ xX]\][ \t]+)?")
_BACKTICKS = re.compile(r"`+")
_ESCAPED = re.compile(r"\\([\\`*_{}\[\]()#+\-.!>~|<])")
_TARGET = r"\([^()\s]*(?:[ \t]+\"[^\"()]*\")?\)"  # (url) or (url "title")
_INLINE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"!\[([^\[\]]*)\]" + _TARGET), r"\1"),  # image -> alt text
    (re.compile(r"\[([^\[\]]+)\]" + _TARGET), r"\1"),  # [text](url)
    (re.compile(r"\[([^\[\]]+)\]\[[^\[\]]*\]"), r"\1"),  # [text][ref]
    (re.compile(r"<((?:https?|mailto):[^<>\s]+)>"), r"\1"),  # autolink
    (re.compile(r"\*\*([^*\s](?:[^*]*[^*\s])?)\*\*"), r"\1"),
    (re.compile(r"(?<![\w_])__([^_\s](?:[^_]*[^_\s])?)__(?![\w_])"), r"\1"),
    (re.compile(r"(?<![\w*])\*([^*\s](?:[^*]*[^*\s])?)\*(?![\w*])"), r"\1"),
    (re.compile(r"(?<![\w_])_([^_\s](?:[^_]*[^_\s])?)_(?![\w_])"), r"\1"),  # not snake_case
    (re.compile(r"~~([^~\s](?:[^~]*[^~\s])?)~~"), r"\1"),
)
# Escaped characters hide in the Private Use Area while the syntax around them is stripped.
_PUA = 0xE000
# Code spans are set aside as numbered placeholders while the rest is stripped, again in the PUA.
_PLACEHOLDER = re.compile("\ue100([\ue110-\ue119]+)\ue101")
_PLACEHOLDER_CHARS = re.compile("[\ue100-\ue119]")
_TO_PUA_DIGITS = str.maketrans("0123456789", "".join(chr(0xE110 + d) for d in range(10)))
_FROM_PUA_DIGITS = {value: key for key, value in _TO_PUA_DIGITS.items()}


def _markdown_text(data: bytes, limits: Limits) -> str:
    text = _decode_utf8(data)
    if text is None:  # detect_mime only says Markdown for UTF-8
        raise UnsupportedFile("text is not valid UTF-8")
    out: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        opening = _FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
            else:
                out.append(line)
            continue
        if opening:
            fence = opening.group(1)
            continue
        if _RULE.match(line) or _REF_DEFINITION.match(line) or _TABLE_SEPARATOR.match(line):
            out.append("")
            continue
        line = _BLOCKQUOTE.sub("", line)
        heading = _HEADING.match(line)
        if heading:
            line = _without_closing_hashes(line[heading.end() :])
        line = _LIST_MARKER.sub("", line)
        stripped = line.strip()
        if stripped.startswith("|") and stripped.endswith("|") and len(stripped) > 1:
            line = "\t".join(cell.strip() for cell in stripped[1:-1].split("|"))
        out.append(_markdown_inline(line))
    return "\n".join(out)


def _without_closing_hashes(title: str) -> str:
    """``Title ##`` -> ``Title``; a ``#`` glued to a word (``C#``) is part of the title."""
    title = title.rstrip()
    bare = title.rstrip("#")
    if bare == title:
        return title
    if not bare or bare[-1] in " \t":
        return bare.rstrip()
    return title


def _markdown_inline(line: str) -> str:
    """Strip inline syntax outside code spans; code spans keep their content verbatim.

    A code span runs from a backtick string to the next one of the same length; a string without a
    partner is literal text.
    """
    if "`" not in line:
        return _markdown_emphasis(line)
    runs = [(m.start(), m.end()) for m in _BACKTICKS.finditer(line)]
    later: dict[int, list[int]] = {}  # run length -> indexes of such runs, last first
    for index in range(len(runs) - 1, -1, -1):
        later.setdefault(runs[index][1] - runs[index][0], []).append(index)
    pieces: list[str] = []  # prose, then a placeholder for each code span
    codes: list[str] = []
    position = 0  # end of the text already handled
    for index, (start, end) in enumerate(runs):
        same = later[end - start]
        while same and same[-1] <= index:
            same.pop()
        if start < position or not same:
            continue
        closing = runs[same.pop()]
        code = line[end : closing[0]]
        pieces.append(line[position:start])
        pieces.append(f"\ue100{str(len(codes)).translate(_TO_PUA_DIGITS)}\ue101")
        codes.append(code.strip() or code)
        position = closing[1]
    pieces.append(line[position:])
    if _PLACEHOLDER_CHARS.search(line):
        # The text already uses the placeholder code points: strip around the spans piece by piece.
        prose = [_markdown_emphasis(text) for text in pieces[::2]]
        return prose[0] + "".join(code + text for code, text in zip(codes, prose[1:], strict=True))
    # One pass with placeholders costs far less than a pass per piece, and emphasis or a link may span
    # a code span; a placeholder inside a dropped link target goes with it.
    stripped = _markdown_emphasis("".join(pieces))
    return _PLACEHOLDER.sub(lambda m: codes[int(m.group(1).translate(_FROM_PUA_DIGITS))], stripped)


def _markdown_emphasis(segment: str) -> str:
    if any(_PUA <= ord(c) < _PUA + 128 for c in segment):
        # The text already uses those code points, so they cannot serve as placeholders here.
        for pattern, replacement in _INLINE:
            segment = pattern.sub(replacement, segment)
        return _ESCAPED.sub(r"\1", segment)
    segment = _ESCAPED.sub(lambda m: chr(_PUA + ord(m.group(1))), segment)
    for pattern, replacement in _INLINE:
        segment = pattern.sub(replacement, segment)
    return "".join(chr(ord(c) - _PUA) if _PUA <= ord(c) < _PUA + 128 else c for c in segment)


# --------------------------------------------------------------------------------------------------
# Plain text
# --------------------------------------------------------------------------------------------------


def _plain_text(data: bytes, limits: Limits) -> str:
    text = _decode_utf8(data)
    if text is None:  # detect_mime only says text/plain for UTF-8
        raise UnsupportedFile("text is not valid UTF-8")
    return text
