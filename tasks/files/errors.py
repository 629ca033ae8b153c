"""Errors of the files family, each mapped onto the platform's retry policy."""

from __future__ import annotations

from conveyor.errors import ConfigurationError, PermanentError, TransientError


class FileRejected(PermanentError):
    """The file cannot be processed as it is; retrying will not help."""


class UnsupportedFile(FileRejected):
    """The content is of a type we do not extract (detected from the bytes, not the name)."""


class CorruptFile(FileRejected):
    """The file claims a format but cannot be parsed."""


class EncryptedPdf(FileRejected):
    """The PDF is password-protected."""


class EmptyDocument(FileRejected):
    """The file holds no text once parsed: zero bytes, only whitespace, an HTML page with nothing
    visible, a DOCX without paragraphs. The message starts with "no text found"."""


class NoTextLayer(EmptyDocument):
    """The document has no extractable text (a scan); OCR is not supported."""


class DocumentTooComplex(FileRejected):
    """Extracting the document would take more memory or time than a worker may spend, or its structure
    says it would: a decompression bomb (a DOCX or PDF stream that unpacks out of all proportion to the
    file), an XML entity declaration, too many ZIP members or a page tree nested too deeply. The message
    starts with "document too complex"."""


class FileTooLarge(FileRejected):
    """Over the configured size limit."""


class TooManyPages(FileRejected):
    """Over the configured page limit."""


class StorageUnavailable(TransientError):
    """The storage backend failed or timed out; the stage is retried with backoff."""


class EmbeddingUnavailable(TransientError):
    """The embedding service failed, timed out or answered 5xx; retried with backoff."""


class EmbeddingRejected(PermanentError):
    """The embedding service refused the request (4xx) or answered nonsense."""


class ContentMissing(FileRejected):
    """The referenced content does not exist in storage."""


class UploadInterrupted(TransientError):
    """The content's source failed before it ended (a dropped client): upload it again."""


class EmbeddingModelMismatch(PermanentError):
    """Stored vectors come from another model than the one search embeds queries with:
    comparing them would give meaningless scores. Re-embed (``conveyor files reembed``)."""


class UnknownEmbedder(ConfigurationError, ValueError):
    """The configured embedder is none that Conveyor knows (``CONVEYOR_FILES``' ``embedder``)."""


class EmbedderMissing(ConfigurationError, RuntimeError):
    """The configured embedder's package is not installed."""
