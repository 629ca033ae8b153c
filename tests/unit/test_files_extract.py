"""Text extraction from real files: LibreOffice PDFs and DOCX, plus our own generated fixtures.

The fixtures live in tests/fixtures/files (see the README there for provenance and licence).
"""

from __future__ import annotations

import gzip
import io
import random
import re
import shutil
import time
import zipfile
from pathlib import Path

import docx
import pytest
from pypdf import PdfReader, PdfWriter
from pypdf.generic import StreamObject

from conveyor.errors import is_permanent
from tasks.files.errors import (
    CorruptFile,
    DocumentTooComplex,
    EmptyDocument,
    EncryptedPdf,
    FileRejected,
    FileTooLarge,
    NoTextLayer,
    TooManyPages,
    UnsupportedFile,
)
from tasks.files.extract import Extracted, Limits, detect_mime, extract

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "files"

PDF = "application/pdf"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
MB = 1024 * 1024
APOSTROPHE = "\u2019"  # the typographic one, as office suites write it


def read(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def text_of(name: str) -> str:
    return extract(read(name), name=name).text


# --------------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------------

EXPECTED_MIME = {
    "alpine-glaciers.pdf": PDF,
    "baroque-music.pdf": PDF,
    "tidal-energy.docx": DOCX,
    "volcanoes-encrypted.pdf": PDF,
    "scanned-blank.pdf": PDF,
    "truncated.pdf": PDF,
    "beekeeping.html": "text/html",
    "lighthouse-keepers.md": "text/markdown",
    "sourdough-bread.txt": "text/plain",
    "binary.bin": "application/octet-stream",
}


@pytest.mark.parametrize(("name", "mime"), sorted(EXPECTED_MIME.items()))
def test_detects_every_fixture_from_its_content(name: str, mime: str) -> None:
    data = read(name)
    assert detect_mime(data, name) == mime
    # The Markdown fixture has enough syntax to be recognised without its name, too.
    assert detect_mime(data) == mime


def test_a_pdf_renamed_to_txt_is_still_a_pdf(tmp_path: Path) -> None:
    renamed = tmp_path / "quarterly-report.txt"
    shutil.copy(FIXTURES / "alpine-glaciers.pdf", renamed)
    assert detect_mime(renamed.read_bytes(), renamed.name) == PDF
    result = extract(renamed.read_bytes(), name=renamed.name)
    assert result.mime == PDF and result.pages == 4


def test_names_never_override_the_content() -> None:
    assert detect_mime(read("tidal-energy.docx"), "notes.md") == DOCX
    assert detect_mime(read("beekeeping.html"), "page.txt") == "text/html"
    assert detect_mime(read("binary.bin"), "image.md") == "application/octet-stream"
    # Only between the two kinds of UTF-8 text does the name decide.
    assert detect_mime(read("sourdough-bread.txt"), "sourdough.md") == "text/markdown"
    assert detect_mime(read("sourdough-bread.txt"), "sourdough.TXT") == "text/plain"
    assert detect_mime(b"# just a heading\nand a line", "README.MARKDOWN") == "text/markdown"


def test_html_detection_allows_bom_whitespace_and_any_case() -> None:
    assert detect_mime(b"\xef\xbb\xbf \n\t<!DocType HTML><p>x") == "text/html"
    assert detect_mime(b"<HTML><body>x</body></HTML>") == "text/html"
    # A fragment starting with an HTML element is HTML too (it was text/plain before lxml sniffing).
    assert detect_mime(b"<p>a fragment is still HTML</p>") == "text/html"


def test_plain_text_in_any_encoding_with_a_stray_nul() -> None:
    assert detect_mime("Grüße".encode()) == "text/plain"
    assert detect_mime(b"\xef\xbb\xbfwith bom") == "text/plain"
    # Not UTF-8 is no longer binary: charset-normalizer decodes it (it was octet-stream before).
    assert detect_mime("Grüße aus Köln".encode("latin-1")) == "text/plain"
    # One NUL does not make text binary (it was octet-stream before); it is removed from the text.
    assert detect_mime(b"text\x00with a nul") == "text/plain"
    # One heading alone is not enough to call text Markdown without the name.
    assert detect_mime(b"# a shell-style comment\nplain line") == "text/plain"


def test_a_zip_without_word_document_is_not_docx(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("content.xml", "<x/>")
    assert detect_mime(buffer.getvalue(), "fake.docx") == "application/octet-stream"
    with pytest.raises(UnsupportedFile):
        extract(buffer.getvalue(), name="fake.docx")


# --------------------------------------------------------------------------------------------------
# LibreOffice PDFs
# --------------------------------------------------------------------------------------------------

LIBREOFFICE_PDFS = {
    "alpine-glaciers.pdf": (
        ["Rhônegletscher", "Großglockner", "παγετώνας", "Kaiser-Franz-Josefs-Höhe", "Ötztal", "Genève"],
        ["Alpine Glaciers in Retreat", "The Rhône Glacier", "Mer de Glace: ladders", "Pasterze and the"],
    ),
    "baroque-music.pdf": (
        ["Händel", "Köthen", "барокко", "Pièces", "clavecin", "Matthäus-Passion", "François Couperin"],
        ["Keyboards and Cantatas", "Bach in Köthen", "Händel and the London", "The French harpsichord"],
    ),
}


@pytest.mark.parametrize("name", sorted(LIBREOFFICE_PDFS))
def test_libreoffice_pdf_fixture_is_real_world(name: str) -> None:
    reader = PdfReader(FIXTURES / name)
    assert reader.metadata is not None and str(reader.metadata.producer).startswith("LibreOffice")
    assert len(reader.pages) >= 3
    # Compressed content streams, as real-world PDFs have them.
    streams = [page["/Contents"].get_object() for page in reader.pages]
    assert all(
        isinstance(stream, StreamObject) and str(stream["/Filter"]) == "/FlateDecode" for stream in streams
    )


@pytest.mark.parametrize("name", sorted(LIBREOFFICE_PDFS))
def test_libreoffice_pdf_text_is_extracted_in_page_order(name: str) -> None:
    words, headings_in_order = LIBREOFFICE_PDFS[name]
    result = extract(read(name), name=name)
    assert result.mime == PDF and result.pages == 4
    for word in words:
        assert word in result.text
    # Typography survives: em dash and curly quotes, not ASCII stand-ins.
    assert "—" in result.text and "“" in result.text and APOSTROPHE in result.text
    positions = [result.text.index(heading) for heading in headings_in_order]
    assert positions == sorted(positions)
    # Justified lines come out of pypdf with stretched gaps; they are collapsed.
    assert "  " not in result.text


# --------------------------------------------------------------------------------------------------
# LibreOffice DOCX
# --------------------------------------------------------------------------------------------------


def test_docx_fixture_was_written_by_libreoffice() -> None:
    with zipfile.ZipFile(FIXTURES / "tidal-energy.docx") as archive:
        assert "LibreOffice" in archive.read("docProps/app.xml").decode()


def test_docx_paragraphs_and_table_cells_in_document_order() -> None:
    result = extract(read("tidal-energy.docx"), name="tidal-energy.docx")
    assert result.mime == DOCX and result.pages is None
    lines = result.text.split("\n")
    assert lines[0] == "Power from the Tides"
    assert lines[1].startswith("Twice a day the sea rises and falls")
    for word in [
        "παλίρροια",
        "Gezeitenkraftwerk",
        "usine marémotrice",
        "Кислая Губа",
        f"l{APOSTROPHE}usine",
        "—",
    ]:
        assert word in result.text
    table_at = lines.index("Site\tType\tOpened")
    assert lines[table_at - 1].startswith("The table below compares")
    assert lines[table_at + 1 : table_at + 5] == [
        "La Rance (France)\tBarrage\t1966",
        "Kislaya Guba (Russia)\tBarrage, experimental\t1968",
        "Sihwa Lake (South Korea)\tBarrage on a sea wall\t2011",
        "Pentland Firth (Scotland)\tTidal stream turbines\t2016",
    ]
    assert lines[table_at + 5] == "Costs and prospects"


def test_truncated_docx_is_corrupt() -> None:
    data = read("tidal-energy.docx")
    truncated = data[: len(data) * 6 // 10]
    assert detect_mime(truncated) == DOCX
    with pytest.raises(CorruptFile, match=r"^corrupt or truncated DOCX"):
        extract(truncated)


# --------------------------------------------------------------------------------------------------
# HTML, Markdown, plain text
# --------------------------------------------------------------------------------------------------


def test_html_drops_script_style_and_head_and_decodes_entities() -> None:
    text = text_of("beekeeping.html")
    for hidden in ["hiddenScriptMarker", "hidden script marker", "hidden-style-marker", "head title", "{"]:
        assert hidden not in text
    assert "forty thousand bees — foragers, nurses, builders & guards —" in text
    assert f"beekeeper{APOSTROPHE}s job" in text and '<brackets> and "quotes"' in text
    assert "&" + "amp;" not in text and "&mdash;" not in text
    lines = text.split("\n")
    assert lines[0] == "A Year with Honeybees"
    # List items, <br> and table rows are separate lines; whitespace inside a block is collapsed.
    assert "Spring: inspect the brood and add a super for honey." in lines
    assert 'Entities such as <brackets> and "quotes" come out as text.' in lines
    assert "Willow\tMarch" in lines
    assert any(
        line.startswith("Beekeeping follows the seasons. In early spring the colony is small and the")
        for line in lines
    )


def test_html_with_an_unclosed_head_keeps_the_body() -> None:
    text = extract(b"<html><head><title>Skip me</title><body><p>Kept &eacute;t&eacute;</p>").text
    assert text == "Kept été"


def test_html_comments_declarations_and_unterminated_markup() -> None:
    page = (
        b"<!DOCTYPE html><html><body><!-- <p>old version</p> -->Shown <?php echo 1 ?>text"
        b"<p title='a>b'>a < b and c > d</p><script>if (a<b) x('</div>')</script>end"
        b"<p>cut here<a href='never closed"
    )
    assert extract(page).text == "Shown text\n\na < b and c > d\n\nend\n\ncut here"


@pytest.mark.parametrize("unit", ["<a ", "<a b='>'", "<!--", "<![CDATA[", "</ ", "<?", '<a x=">'])
def test_hostile_html_is_parsed_in_linear_time(unit: str) -> None:
    # Unpatched html.parser needs minutes for 40 kB of some of these; the pre-pass keeps it linear.
    started = time.monotonic()
    extract(("<html><p>intro</p>" + unit * (300_000 // len(unit))).encode())
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("unit", ["*a ", "**a ", "_a ", "[", "[a](", "<http:", "`a``", "~~a "])
def test_hostile_markdown_is_stripped_in_linear_time(unit: str) -> None:
    started = time.monotonic()
    extract(("# Title\n\n" + unit * (1_000_000 // len(unit))).encode(), name="hostile.md")
    assert time.monotonic() - started < 5


def test_markdown_syntax_is_stripped_and_text_kept() -> None:
    result = extract(read("lighthouse-keepers.md"), name="lighthouse-keepers.md")
    assert result.mime == "text/markdown"
    text = result.text
    for syntax in ["#", "**", "`", "](", "![", "> ", "---", "_fog", "*lonely*"]:
        assert syntax not in text
    lines = text.split("\n")
    assert lines[0] == "Lighthouse Keepers"
    assert "A keeper's day" in lines
    assert "Light the lamp at sunset and wind the clockwork that turns the lens." in lines
    assert "Storms meant no supply boat, sometimes for weeks." in lines
    assert "The light must never go out. Everything else can wait." in lines
    assert "Read more in the Northern Lighthouse Board archives" in lines
    assert "and see the Fresnel lens diagram that made the beams visible" in lines
    assert "LOG 14 JAN: wind NW force 8, light exhibited 16:20" in lines  # fenced code is kept as text
    assert "a family, living at its foot. The job was lonely, exacting and surprisingly" in lines


def test_markdown_keeps_snake_case_code_and_escaped_characters() -> None:
    source = b"# Notes\n\nSet `max_retry_count` to *three*; my_var_name stays, \\*stars\\* are literal.\n"
    assert extract(source, name="notes.md").text == (
        "Notes\n\nSet max_retry_count to three; my_var_name stays, *stars* are literal."
    )


def test_plain_text_is_normalized() -> None:
    result = extract(read("sourdough-bread.txt"), name="sourdough-bread.txt")
    assert result.mime == "text/plain" and result.pages is None
    text = result.text
    assert text.startswith("Sourdough Bread\n\nA sourdough starter")  # BOM gone
    assert "\r" not in text and "\n\n\n" not in text
    assert "Bäckerei" in text  # NFC: one code point, though the file spells it a + combining diaeresis
    assert "crème fraîche" in text
    assert all(line == line.rstrip() for line in text.split("\n"))


def test_normalization_rules() -> None:
    assert extract(b"\r\n\r\n  a  \r\n\r\n\r\n\r\nb\rc\n\n\n").text == "  a\n\nb\nc"
    with pytest.raises(EmptyDocument, match=r"^no text found: the file is empty$"):
        extract(b"")  # an empty text used to be returned as ""


# --------------------------------------------------------------------------------------------------
# The fixtures can be told apart by what they are about
# --------------------------------------------------------------------------------------------------

TOPICS = {
    "alpine-glaciers.pdf": "glacier",
    "baroque-music.pdf": "harpsichord",
    "tidal-energy.docx": "tidal",
    "beekeeping.html": "hive",
    "lighthouse-keepers.md": "lighthouse",
    "sourdough-bread.txt": "sourdough",
}


@pytest.mark.parametrize("name", sorted(TOPICS))
def test_each_document_matches_only_its_own_topic(name: str) -> None:
    words = set(re.findall(r"\w+", text_of(name).lower()))
    matching = {topic for topic in TOPICS.values() if topic in words}
    assert matching == {TOPICS[name]}


# --------------------------------------------------------------------------------------------------
# Rejections
# --------------------------------------------------------------------------------------------------


def test_encrypted_pdf_is_rejected() -> None:
    with pytest.raises(EncryptedPdf) as info:
        extract(read("volcanoes-encrypted.pdf"))
    assert str(info.value) == "PDF is password-protected"
    # The fixture is a genuine document behind the password, not a broken file.
    reader = PdfReader(FIXTURES / "volcanoes-encrypted.pdf", password="magma-chamber")
    assert "Living with Volcanoes" in reader.pages[0].extract_text()


def test_pdf_with_only_an_owner_password_is_read() -> None:
    # An empty user password means every viewer opens the file without asking.
    writer = PdfWriter(clone_from=PdfReader(FIXTURES / "volcanoes-encrypted.pdf", password="magma-chamber"))
    writer.encrypt(user_password="", owner_password="restrictions-only", algorithm="AES-128")
    buffer = io.BytesIO()
    writer.write(buffer)
    result = extract(buffer.getvalue())
    assert result.pages == 2 and "Pyroclastic flows" in result.text


def test_pdf_without_a_text_layer() -> None:
    with pytest.raises(NoTextLayer) as info:
        extract(read("scanned-blank.pdf"))
    assert str(info.value) == "no text layer (OCR not supported)"
    assert len(PdfReader(FIXTURES / "scanned-blank.pdf").pages) == 3


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(read("truncated.pdf"), id="first-40-percent"),
        pytest.param(read("alpine-glaciers.pdf")[:20_000], id="libreoffice-half"),
        pytest.param(b"%PDF-1.7\n" + bytes(range(256)) * 4, id="garbage-after-header"),
        pytest.param(b"%PDF-", id="header-only"),
    ],
)
def test_corrupt_pdf(data: bytes) -> None:
    with pytest.raises(CorruptFile) as info:
        extract(data)
    assert re.fullmatch(r"corrupt or truncated PDF: [a-z -]+", str(info.value))


def test_binary_is_unsupported() -> None:
    with pytest.raises(UnsupportedFile) as info:
        extract(read("binary.bin"), name="binary.txt")
    assert str(info.value) == "unsupported file type (detected application/octet-stream)"


def test_latin1_text_is_decoded_not_unsupported() -> None:
    # It used to raise UnsupportedFile ("text is not valid UTF-8").
    result = extract("Grüße aus Köln, schöne Straße.".encode("latin-1"), name="letter.txt")
    assert result.text == "Grüße aus Köln, schöne Straße." and result.encoding == "cp1252"


def test_size_limit_is_checked_first() -> None:
    small = Limits(max_bytes=1000)
    for name in ["alpine-glaciers.pdf", "binary.bin", "volcanoes-encrypted.pdf"]:
        with pytest.raises(FileTooLarge):
            extract(read(name), limits=small)
    data = read("sourdough-bread.txt")
    assert extract(data, limits=Limits(max_bytes=len(data))).text.startswith("Sourdough")


def test_size_limit_message() -> None:
    with pytest.raises(FileTooLarge) as info:
        extract(b"\x00" * int(31.2 * MB))
    assert str(info.value) == "file is 31.2 MB, over the 25 MB limit"
    with pytest.raises(FileTooLarge) as info:
        extract(read("alpine-glaciers.pdf"), limits=Limits(max_bytes=10 * 1024))
    assert re.fullmatch(r"file is \d+\.\d kB, over the 10 kB limit", str(info.value))
    with pytest.raises(FileTooLarge) as info:
        extract(b"x" * (25 * MB + 1))
    assert str(info.value) == "file is 25.1 MB, over the 25 MB limit"  # rounded up, never "25 MB"


def test_page_limit() -> None:
    with pytest.raises(TooManyPages) as info:
        extract(read("baroque-music.pdf"), limits=Limits(max_pages=3))
    assert str(info.value) == "PDF has 4 pages, over the 3-page limit"
    assert extract(read("baroque-music.pdf"), limits=Limits(max_pages=4)).pages == 4


def test_every_rejection_is_permanent() -> None:
    for error in [
        UnsupportedFile, CorruptFile, EncryptedPdf, NoTextLayer, FileTooLarge, TooManyPages,
        EmptyDocument, DocumentTooComplex,
    ]:  # fmt: skip
        assert issubclass(error, FileRejected) and is_permanent(error("x"))


def test_extracted_is_frozen() -> None:
    result = extract(b"hello")
    assert result == Extracted(text="hello", mime="text/plain", pages=None, encoding="utf_8")
    with pytest.raises(AttributeError):
        result.text = "changed"  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# Control characters
# --------------------------------------------------------------------------------------------------

# Seven control characters in a line of ordinary length: text with stray controls, not binary.
CONTROLS = "a\x00b\x01c\x07d\x1be\x7ff\x80g\x9fh, then a line of ordinary text long enough to be text"


@pytest.mark.parametrize(
    ("data", "name"),
    [
        pytest.param(f"Title\n\n{CONTROLS}\n".encode(), "notes.txt", id="text"),
        pytest.param(f"# Title\n\n{CONTROLS}\n".encode(), "notes.md", id="markdown"),
        pytest.param(f"<html><body><h1>Title</h1><p>{CONTROLS}</p></body></html>".encode(), None, id="html"),
        pytest.param(f"Title\n\n{CONTROLS}\n".encode("utf-16"), None, id="utf-16"),
    ],
)
def test_nul_and_control_characters_are_removed_from_every_format(data: bytes, name: str | None) -> None:
    result = extract(data, name=name)
    assert result.text == "Title\n\nabcdefgh, then a line of ordinary text long enough to be text"


def test_control_line_breaks_become_newlines() -> None:
    # \r\n, \r, \v, \f and NEL end lines; a tab stays.
    assert extract("a\r\nb\rc\vd\fe\x85f\tg".encode()).text == "a\nb\nc\nd\ne\nf\tg"


def test_a_text_file_with_one_nul_is_plain_text() -> None:
    result = extract(b"A line of text\x00 with one NUL byte in it.\n", name="log.txt")
    assert result.mime == "text/plain" and result.text == "A line of text with one NUL byte in it."


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(random.Random(7).randbytes(4096), id="random"),
        pytest.param(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8, id="png"),
        pytest.param(b"\x7fELF\x02\x01\x01\x00" + bytes(56) + bytes(range(256)) * 8, id="elf"),
        pytest.param(b"MZ\x90\x00\x03\x00\x00\x00\x04\x00" + bytes(200), id="exe"),
        pytest.param(gzip.compress(b"text inside an archive " * 100, mtime=0), id="gzip"),
        pytest.param(bytes(1000), id="zeros"),
        pytest.param(b"text\x00" * 200, id="mostly-nul"),
    ],
)
def test_real_binary_stays_unsupported(data: bytes) -> None:
    assert detect_mime(data, "notes.txt") == "application/octet-stream"
    with pytest.raises(UnsupportedFile, match=r"^unsupported file type \(detected application/octet-stream"):
        extract(data, name="notes.txt")


def test_text_that_starts_like_a_magic_number_is_text() -> None:
    # puremagic calls these an executable and a bitmap; valid UTF-8 text wins.
    assert detect_mime(b"MZ is the abbreviation used in this report.") == "text/plain"
    assert detect_mime(b"BM stands for bowel movement in the notes.") == "text/plain"


# --------------------------------------------------------------------------------------------------
# Empty documents
# --------------------------------------------------------------------------------------------------


def _empty_docx() -> bytes:
    buffer = io.BytesIO()
    docx.Document().save(buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("name", ["empty.pdf", "empty.docx", "empty.txt", "empty.md", None])
def test_a_zero_byte_file_is_an_empty_document(name: str | None) -> None:
    with pytest.raises(EmptyDocument) as info:
        extract(b"", name=name)
    assert str(info.value) == "no text found: the file is empty"
    assert is_permanent(info.value)


BLANK = "no text found: the file holds only whitespace or control characters"


@pytest.mark.parametrize(
    ("data", "name", "message"),
    [
        (b" \n\t\r\n  \n", "blank.txt", BLANK),
        ("\ufeff \u3000\n".encode(), None, BLANK),
        (b" " * 40 + b"\x00\n\x01\n", "nul.txt", BLANK),
        (b"# \n\n---\n", "rule.md", "no text found in the document"),
        (
            b"<html><head><title>Only a title</title><script>var x = 1;</script></head>"
            b"<body><style>p {}</style><div> &nbsp; </div><img src='a.png'></body></html>",
            None,
            "no text found: the page has no visible text",
        ),
        (_empty_docx(), "empty.docx", "no text found in the document"),
    ],
    ids=["whitespace", "unicode-spaces", "spaces-and-controls", "markdown-syntax-only", "html", "docx"],
)
def test_documents_without_text_are_empty(data: bytes, name: str | None, message: str) -> None:
    with pytest.raises(EmptyDocument) as info:
        extract(data, name=name)
    assert str(info.value) == message and str(info.value).startswith("no text found")


def test_no_text_layer_is_an_empty_document() -> None:
    assert issubclass(NoTextLayer, EmptyDocument)
    with pytest.raises(EmptyDocument, match=r"^no text layer \(OCR not supported\)$"):
        extract(read("scanned-blank.pdf"))


# --------------------------------------------------------------------------------------------------
# HTML sniffing and text
# --------------------------------------------------------------------------------------------------

XHTML = b"""<?xml version="1.0" encoding="utf-8"?>
<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Strict//EN" "http://www.w3.org/TR/xhtml1/DTD/xhtml1-strict.dtd">
<html xmlns="http://www.w3.org/1999/xhtml"><head><title>Head</title></head>
<body><p>Strict &amp; proper</p></body></html>
"""


@pytest.mark.parametrize(
    ("data", "text"),
    [
        pytest.param(
            b"<!-- saved from url=(0014)about:internet -->\r\n<HTML><BODY><P>Saved page</P></BODY></HTML>",
            "Saved page",
            id="saved-from-url",
        ),
        pytest.param(XHTML, "Strict & proper", id="xhtml-prolog-doctype"),
        pytest.param(
            b'<?xml version="1.0"?>\n<html xmlns="http://www.w3.org/1999/xhtml"><body>NS only</body></html>',
            "NS only",
            id="xhtml-namespace",
        ),
        pytest.param(b"\xef\xbb\xbf\n  <div>In a <b>div</b></div>", "In a div", id="div-fragment"),
        pytest.param(b"<p>One</p><p>Two</p>", "One\n\nTwo", id="p-fragment"),
        pytest.param(b"<table><tr><td>a</td><td>b</td></tr></table>", "a\tb", id="table-fragment"),
        pytest.param(b"<!-- note --><section class='x'>Part</section>", "Part", id="comment-section"),
    ],
)
def test_html_is_recognised_without_a_leading_html_tag(data: bytes, text: str) -> None:
    assert detect_mime(data) == "text/html"
    assert detect_mime(data, "page.txt") == "text/html"
    assert extract(data).text == text


@pytest.mark.parametrize(
    "data",
    [
        b"Use <b>bold</b> sparingly, and <p> tags for paragraphs.",
        b"<john@example.org> wrote:\n> quoted",
        b'<?xml version="1.0"?>\n<rss><channel>feed</channel></rss>',
        b"<!DOCTYPE note>\n<note>xml</note>",
        b"<!-- a comment that never ends",
    ],
)
def test_text_that_merely_contains_tags_is_not_html(data: bytes) -> None:
    assert detect_mime(data) == "text/plain"


def test_markdown_starting_with_html_follows_its_name() -> None:
    source = b'<p align="center"><img alt="Logo" src="l.png"></p>\n\n# Project\n\nSee [the docs](https://x.org).\n'
    assert detect_mime(source) == "text/html"
    assert detect_mime(source, "README.md") == "text/markdown"
    assert extract(source, name="README.md").text == "Project\n\nSee the docs."
    # A whole page stays HTML whatever its name.
    assert detect_mime(read("beekeeping.html"), "beekeeping.md") == "text/html"


def test_html_visible_text_only() -> None:
    page = (
        b"<html><head><title>T</title><style>.x{}</style></head><body>"
        b"<noscript>enable js</noscript><template><p>later</p></template>"
        b"<h1>Heading</h1><p>Some   <i>spaced</i>\n   words &lt;tag&gt; &eacute;&#233;&#xE9;</p>"
        b"<pre>  keep\n    this</pre><ul><li>one</li><li>two</li></ul>"
        b"<table><tr><th>k</th><th>v</th></tr><tr><td>a</td><td>1</td></tr></table>"
        b"<script type='module'>alert(1)</script>tail</body></html>"
    )
    assert extract(page).text == (
        "Heading\n\nSome spaced words <tag> ééé\n\n  keep\n    this\n\none\ntwo\n\nk\tv\na\t1\n\ntail"
    )


def test_html_charset_from_meta_bom_or_guess() -> None:
    body = "<p>Café crème — “déjà vu”</p>"
    declared = f'<html><head><meta charset="windows-1252"></head><body>{body}</body></html>'
    result = extract(declared.encode("cp1252"))
    assert result.text == "Café crème — “déjà vu”" and result.encoding == "cp1252"
    # ISO-8859-1 declared means cp1252, as in browsers.
    legacy = f'<html><head><meta http-equiv="Content-Type" content="text/html; charset=ISO-8859-1">{body}'
    assert extract(legacy.encode("cp1252")).text == "Café crème — “déjà vu”"
    utf16 = extract(f"<html><body>{body}</body></html>".encode("utf-16"))
    assert utf16.text == "Café crème — “déjà vu”" and utf16.encoding == "utf_16"
    guessed = extract(f"<div>{body} Un texte assez long en français, écrit à la main.</div>".encode("cp1252"))
    assert guessed.text.startswith("Café crème — “déjà vu”") and guessed.encoding == "cp1252"


# --------------------------------------------------------------------------------------------------
# Markdown with markdown-it-py
# --------------------------------------------------------------------------------------------------


def test_markdown_links_images_code_tables() -> None:
    source = (
        "# Guide\n\n"
        "Read [the manual](https://example.org/m \"title\") and <https://example.org>.\n\n"
        "![A diagram](d.png) shows `a*b*c` and **bold** _em_ ~~old~~ text.\n\n"
        "```python\nx = [1, 2]  # *not* emphasis\n```\n\n"
        "    indented code\n\n"
        "| Name | Value |\n|------|------:|\n| a | 1 |\n| b | 2 |\n\n"
        "1. first\n2. second\n\n"
        "> quoted <b>inline</b> html\n\n"
        "[ref]: https://example.org/ref\n"
    )
    assert extract(source.encode(), name="guide.md").text == (
        "Guide\n\nRead the manual and https://example.org.\n\n"
        "A diagram shows a*b*c and bold em old text.\n\n"
        "x = [1, 2]  # *not* emphasis\n\nindented code\n\n"
        "Name\tValue\na\t1\nb\t2\n\nfirst\nsecond\n\nquoted inline html"
    )


# --------------------------------------------------------------------------------------------------
# Encodings
# --------------------------------------------------------------------------------------------------

FRENCH = (
    "Il était très fâché : à côté de l\u2019église, où ça s\u2019est passé, il a payé 5 € à l\u2019œuvre."
)


@pytest.mark.parametrize(
    ("data", "encoding"),
    [
        pytest.param(FRENCH.encode("utf-8"), "utf_8", id="utf-8"),
        pytest.param(b"\xef\xbb\xbf" + FRENCH.encode("utf-8"), "utf_8", id="utf-8-bom"),
        pytest.param(FRENCH.encode("cp1252"), "cp1252", id="cp1252"),
        pytest.param(FRENCH.encode("utf-16"), "utf_16", id="utf-16-bom"),
        pytest.param(FRENCH.encode("utf-16-le"), "utf_16_le", id="utf-16-le"),
        pytest.param(FRENCH.encode("utf-16-be"), "utf_16_be", id="utf-16-be"),
        pytest.param(FRENCH.encode("utf-32"), "utf_32", id="utf-32-bom"),
    ],
)
def test_text_encodings_are_detected_and_recorded(data: bytes, encoding: str) -> None:
    result = extract(data, name="lettre.txt")
    assert result.mime == "text/plain"
    assert (result.text, result.encoding) == (FRENCH, encoding)


def test_latin1_without_cp1252_characters() -> None:
    text = "Grüße aus Köln: die Bäckerei öffnet um 7 Uhr, schöne Grüße an die Familie Müller."
    result = extract(text.encode("latin-1"))
    assert result.text == text and result.encoding == "cp1252"  # Latin-1 printable is a cp1252 subset


def test_markdown_detection_applies_to_decoded_text() -> None:
    source = "# Über uns\n\nWir sind **Bäcker** in [Köln](https://k.de).\n"
    for data in (source.encode("utf-16"), source.encode("cp1252")):
        result = extract(data)
        assert result.mime == "text/markdown" and result.text == "Über uns\n\nWir sind Bäcker in Köln."


def test_pdf_and_docx_record_no_encoding() -> None:
    assert extract(read("alpine-glaciers.pdf")).encoding is None
    assert extract(read("tidal-energy.docx")).encoding is None
