"""Turn an uploaded file's bytes into normalized plain text.

Everything here is a pure function of the bytes (and, for Markdown only, the file name): no I/O, no
globals that change. The type is always detected from the content; the name never overrides what the
bytes say, it only tells Markdown apart from the other kinds of text, which no magic number can.

Detection order (first match wins), see :func:`detect_mime`:

====================  =========================================================================
``application/pdf``   starts with ``%PDF-`` (or puremagic says PDF)
DOCX                  a ZIP archive holding ``word/document.xml``; any other ZIP is rejected
(text)                the bytes decode as text, see :func:`_decode_text`: a BOM, else strict
                      UTF-8, else -- unless puremagic recognises a binary format (image,
                      executable, archive...) -- the encoding charset-normalizer finds. Text with
                      more than one control character in ten (NUL...) is binary after all.
``text/html``         the text starts, after whitespace, comments and an ``<?xml?>`` prolog, with
                      ``<!DOCTYPE html`` or a page element (``<html>``, ``<head>``, ``<body>``...);
                      or with another HTML element (``<div>``, ``<p>``, ``<table>``...) unless the
                      name says Markdown (Markdown may start with raw HTML)
``text/markdown``     text named ``*.md`` / ``*.markdown``, or with an ATX heading line
                      (``# Title``) *and* another Markdown construct (link, image, code, bold)
``text/plain``        any other text
``application/...``   ``application/octet-stream`` for everything else: rejected by :func:`extract`
====================  =========================================================================

Every failure raises one of the :mod:`tasks.files.errors` classes with a short message meant for a
person; messages never quote the document's content. Decompression bombs are refused before they
unpack (see :func:`_check_zip` and :func:`_pdf_configuration` for the limits).
"""

from __future__ import annotations

import codecs
import io
import re
import unicodedata
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import charset_normalizer
import docx
import puremagic
from docx.opc.exceptions import OpcError
from docx.table import Table
from docx.text.paragraph import Paragraph
from lxml.etree import LxmlError
from pypdf import PdfReader, apply_configuration
from pypdf.errors import DependencyError, FileNotDecryptedError, LimitReachedError, PyPdfError

from tasks.files.errors import (
    CorruptFile,
    DocumentTooComplex,
    EmptyDocument,
    EncryptedPdf,
    FileTooLarge,
    NoTextLayer,
    TooManyPages,
    UnsupportedFile,
)
from tasks.files.markup import html_start, html_text, markdown_text

PDF = "application/pdf"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
HTML = "text/html"
MARKDOWN = "text/markdown"
TEXT = "text/plain"
OCTET_STREAM = "application/octet-stream"

NO_TEXT_LAYER = "no text layer (OCR not supported)"
_EMPTY = {
    DOCX: "no text found in the document",
    HTML: "no text found: the page has no visible text",
    MARKDOWN: "no text found in the document",
    TEXT: "no text found: the file holds only whitespace or control characters",
}

_KB = 1024
_MB = 1024 * 1024

# DOCX (ZIP) limits, checked on the archive's directory before anything is unpacked:
# - the declared unpacked size of all members together may be at most _MAX_UNPACK_RATIO times the
#   archive's size (Word's XML compresses 5-20x; zip bombs 1000x and more), though anything up to
#   _UNPACK_FLOOR passes, so a small file of repetitive XML is never refused;
# - and never more than max(4 x Limits.max_bytes, 64 MiB) (:func:`_unpack_cap`);
# - at most _MAX_ZIP_MEMBERS members (Word writes a few dozen).
# zipfile stops every member at its declared size (and then fails its CRC check), so a member cannot
# unpack to more than the directory says.
_MAX_UNPACK_RATIO = 100
_UNPACK_FLOOR = 16 * _MB
_MAX_ZIP_MEMBERS = 10_000
_CENTRAL_DIRECTORY_ENTRY = b"PK\x01\x02"


@dataclass(frozen=True)
class Limits:
    """Upper bounds checked before (size) and while (pages, unpacked size) a file is parsed."""

    max_bytes: int = 25 * _MB
    max_pages: int = 500


@dataclass(frozen=True)
class Extracted:
    """The text of a document and what was learned about it on the way.

    ``text`` is normalized (:func:`normalize`): NFC; ``\\r\\n``, ``\\r``, ``\\v``, ``\\f``, NEL,
    U+2028 and U+2029 become ``\\n``; every other control character except ``\\t`` (NUL, ESC, DEL, the
    C1 range...) is removed and a lone surrogate becomes U+FFFD; trailing whitespace is stripped from
    each line, runs of blank lines are collapsed into one and leading/trailing blank lines are removed.
    It always holds a non-space character: a document without one raises :class:`EmptyDocument`.

    ``encoding`` is the codec the text was decoded with (``utf_8``, ``cp1252``, ``utf_16``...), in
    Python's spelling; ``None`` for PDF and DOCX, whose text is not stored as a byte encoding.
    """

    text: str
    mime: str
    pages: int | None  # PDFs only
    encoding: str | None = None


# --------------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------------

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
# UTF-32 first: its little-endian BOM starts with UTF-16's.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf_32"),
    (codecs.BOM_UTF32_BE, "utf_32"),
    (codecs.BOM_UTF8, "utf_8"),
    (codecs.BOM_UTF16_LE, "utf_16"),
    (codecs.BOM_UTF16_BE, "utf_16"),
)
# Control characters that do not occur in text: C0 but tab, line breaks and ESC (coloured logs), DEL,
# C1 but NEL. More than one in ten characters and "text" is binary.
_BINARY_CONTROLS = re.compile("[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f-\x84\x86-\x9f]")
# charset-normalizer often cannot tell the Western code pages apart in a short text and may pick, say,
# mac_latin2 for French. cp1252 (of which Latin-1 is nearly a subset) wins when it does about as well.
_CP1252_TOLERANCE = 0.1
_META_CHARSET = re.compile(rb"""<meta[^>]{0,512}?charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


@dataclass(frozen=True)
class _Text:
    text: str
    encoding: str
    bom: bool = False


def detect_mime(data: bytes, name: str | None = None) -> str:
    """Return the MIME type of ``data``, judged from its content.

    ``name`` is only consulted to tell Markdown from the other kinds of text once the bytes are known
    to be text; a PDF called ``notes.txt`` is still ``application/pdf``. See the module docstring for
    the rules and their order.
    """
    return _detect(data, name)[0]


def _detect(data: bytes, name: str | None) -> tuple[str, _Text | None]:
    """The MIME type and, for text, the decoded text."""
    mime, description = _magic(data)
    if data.startswith(b"%PDF-") or mime == PDF:
        return PDF, None
    if data.startswith(b"PK\x03\x04") or "zip" in mime or "openxmlformats" in mime:
        return (DOCX if _is_docx(data) else OCTET_STREAM), None
    textual = mime.startswith("text/") or "xml" in mime or "json" in mime or "text" in description
    decoded = _decode_text(data, known_binary=bool(description) and not textual)
    if decoded is None:
        return OCTET_STREAM, None
    text = decoded.text
    markdown_name = name is not None and name.lower().endswith(_MD_SUFFIXES)
    start = html_start(text)
    if start == "page" or (start == "fragment" and not markdown_name):
        return HTML, decoded
    if markdown_name or (_MD_HEADING.search(text) and _MD_OTHER.search(text)):
        return MARKDOWN, decoded
    return TEXT, decoded


def _magic(data: bytes) -> tuple[str, str]:
    """puremagic's best match as (MIME type, lower-case description); empty strings for none."""
    try:
        best = puremagic.magic_string(data)[0]
    except (puremagic.PureError, ValueError, IndexError):
        return "", ""
    return best.mime_type, best.name.lower()


def _is_docx(data: bytes) -> bool:
    if data.count(_CENTRAL_DIRECTORY_ENTRY) > _MAX_ZIP_MEMBERS:
        return b"word/document.xml" in data  # not worth a directory of that size; extract refuses it
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return "word/document.xml" in archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        # A truncated ZIP has lost its central directory (at the end) but still has the local headers,
        # which name each member in clear: enough to say "this was a DOCX" and report it as corrupt.
        return b"word/document.xml" in data


def _decode_text(data: bytes, *, known_binary: bool) -> _Text | None:
    """The text of ``data`` and its encoding, or ``None`` when it is not text.

    A BOM decides; otherwise strict UTF-8; otherwise, unless puremagic knows the bytes as a binary
    format, charset-normalizer's best guess (Latin-1, cp1252, UTF-16 without a BOM...). In every case
    text with too many control characters (``_BINARY_CONTROLS``) is not text.
    """
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                text = data.decode("utf_8_sig" if encoding == "utf_8" else encoding)
            except UnicodeDecodeError:
                break
            return None if _looks_binary(text) else _Text(text, encoding, bom=True)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        if not _looks_binary(text):
            return _Text(text, "utf_8")
    if known_binary:
        return None
    matches = charset_normalizer.from_bytes(data)
    best = matches.best()
    if best is None:
        return None
    guess = _Text(str(best), best.encoding)
    if best.encoding in ("utf_16_le", "utf_16_be"):
        # Any even number of bytes decodes as UTF-16; without a BOM, believe it only if NULs (the high
        # bytes of Latin text) never fall on the low-byte side.
        low_bytes = data[0::2] if best.encoding == "utf_16_le" else data[1::2]
        if low_bytes.count(0) * 100 > len(low_bytes):
            return None
    if best.encoding != "cp1252":
        for match in matches:
            if "cp1252" in match.could_be_from_charset and match.chaos <= best.chaos + _CP1252_TOLERANCE:
                try:
                    candidate = _Text(data.decode("cp1252"), "cp1252")
                except UnicodeDecodeError:
                    break
                if not _looks_binary(candidate.text):
                    guess = candidate
                break
    return None if _looks_binary(guess.text) else guess


def _looks_binary(text: str) -> bool:
    return _BINARY_CONTROLS.subn("", text)[1] * 10 > len(text)


def _html_charset(data: bytes, decoded: _Text) -> _Text:
    """A BOM or valid UTF-8 stand; otherwise a ``<meta charset>`` the bytes decode with wins over the
    guess. As in browsers, a declared ISO-8859-1 or ASCII means cp1252."""
    if decoded.bom or decoded.encoding == "utf_8":
        return decoded
    declared = _META_CHARSET.search(data[:4096])
    if declared is None:
        return decoded
    try:
        encoding = codecs.lookup(declared.group(1).decode("ascii")).name.replace("-", "_")
    except LookupError:
        return decoded
    if encoding in ("iso8859_1", "ascii"):
        encoding = "cp1252"
    if encoding.startswith(("utf_16", "utf_32")):  # a meta tag cannot be read in those: it lies
        return decoded
    try:
        return _Text(data.decode(encoding), encoding)
    except UnicodeDecodeError:
        return decoded


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def extract(data: bytes, *, name: str | None = None, limits: Limits = Limits()) -> Extracted:
    """Detect the type of ``data`` and return its normalized text.

    Raises:
        FileTooLarge: ``data`` is over ``limits.max_bytes`` (checked before anything else).
        EmptyDocument: the file is empty, or holds no text once parsed and normalized ("no text
            found..."); its subclass NoTextLayer for a PDF whose pages have no text (a scan).
        DocumentTooComplex: a decompression bomb or a structure over a parsing limit ("document too
            complex: ..."): see :func:`_check_zip` and :func:`_pdf_configuration`.
        TooManyPages: a PDF has more than ``limits.max_pages`` pages.
        EncryptedPdf: a PDF needs a password to be opened.
        CorruptFile: a PDF or DOCX that cannot be parsed.
        UnsupportedFile: any other type (binary data, a ZIP that is not a DOCX...).
    """
    if len(data) > limits.max_bytes:
        raise FileTooLarge(f"file is {_size_up(len(data))}, over the {_size(limits.max_bytes)} limit")
    if not data:
        raise EmptyDocument("no text found: the file is empty")
    mime, decoded = _detect(data, name)
    if mime == PDF:
        text, pages = _pdf_text(data, limits)
        return Extracted(text=text, mime=mime, pages=pages)
    encoding: str | None = None
    if mime == DOCX:
        text = _docx_text(data, limits)
    elif decoded is None:
        raise UnsupportedFile(f"unsupported file type (detected {mime})")
    elif mime == HTML:
        decoded = _html_charset(data, decoded)
        text, encoding = html_text(decoded.text), decoded.encoding
    elif mime == MARKDOWN:
        text, encoding = markdown_text(decoded.text), decoded.encoding
    else:
        text, encoding = decoded.text, decoded.encoding
    text = normalize(text)
    if not text.strip():
        raise EmptyDocument(_EMPTY[mime])
    return Extracted(text=text, mime=mime, pages=None, encoding=encoding)


_SURROGATES = re.compile("[\ud800-\udfff]")
_LINE_BREAKS = re.compile("\r\n?|[\x0b\x0c\x85\u2028\u2029]")
_CONTROLS = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # once the line breaks are \n


def normalize(text: str) -> str:
    """Apply the normalization (and sanitization) documented on :class:`Extracted`."""
    text = unicodedata.normalize("NFC", _SURROGATES.sub("\ufffd", text))
    text = _CONTROLS.sub("", _LINE_BREAKS.sub("\n", text))
    out: list[str] = []
    for line in text.split("\n"):
        line = line.rstrip()
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


def _stream_limit(limits: Limits) -> int:
    """What one PDF stream may unpack to: max_bytes, but at least 16 MiB and at most 64 MiB."""
    return min(max(limits.max_bytes, 16 * _MB), 64 * _MB)


def _pdf_configuration(limits: Limits) -> dict[str, Any]:
    """pypdf limits (its defaults are 75 MB per stream) tightened to :func:`_stream_limit`.

    A stream whose filters (Flate, LZW, run-length...) would produce more, or which declares a longer
    ``/Length`` than the file has bytes, makes pypdf raise LimitReachedError: DocumentTooComplex.
    pypdf's own page-tree limits (depth 100, 100,000 entries, cycles detected) stay as they are.
    """
    stream = _stream_limit(limits)
    return {
        "zlib_maximum_output_length": stream,
        "lzw_maximum_output_length": stream,
        "run_length_maximum_output_length": stream,
        "brotli_maximum_output_length": stream,
        "jbig2_maximum_output_length": stream,
        "array_based_stream_maximum_output_length": stream,
        "image_maximum_buffer_size": stream,
        "stream_decoding_work_maximum_length": 2 * stream,
        "maximum_declared_stream_length": max(limits.max_bytes, 1),
    }


def _pdf_text(data: bytes, limits: Limits) -> tuple[str, int]:
    with apply_configuration(**_pdf_configuration(limits)):
        try:
            return _read_pdf(data, limits)
        except LimitReachedError as exc:
            raise _pdf_limit(exc, limits) from exc


def _pdf_limit(exc: LimitReachedError, limits: Limits) -> DocumentTooComplex | TooManyPages:
    message = str(exc)
    if message.startswith("Maximum page tree entry"):
        return TooManyPages(f"PDF has too many pages, over the {limits.max_pages}-page limit")
    if message.startswith("Maximum page tree depth"):
        return DocumentTooComplex("document too complex: the PDF page tree is nested too deeply")
    if "decompressing" in message:
        return DocumentTooComplex(
            f"document too complex: a PDF stream unpacks to more than {_size(_stream_limit(limits))}"
        )
    return DocumentTooComplex("document too complex: the PDF is over a parsing limit")


def _read_pdf(data: bytes, limits: Limits) -> tuple[str, int]:
    try:
        reader = PdfReader(io.BytesIO(data))
        # Encrypted with an empty user password means "restrictions only": every viewer opens such a
        # file without asking, so it is not password-protected for our purposes.
        if reader.is_encrypted and not reader.decrypt(""):
            raise EncryptedPdf("PDF is password-protected")
        count = len(reader.pages)
    except (FileNotDecryptedError, DependencyError) as exc:
        raise EncryptedPdf("PDF is password-protected") from exc
    except LimitReachedError:
        raise
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
        except LimitReachedError:
            raise
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
_XML_CHUNK = 1 << 16
_DTD_MARKERS = (b"<!DOCTYPE", b"<!ENTITY")


def _unpack_cap(limits: Limits) -> int:
    """What a DOCX may unpack to in all: max(4 x max_bytes, 64 MiB)."""
    return max(4 * limits.max_bytes, 64 * _MB)


def _check_zip(data: bytes, archive: zipfile.ZipFile, limits: Limits) -> None:
    """Refuse a zip bomb from its directory, and any XML part with a DTD, before python-docx reads it.

    The limits are described at ``_MAX_UNPACK_RATIO``. Word never writes a DTD, and a DTD is what an
    entity expansion ("billion laughs") needs: any ``<!DOCTYPE`` or ``<!ENTITY`` in a ``.xml`` or
    ``.rels`` part is refused (python-docx's parser does not expand entities either).
    """
    members = archive.infolist()
    if len(members) > _MAX_ZIP_MEMBERS:
        raise _too_many_members()
    unpacked = sum(info.file_size for info in members)
    cap = _unpack_cap(limits)
    if unpacked > cap:
        raise DocumentTooComplex(
            f"document too complex: DOCX unpacks to {_size_up(unpacked)}, over the {_size(cap)} limit"
        )
    if unpacked > max(_UNPACK_FLOOR, _MAX_UNPACK_RATIO * len(data)):
        raise DocumentTooComplex(
            f"document too complex: DOCX unpacks to {_size_up(unpacked)} from {_size_up(len(data))} "
            f"(ratio {unpacked // len(data)}×, limit {_MAX_UNPACK_RATIO}×)"  # noqa: RUF001
        )
    for info in members:
        if not info.filename.endswith((".xml", ".rels")):
            continue
        with archive.open(info) as part:
            tail = b""
            while chunk := part.read(_XML_CHUNK):
                window = tail + chunk
                if any(marker in window for marker in _DTD_MARKERS):
                    raise DocumentTooComplex(
                        "document too complex: the DOCX declares XML entities (a DTD), "
                        "which Word never writes"
                    )
                tail = window[-16:]


def _too_many_members() -> DocumentTooComplex:
    return DocumentTooComplex(
        f"document too complex: the DOCX archive has more than {_MAX_ZIP_MEMBERS:,} parts"
    )


def _docx_text(data: bytes, limits: Limits) -> str:
    if data.count(_CENTRAL_DIRECTORY_ENTRY) > _MAX_ZIP_MEMBERS:
        raise _too_many_members()  # before zipfile builds an object per entry
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            _check_zip(data, archive, limits)
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
