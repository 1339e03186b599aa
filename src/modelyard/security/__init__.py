"""Security at the edges, below the I/O adapters that use it: TLS contexts built from certificate
files and reloaded when they change (`tls.py`), for serving/, upstream/ and rpc/ alike."""

from modelyard.security.tls import ClientTls, ServerTls, TlsError

__all__ = ["ClientTls", "ServerTls", "TlsError"]
