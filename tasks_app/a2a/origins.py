"""Origins (scheme, host, port) of URLs: what stored credentials are bound to."""

from __future__ import annotations

from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: str) -> str:
    """``scheme://host:port`` with the port always written, lower-case; "" if not http(s).

    Two URLs share an origin exactly when these strings are equal, so ``http://A``,
    ``http://a:80/x`` and ``http://a/`` all give ``http://a:80``.
    """
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return ""
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return ""
    host = parts.hostname.lower()
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"{scheme}://{host}:{port if port is not None else DEFAULT_PORTS[scheme]}"
