"""The HTTP client every trading peer client uses: no automatic retries (the stage decides
what a failure means), the process's one TLS context, and no settings read from the
environment (Conveyor's settings are its only configuration; reading the proxy variables
also costs each new client a TLS context of its own, tens of milliseconds).
"""

from __future__ import annotations

import ssl
import threading

import httpx

_lock = threading.Lock()
_context: ssl.SSLContext | None = None


def tls_context() -> ssl.SSLContext:
    """This process's TLS context (certifi's roots), made once."""
    global _context
    if _context is None:
        with _lock:
            if _context is None:
                _context = httpx.create_ssl_context()
    return _context


def http_client(timeout: float, base_url: str = "") -> httpx.Client:
    """A new client (of ``base_url``): ``timeout`` seconds per request, never retried by itself."""
    context = tls_context()
    return httpx.Client(
        base_url=base_url,
        timeout=timeout,
        verify=context,
        trust_env=False,
        transport=httpx.HTTPTransport(retries=0, verify=context),
    )


__all__ = ["http_client", "tls_context"]
