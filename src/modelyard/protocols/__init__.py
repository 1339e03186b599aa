"""Wire formats: what each protocol's request carries for routing, and its error envelope."""

from modelyard.protocols.envelope import error_body, protocol_for_path

__all__ = ["error_body", "protocol_for_path"]
