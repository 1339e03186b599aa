"""Which addresses a model download may connect to, checked on the address it connects to.

A storageUri is written by whoever may apply a model, and the agent fetches it from inside the
cluster: without a check, `http://169.254.169.254/...` reads the cloud's instance metadata (its
credentials), and `http://127.0.0.1:<port>/...` reaches whatever listens on the agent's host.
So by default a download connects only to global unicast addresses; refused are loopback,
private (RFC 1918, IPv6 unique local `fc00::/7`), link-local, shared (`100.64.0.0/10`),
unspecified, multicast and reserved addresses (SRv6 `5f00::/16` and documentation `3fff::/20`
too, which older Pythons count as global), an IPv4 address written inside an IPv6 one judged as
that IPv4 address (`_carried`: IPv4-mapped `::ffff:127.0.0.1`, IPv4-compatible `::127.0.0.1`,
IPv4-translated `::ffff:0:127.0.0.1`, 6to4, Teredo, NAT64's `64:ff9b::/96` and the local-use
`64:ff9b:1::/48`, whose IPv4 address may sit at any of RFC 6052's places for a /48 to /96 prefix,
so every place is judged and all must pass), and the cloud metadata endpoints (`CLOUD_METADATA`,
among them Azure's, which is a global address).

`allow_private` allows the non-global addresses (an artefact store inside the cluster) but still
not the metadata endpoints; `networks` allows exactly the addresses in them, metadata included.

The check is made on what the name resolves to, in the resolver the connection uses
(`CheckingResolver`): the addresses checked are the addresses connected to, so a name that
resolves to a public address when checked and to 127.0.0.1 when connected (DNS rebinding) cannot
slip through; every connection, each redirect's included, resolves and checks anew. An address
written in the URL itself is checked with `refusal` before the request (aiohttp does not resolve
those).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from modelyard.errors import ModelyardError

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network

# Instance metadata services (credentials live there). Most sit in link-local or private ranges,
# refused anyway; Azure's WireServer (168.63.129.16) is a global address and would not be.
CLOUD_METADATA: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.169.254/32",  # AWS, GCP, Azure IMDS, OpenStack, DigitalOcean, Oracle
        "169.254.170.2/32",  # AWS ECS task metadata and credentials
        "fd00:ec2::254/128",  # AWS IMDS over IPv6
        "168.63.129.16/32",  # Azure WireServer
        "100.100.100.200/32",  # Alibaba Cloud
        "192.0.0.192/32",  # Oracle Cloud (legacy)
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215, a translator of the site's own
# IANA special-purpose ranges not globally reachable that Python 3.11's tables call global.
_NOT_GLOBAL: tuple[Network, ...] = (
    ipaddress.ip_network("5f00::/16"),  # SRv6 SIDs, RFC 9602
    ipaddress.ip_network("3fff::/20"),  # documentation, RFC 9637
)


class AddressRefused(ModelyardError):
    """A download that would connect to an address the agent does not allow."""


def _carried(address: Address) -> tuple[Address, ...]:
    """The IPv4 addresses an IPv6 one carries, where the packets would go (mapped, compatible,
    translated, 6to4, Teredo, NAT64); (address,) when it carries none. Local-use NAT64 gives one
    per place its prefix length (/96, /64, /56, /48; RFC 6052 skips bits 64-71) could put it, the
    usual /96 first (so a refusal names that one)."""
    if not isinstance(address, IPv6Address):
        return (address,)
    value = int(address)
    if address.ipv4_mapped is not None:  # ::ffff:a.b.c.d
        return (address.ipv4_mapped,)
    if value >> 32 == 0xFFFF0000:  # ::ffff:0:a.b.c.d, IPv4-translated (RFC 2765)
        return (IPv4Address(value & 0xFFFFFFFF),)
    if value >> 32 == 0 and value > 1:  # ::a.b.c.d, IPv4-compatible (not :: or ::1, IPv6's own)
        return (IPv4Address(value),)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        return (address.teredo[1],)
    if address in _NAT64:
        return (IPv4Address(value & 0xFFFFFFFF),)
    if address in _LOCAL_NAT64:
        b = address.packed
        places = (b[12:16], b[9:13], b[7:8] + b[9:12], b[6:8] + b[9:11])  # /96, /64, /56, /48
        return tuple(IPv4Address(place) for place in places)
    return (address,)


def _kind(address: Address) -> str:
    """What a non-global address is, in words."""
    if any(address in n for n in CLOUD_METADATA):
        return "cloud metadata"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    if address.is_private:
        return "private"
    return "non-global"


@dataclass(frozen=True)
class AddressPolicy:
    """Where downloads may connect: global addresses, plus what `allow_private` and `networks` add."""

    allow_private: bool = False
    networks: tuple[Network, ...] = ()

    def refusal(self, host: str) -> str | None:
        """What is wrong with connecting to the IP address `host` ("127.0.0.1, a loopback
        address"), or None when it is allowed."""
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone is not the address
        except ValueError:
            return f"{host}, not an IP address"
        inner = _carried(address)  # where the packets go, for an IPv4 address inside an IPv6 one
        if any(address in n for n in self.networks) or all(any(a in n for n in self.networks) for a in inner):
            return None
        if any(a in n for n in CLOUD_METADATA for a in (address, *inner)):
            return f"{host}, a cloud metadata address"
        if self.allow_private:
            return None
        for a in inner:
            if not a.is_global or any(a in n for n in _NOT_GLOBAL):
                kind = _kind(a)
                return f"{host}, {'an' if kind[0] in 'aeiou' else 'a'} {kind} address"
        return None


REMEDY = "allowed only with --allow-private-fetch or a network in --fetch-network"
METADATA_REMEDY = "allowed only by a network in --fetch-network"


def remedy(refusal: str) -> str:
    """What allows an address refused for `refusal` (metadata endpoints need to be named)."""
    return METADATA_REMEDY if refusal.endswith("cloud metadata address") else REMEDY


class CheckingResolver(AbstractResolver):
    """Resolves a name once and returns only the addresses the policy allows, for aiohttp to
    connect to; AddressRefused when none is. Used with `use_dns_cache=False`, so every new
    connection resolves and is checked again."""

    def __init__(self, policy: AddressPolicy) -> None:
        self._policy = policy
        self._inner = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        allowed = [r for r in found if self._policy.refusal(r["host"]) is None]
        if not allowed:
            why = self._policy.refusal(found[0]["host"]) if found else None
            if why is None:
                raise AddressRefused(f"{host} resolves to no address")
            raise AddressRefused(f"{host} resolves to {why}: {remedy(why)}")
        return allowed

    async def close(self) -> None:
        await self._inner.close()
