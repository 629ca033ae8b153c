"""Text extraction from real files: LibreOffice PDFs and DOCX, plus our own generated fixtures.

The fixtures live in tests/fixtures/files (see the README there for provenance and licence).
"""

from __future__ import annotations

import io
import re
import shutil
import time
import zipfile
from pathlib import Path

import pytest
from pypdf import PdfReader, PdfWriter
from pypdf.generic import StreamObject

from conveyor.errors import is_permanent
from tasks.files.errors import (
    CorruptFile,
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
    assert detect_mime(b"<p>a fragment is not a page</p>") == "text/plain"


def test_plain_text_needs_valid_utf8_without_nul() -> None:
    assert detect_mime("Grüße".encode()) == "text/plain"
    assert detect_mime(b"\xef\xbb\xbfwith bom") == "text/plain"
    assert detect_mime("Grüße".encode("latin-1")) == "application/octet-stream"
    assert detect_mime(b"text\x00with a nul") == "application/octet-stream"
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
    assert extract(b"").text == ""


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


def test_invalid_utf8_text_is_unsupported() -> None:
    with pytest.raises(UnsupportedFile):
        extract("Grüße aus Köln".encode("latin-1"), name="letter.txt")


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
    for error in [UnsupportedFile, CorruptFile, EncryptedPdf, NoTextLayer, FileTooLarge, TooManyPages]:
        assert issubclass(error, FileRejected) and is_permanent(error("x"))


def test_extracted_is_frozen() -> None:
    result = extract(b"hello")
    assert result == Extracted(text="hello", mime="text/plain", pages=None)
    with pytest.raises(AttributeError):
        result.text = "changed"  # type: ignore[misc]
