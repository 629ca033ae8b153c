"""Visible text of HTML (with lxml) and of Markdown (with markdown-it-py), and HTML sniffing.

Both functions take already-decoded text and return text that :func:`tasks.files.extract.normalize`
finishes: block elements end lines, paragraphs are separated by a blank line, table cells by tabs.
"""

from __future__ import annotations

import re
from typing import Literal

from lxml import etree
from markdown_it import MarkdownIt
from markdown_it.token import Token

# --------------------------------------------------------------------------------------------------
# Sniffing
# --------------------------------------------------------------------------------------------------

# Elements that make a whole page: a document starting with one of them (or a doctype) is HTML whatever
# it is called.
_PAGE_ELEMENTS = frozenset({"html", "head", "body", "meta", "title", "link", "base"})
# Elements a saved fragment or an HTML e-mail body typically starts with.
_FRAGMENT_ELEMENTS = frozenset(
    {
        "a", "abbr", "address", "article", "aside", "b", "blockquote", "br", "button", "caption",
        "center", "code", "dd", "details", "dialog", "div", "dl", "dt", "em", "fieldset", "figure",
        "font", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "i", "iframe",
        "img", "label", "li", "main", "nav", "noscript", "ol", "p", "pre", "script", "section",
        "small", "span", "strong", "style", "sub", "summary", "sup", "table", "tbody", "td",
        "template", "thead", "th", "tr", "u", "ul",
    }
)  # fmt: skip
_SPACE = re.compile(r"\s*")
_START = re.compile(r"<!doctype\s+html(?![\w-])|<([a-z][a-z0-9]*)(?=[\s/>]|$)", re.IGNORECASE)


def html_start(text: str) -> Literal["page", "fragment"] | None:
    """How ``text`` starts: an HTML ``page``, an HTML ``fragment`` or neither (``None``).

    Whitespace, comments (``<!-- saved from url=... -->``) and processing instructions (an
    ``<?xml ...?>`` prolog) are skipped first; then a ``<!DOCTYPE html ...>`` or a page element
    (``<html>``, ``<head>``, ``<body>``, ``<meta>``...) makes a page, and another known HTML element
    (``<div>``, ``<p>``, ``<table>``...) a fragment. A ``<b>`` later in the text decides nothing.
    """
    position = 0
    while True:
        position = _SPACE.match(text, position).end()  # type: ignore[union-attr]  # always matches
        for opening, closing in (("<!--", "-->"), ("<?", ">")):
            if text.startswith(opening, position):
                end = text.find(closing, position + len(opening))
                if end == -1:
                    return None
                position = end + len(closing)
                break
        else:
            break
    start = _START.match(text, position)
    if start is None:
        return None
    element = (start.group(1) or "html").lower()
    if element in _PAGE_ELEMENTS:
        return "page"
    return "fragment" if element in _FRAGMENT_ELEMENTS else None


# --------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------

_SKIPPED = frozenset({"script", "style", "head", "template", "noscript"})
_PARAGRAPHS = frozenset(
    {"p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "table", "ul", "ol", "dl", "figure"}
)
_LINES = frozenset(
    {
        "div", "li", "tr", "section", "article", "header", "footer", "nav", "aside", "main",
        "hr", "dt", "dd", "figcaption", "caption", "form", "fieldset", "address", "details",
        "summary", "title", "body", "html", "option", "legend",
    }
)  # fmt: skip
_CELLS = frozenset({"td", "th"})
_HTML_SPACE = re.compile(r"[ \t\n\r\f]+")
# Control characters (except tab and line breaks) are dropped before parsing: libxml2 would turn them
# into replacement characters. ``normalize`` removes the rest later.
_PARSE_CONTROLS = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f]")


def _html_parser() -> etree.HTMLParser:
    # huge_tree: without it libxml2 silently drops every text node over 10 MB (and everything after it)
    # and stops at a nesting depth of 256 instead of 2048. Deeper content is dropped either way, which
    # is what keeps hostile nesting cheap. The HTML parser never fetches or expands external entities.
    return etree.HTMLParser(
        encoding="utf-8", remove_comments=True, remove_pis=True, no_network=True, huge_tree=True
    )


class _Collector:
    """Visible text: block elements become line breaks, whitespace collapses as in a browser."""

    def __init__(self) -> None:
        self.parts: list[str] = []
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

    def start(self, tag: str) -> None:
        if tag == "br":
            self.parts.append("\n")
        elif tag in _PARAGRAPHS:
            self._break(2)
        elif tag in _LINES:
            self._break(1)
        elif tag in _CELLS and not self._ends_line():
            self.parts.append("\t")
        if tag == "pre":
            self._pre += 1

    def end(self, tag: str) -> None:
        if tag in _PARAGRAPHS:
            self._break(2)
        elif tag in _LINES:
            self._break(1)
        if tag == "pre" and self._pre:
            self._pre -= 1

    def data(self, data: str | None) -> None:
        if not data:
            return
        if not self._pre:
            data = _HTML_SPACE.sub(" ", data)
            if self._ends_line() or self.parts[-1].endswith((" ", "\t")):
                data = data.lstrip(" ")
        if data:
            self.parts.append(data)


def html_text(text: str) -> str:
    """The visible text of an HTML page or fragment.

    ``<script>``, ``<style>``, ``<template>``, ``<noscript>`` and the whole ``<head>`` (its
    ``<title>`` too) are skipped; entities are decoded; ``<pre>`` keeps its whitespace. lxml (libxml2)
    parses in linear time whatever the markup, closing what is never closed as a browser does.
    """
    data = _PARSE_CONTROLS.sub("", text).encode("utf-8", errors="replace")
    root = etree.fromstring(data, _html_parser()) if data.strip() else None
    if root is None:
        return ""
    out = _Collector()
    skipping: etree._Element | None = None  # the outermost skipped element we are inside
    for event, element in etree.iterwalk(root, events=("start", "end")):
        tag = element.tag
        if not isinstance(tag, str):  # an entity reference libxml2 kept as a node
            if event == "end" and skipping is None:
                out.data(element.tail)
            continue
        tag = tag.lower()
        if event == "start":
            if skipping is None and tag in _SKIPPED:
                skipping = element
            elif skipping is None:
                out.start(tag)
                out.data(element.text)
            continue
        if skipping is element:
            skipping = None
        elif skipping is None:
            out.end(tag)
        if skipping is None:
            out.data(element.tail)
    return "".join(out.parts)


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------

# CommonMark plus GFM tables and strikethrough. Inline content is parsed block by block below (the
# core "inline" rule is off), so that a document-wide budget can bound the work.
_MARKDOWN = MarkdownIt("commonmark").enable(["table", "strikethrough"]).disable("inline")
# markdown-it-py is linear but costs up to ~10 µs per character that may open inline syntax ("[[[[..."
# for a megabyte takes 10 s). Once a document has had this many such characters parsed, the rest of its
# inline content is kept verbatim, syntax and all: a hostile file stays fast, a real one never gets here.
_INLINE_BUDGET = 100_000
_INLINE_SPECIALS = re.compile(r"[\[\]*_`<>!~&\\]")
_BLOCK_ENDS = {
    "paragraph_close": "\n\n",
    "heading_close": "\n\n",
    "tr_close": "\n",
    "table_close": "\n",
    "list_item_close": "\n",
    "bullet_list_close": "\n",
    "ordered_list_close": "\n",
    "blockquote_close": "\n",
    "hr": "\n\n",
}


def markdown_text(text: str) -> str:
    """The text of a Markdown document without its syntax.

    Headings, paragraphs and list items are lines; code spans and blocks are kept verbatim; a link
    keeps its text and loses its URL; an image becomes its alt text; table cells are tab-separated;
    raw HTML blocks are reduced to their visible text and inline tags dropped.
    """
    env: dict[str, object] = {}
    parts: list[str] = []
    budget = _INLINE_BUDGET
    in_row = False
    # CommonMark turns NUL into U+FFFD; control characters go first, as for HTML.
    for token in _MARKDOWN.parse(_PARSE_CONTROLS.sub("", text), env):
        kind = token.type
        if kind == "inline":
            specials = len(_INLINE_SPECIALS.findall(token.content))
            if in_row and parts and not parts[-1].endswith("\n"):
                parts.append("\t")
            if specials > budget:
                budget = 0
                parts.append(token.content)
                continue
            budget -= specials
            children: list[Token] = []
            _MARKDOWN.inline.parse(token.content, _MARKDOWN, env, children)
            parts.append(_inline_text(children))
        elif kind in ("fence", "code_block"):
            parts.append(token.content + "\n")
        elif kind == "html_block":
            parts.append(html_text(token.content) + "\n\n")
        elif kind == "tr_open":
            in_row = True
        elif kind in _BLOCK_ENDS:
            in_row = in_row and kind != "tr_close"
            if token.hidden:  # the paragraph of a tight list item
                continue
            parts.append(_BLOCK_ENDS[kind])
    return "".join(parts)


def _inline_text(tokens: list[Token]) -> str:
    out: list[str] = []
    for token in tokens:
        if token.type in ("text", "text_special", "code_inline"):
            out.append(token.content)
        elif token.type in ("softbreak", "hardbreak"):
            out.append("\n")
        elif token.type == "image":
            out.append(_inline_text(token.children or []))
    return "".join(out)
