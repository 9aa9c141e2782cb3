"""Origins (scheme, host, port) of URLs: what stored credentials are bound to."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class HttpURL:
    """An http(s) URL split once: the scheme and host lower-cased, the port always known."""

    scheme: str
    host: str  # without the brackets of an IPv6 literal
    port: int
    parts: SplitResult

    @property
    def url_host(self) -> str:
        """The host as a URL writes it: an IPv6 literal in brackets."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def netloc(self) -> str:
        """``host[:port]`` as a URL writes it, without a default port."""
        if self.port == DEFAULT_PORTS[self.scheme]:
            return self.url_host
        return f"{self.url_host}:{self.port}"


def split_http_url(url: str) -> HttpURL | None:
    """``url`` (stripped) split, or None when it is not an http(s) URL with a host and valid port."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    port = port if port is not None else DEFAULT_PORTS[scheme]
    return HttpURL(scheme, parts.hostname.lower(), port, parts)


def origin_of(url: str) -> str:
    """``scheme://host:port`` with the port always written, lower-case; "" if not http(s).

    Two URLs share an origin exactly when these strings are equal, so ``http://A``,
    ``http://a:80/x`` and ``http://a/`` all give ``http://a:80``.
    """
    split = split_http_url(url)
    if split is None:
        return ""
    return f"{split.scheme}://{split.url_host}:{split.port}"
