"""Validation of rendered manifests: Kubernetes' own kinds against its schemas (kubernetes-validate,
strict), and cert-manager's `Issuer` and `Certificate` (which kubernetes-validate has no schema for)
against the fields of cert-manager's v1 API the render uses, written out here from its API
reference: unknown fields refused (as strict validation does), enums and required fields, and the
rules cert-manager's webhook adds (durations of at least an hour, renewBefore within duration, an
ECDSA key of 256, 384 or 521 bits, a common name of at most 64 characters)."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import kubernetes_validate

CERT_MANAGER = "cert-manager.io/v1"
_STRINGS = {"type": "array", "items": {"type": "string", "minLength": 1}}
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_GO_DURATION = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "namespace"],
    "properties": {
        "name": _NAME,
        "namespace": _NAME,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
    "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
]  # fmt: skip
_ISSUER_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {"name": _NAME, "kind": {"type": "string"}, "group": {"type": "string"}},
}


def _kind(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": CERT_MANAGER},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


CERTIFICATE = _kind(
    "Certificate",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["secretName", "issuerRef"],
        "anyOf": [{"required": [field]} for field in ("commonName", "dnsNames", "uris", "ipAddresses")],
        "properties": {
            "secretName": _NAME,
            "commonName": {"type": "string", "minLength": 1, "maxLength": 64},
            "dnsNames": _STRINGS,
            "ipAddresses": _STRINGS,
            "uris": _STRINGS,
            "isCA": {"type": "boolean"},
            "duration": {"type": "string", "pattern": _GO_DURATION},
            "renewBefore": {"type": "string", "pattern": _GO_DURATION},
            "usages": {"type": "array", "items": {"enum": _USAGES}, "uniqueItems": True},
            "privateKey": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                },
            },
            "issuerRef": _ISSUER_REF,
        },
    },
)
ISSUER = _kind(
    "Issuer",
    {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "maxProperties": 1,  # one kind of issuer each
        "properties": {
            "selfSigned": {"type": "object", "additionalProperties": False, "properties": {}},
            "ca": {
                "type": "object",
                "additionalProperties": False,
                "required": ["secretName"],
                "properties": {"secretName": _NAME},
            },
        },
    },
)
SCHEMAS = {"Certificate": CERTIFICATE, "Issuer": ISSUER}


class InvalidManifest(AssertionError):
    pass


def validate(doc: dict[str, Any], version: str) -> None:
    """InvalidManifest naming the object and the problem, if `doc` would be refused."""
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if doc.get("apiVersion") == CERT_MANAGER:
        schema = SCHEMAS.get(doc.get("kind", ""))
        if schema is None:
            raise InvalidManifest(f"{where}: no schema for this cert-manager kind")
        try:
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError as error:
            raise InvalidManifest(f"{where}: {error.message} at {list(error.path)}") from None
        if doc["kind"] == "Certificate":
            _certificate_rules(doc["spec"], where)
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)  # strict: no unknown field
    except kubernetes_validate.ValidationError as error:
        raise InvalidManifest(f"{where}: {error.message} at {list(error.path)}") from None


def _hours(duration: str) -> float:
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    seconds = sum(
        float(n) * units[u] for n, _, u in re.findall(r"([0-9]+(\.[0-9]+)?)(ns|us|µs|ms|s|m|h)", duration)
    )
    return seconds / 3600


def _certificate_rules(spec: dict[str, Any], where: str) -> None:
    key = spec.get("privateKey", {})
    if key.get("algorithm") == "ECDSA" and key.get("size", 256) not in (256, 384, 521):
        raise InvalidManifest(f"{where}: an ECDSA key is 256, 384 or 521 bits")
    duration = _hours(spec.get("duration", "2160h"))
    if duration < 1:
        raise InvalidManifest(f"{where}: duration under an hour")
    if "renewBefore" in spec and not 5 / 60 <= _hours(spec["renewBefore"]) < duration:
        raise InvalidManifest(f"{where}: renewBefore must be at least 5m and below duration")
