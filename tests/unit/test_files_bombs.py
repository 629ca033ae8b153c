"""Decompression bombs and hostile structure: each is refused with a named permanent error, quickly,
on the first call and without the process's memory growing by hundreds of megabytes.

Every bomb is built here in code (nothing large is stored in the repository).
"""

from __future__ import annotations

import io
import random
import re
import resource
import struct
import time
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import docx
import pytest
from lxml.etree import LxmlError

from conveyor.errors import is_permanent
from tasks.files.errors import CorruptFile, DocumentTooComplex, FileRejected, TooManyPages
from tasks.files.extract import Limits, extract

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "files"
MB = 1024 * 1024
MAX_SECONDS = 5
MAX_GROWTH = 256 * MB


@contextmanager
def bounded() -> Iterator[None]:
    """The block takes under MAX_SECONDS and grows the peak RSS by under MAX_GROWTH."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    started = time.monotonic()
    yield
    elapsed = time.monotonic() - started
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert elapsed < MAX_SECONDS, f"took {elapsed:.1f} s"
    assert growth < MAX_GROWTH, f"peak memory grew by {growth // MB} MiB"


def refused(data: bytes, error: type[FileRejected], limits: Limits = Limits()) -> str:
    """The message ``extract`` refuses ``data`` with, on the first call, within the bounds."""
    with bounded(), pytest.raises(error) as info:
        extract(data, limits=limits)
    assert is_permanent(info.value)
    return str(info.value)


# --------------------------------------------------------------------------------------------------
# DOCX
# --------------------------------------------------------------------------------------------------


def docx_with(extra: dict[str, bytes | int] | None = None, replace: dict[str, bytes] | None = None) -> bytes:
    """The fixture DOCX with members replaced, and extra members (an int: that many zero bytes, streamed)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(FIXTURES / "tidal-energy.docx") as source, zipfile.ZipFile(
        buffer, "w", zipfile.ZIP_DEFLATED
    ) as target:
        for info in source.infolist():
            target.writestr(info.filename, (replace or {}).get(info.filename, source.read(info)))
        for name, content in (extra or {}).items():
            if isinstance(content, bytes):
                target.writestr(name, content)
                continue
            zeros = bytes(MB)
            with target.open(name, "w", force_zip64=True) as member:
                for _ in range(content // MB):
                    member.write(zeros)
    return buffer.getvalue()


def test_docx_zip_bomb_is_refused_by_ratio() -> None:
    bomb = docx_with({"word/media/image1.png": 60 * MB})
    assert len(bomb) < 200_000
    message = refused(bomb, DocumentTooComplex)
    pattern = r"document too complex: DOCX unpacks to 60\.\d MB from \d+\.\d kB \(ratio \d+×, limit 100×\)"  # noqa: RUF001
    assert re.fullmatch(pattern, message)
    # Over the absolute cap the ratio is not even looked at.
    message = refused(docx_with({"word/media/image1.png": 300 * MB}), DocumentTooComplex)
    assert message == "document too complex: DOCX unpacks to 300.1 MB, over the 100 MB limit"


def test_docx_over_the_absolute_unpacked_cap() -> None:
    # Compressible only ~80x, so under the ratio limit, but 70 MiB in all: over max(4 x 1 MB, 64 MiB).
    rng = random.Random(1)
    buffer = io.BytesIO(docx_with())
    with zipfile.ZipFile(buffer, "a", zipfile.ZIP_DEFLATED) as archive:
        m = archive.open("word/media/big.bin", "w")
        for _ in range(70):
            m.write(rng.randbytes(12 * 1024) + bytes(MB - 12 * 1024))
        m.close()
    data = buffer.getvalue()
    assert len(data) < MB
    message = refused(data, DocumentTooComplex, Limits(max_bytes=MB))
    assert message == "document too complex: DOCX unpacks to 70.1 MB, over the 64 MB limit"


def test_docx_member_unpacking_past_its_declared_size_is_cut_off() -> None:
    # word/document.xml really inflates to 50 MB but the central directory says 4 kB: zipfile stops at
    # 4 kB and the CRC check fails, so the lie is a corrupt file, not 50 MB in memory.
    with zipfile.ZipFile(FIXTURES / "tidal-energy.docx") as source:
        xml = source.read("word/document.xml")
    data = bytearray(docx_with(replace={"word/document.xml": xml + b" " * (50 * MB)}))
    entry = next(
        m.start()
        for m in re.finditer(b"PK\x01\x02", data)
        if data[m.start() + 46 : m.start() + 46 + 17] == b"word/document.xml"
    )
    struct.pack_into("<I", data, entry + 24, 4096)  # uncompressed size
    message = refused(bytes(data), CorruptFile)
    assert message.startswith("corrupt or truncated DOCX")


def test_docx_with_too_many_members() -> None:
    buffer = io.BytesIO(docx_with())
    with zipfile.ZipFile(buffer, "a") as archive:
        for index in range(10_001):
            archive.writestr(f"customXml/item{index}.bin", b"")
    message = refused(buffer.getvalue(), DocumentTooComplex)
    assert message == "document too complex: the DOCX archive has more than 10,000 parts"


BILLION_LAUGHS = (
    b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<!DOCTYPE w:document [\n'
    b'<!ENTITY lol "lol">\n'
    + b"".join(
        b'<!ENTITY lol%d "%s">\n' % (level, (b"&lol%d;" % (level - 1) if level > 1 else b"&lol;") * 10)
        for level in range(1, 10)
    )
    + b"]>\n"
    b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
    b"<w:body><w:p><w:r><w:t>&lol9;</w:t></w:r></w:p></w:body></w:document>"
)


def test_docx_billion_laughs_is_refused() -> None:
    data = docx_with(replace={"word/document.xml": BILLION_LAUGHS})
    message = refused(data, DocumentTooComplex)
    assert message == "document too complex: the DOCX declares XML entities (a DTD), which Word never writes"
    # Second line of defence: python-docx's parser (resolve_entities=False) and libxml2's amplification
    # limit: the document fails to parse or keeps the entity unexpanded, quickly either way.
    with bounded():
        try:
            text = docx.Document(io.BytesIO(data)).paragraphs[0].text
        except LxmlError:
            text = ""
    assert len(text) < 1000


# --------------------------------------------------------------------------------------------------
# PDF
# --------------------------------------------------------------------------------------------------


def pdf(objects: list[bytes]) -> bytes:
    """A PDF of ``objects`` (object 1 is the catalog) with a correct cross-reference table."""
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (number, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.writelines(b"%010d 00000 n \n" % offset for offset in offsets)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


FONT = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def page(contents: int, parent: int = 2) -> bytes:
    return (
        b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
        b"/Resources << /Font << /F1 3 0 R >> >> >>" % (parent, contents)
    )


def stream(raw: bytes, padding: int = 0) -> bytes:
    """A FlateDecode stream of ``raw`` followed by ``padding`` zero bytes, compressed as it goes."""
    compressor = zlib.compressobj(9)
    parts = [compressor.compress(raw)]
    zeros = bytes(MB)
    for _ in range(padding // MB):
        parts.append(compressor.compress(zeros))
    parts.append(compressor.flush())
    data = b"".join(parts)
    return b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(data), data)


HELLO = b"BT /F1 12 Tf 72 712 Td (Hello from a small PDF) Tj ET\n"


def test_a_well_formed_hand_built_pdf_is_read() -> None:
    data = pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>", FONT,
                page(5), stream(HELLO, padding=2 * MB)])  # fmt: skip
    result = extract(data)
    assert result.text == "Hello from a small PDF" and result.pages == 1


def test_pdf_flate_bomb_is_refused() -> None:
    data = pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>", FONT,
                page(5), stream(HELLO, padding=500 * MB)])  # fmt: skip
    assert len(data) < MB
    message = refused(data, DocumentTooComplex)
    assert message == "document too complex: a PDF stream unpacks to more than 25 MB"
    # The limit follows Limits.max_bytes (at least 16 MiB): 20 MB unpacked is fine for 25 MB files only.
    small = pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>", FONT,
                 page(5), stream(HELLO, padding=20 * MB)])  # fmt: skip
    assert extract(small).text == "Hello from a small PDF"
    assert refused(small, DocumentTooComplex, Limits(max_bytes=MB)).endswith("more than 16 MB")


def test_pdf_with_a_deeply_nested_page_tree() -> None:
    depth = 300
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [5 0 R] /Count 1 >>", FONT,
               stream(HELLO)]  # fmt: skip
    for level in range(depth):  # node 5 + level, its kid 6 + level
        objects.append(b"<< /Type /Pages /Parent %d 0 R /Kids [%d 0 R] /Count 1 >>" % (4 + level, 6 + level))
    objects.append(page(4, parent=4 + depth))
    message = refused(pdf(objects), DocumentTooComplex)
    assert message == "document too complex: the PDF page tree is nested too deeply"


def test_pdf_with_a_cyclic_page_tree() -> None:
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [5 0 R] /Count 1 >>", FONT,
               stream(HELLO), b"<< /Type /Pages /Parent 2 0 R /Kids [2 0 R 6 0 R] /Count 2 >>",
               page(4, parent=5)]  # fmt: skip
    with bounded(), pytest.raises((CorruptFile, DocumentTooComplex)) as info:
        extract(pdf(objects))
    assert is_permanent(info.value)


def test_pdf_declaring_a_huge_page_count_or_repeating_one_page() -> None:
    lying = pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [4 0 R] /Count 999999999 >>",
                 FONT, page(5), stream(HELLO)])  # fmt: skip
    with bounded():
        result = extract(lying)
    assert result.pages == 1  # the tree is walked, the declared /Count is not trusted
    kids = b" ".join([b"4 0 R"] * 50_000)
    tree = b"<< /Type /Pages /Kids [%s] /Count 50000 >>" % kids
    repeated = pdf([b"<< /Type /Catalog /Pages 2 0 R >>", tree, FONT, page(5), stream(HELLO)])
    message = refused(repeated, TooManyPages)
    assert message == "PDF has 50000 pages, over the 500-page limit"
