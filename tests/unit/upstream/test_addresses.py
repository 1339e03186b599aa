"""Which addresses a model download may connect to: an IPv4 address written inside an IPv6 one is
judged as the IPv4 address it carries, whichever of the forms it is written in (issue 28 item 4).

Before: `::127.0.0.1` (IPv4-compatible), `::ffff:0:7f00:1` (IPv4-translated) and local-use NAT64
(`64:ff9b:1::/48`) were judged as IPv6 addresses, global ones, and allowed by default."""

from __future__ import annotations

import ipaddress

import pytest

from modelyard.upstream.addresses import AddressPolicy, AddressRefused
from modelyard.upstream.download import check_url

HTTP = frozenset({"http", "https"})


@pytest.mark.parametrize(
    ("host", "kind"),
    [
        ("::127.0.0.1", "loopback"),  # IPv4-compatible
        ("::169.254.169.254", "cloud metadata"),
        ("::10.0.0.1", "private"),
        ("::ffff:0:7f00:1", "loopback"),  # IPv4-translated, ::ffff:0:127.0.0.1
        ("::ffff:0:a9fe:a9fe", "cloud metadata"),
        ("64:ff9b:1::7f00:1", "loopback"),  # local-use NAT64, a /96 prefix
        ("64:ff9b:1::a9fe:a9fe", "cloud metadata"),
        ("64:ff9b:1:0:a9:fea9:fe00:0", "cloud metadata"),  # a /64 prefix: bits 72-103
        ("64:ff9b:1:a9:fe:a9fe::", "cloud metadata"),  # a /56 prefix: bits 56-63 and 72-95
        ("64:ff9b:1:a9fe:a9:fe00::", "cloud metadata"),  # a /48 prefix: bits 48-63 and 72-87
        # the forms that were judged so already
        ("::ffff:127.0.0.1", "loopback"),
        ("64:ff9b::7f00:1", "loopback"),
        ("2002:7f00:1::1", "loopback"),
    ],
)
def test_an_ipv4_address_inside_an_ipv6_one_is_judged_as_that_ipv4_address(host, kind):
    article = "an" if kind[0] in "aeiou" else "a"
    assert AddressPolicy().refusal(host) == f"{host}, {article} {kind} address"
    with pytest.raises(AddressRefused, match="allowed only"):
        check_url(f"http://[{host}]:8080/model.bin", HTTP, AddressPolicy())


def test_metadata_carried_anywhere_stays_refused_with_allow_private():
    private = AddressPolicy(allow_private=True)
    for host in (
        "::169.254.169.254",
        "::ffff:0:a9fe:a9fe",
        "64:ff9b:1::a9fe:a9fe",
        "64:ff9b:1:a9fe:a9:fe00::",
    ):
        assert private.refusal(host) == f"{host}, a cloud metadata address"
    assert private.refusal("::127.0.0.1") is None and private.refusal("64:ff9b:1::7f00:1") is None


def test_ipv6s_own_loopback_and_unspecified_stay_what_they_are():
    assert AddressPolicy().refusal("::1") == "::1, a loopback address"
    assert AddressPolicy().refusal("::") == "::, an unspecified address"


def test_a_global_ipv4_address_carried_is_allowed_and_local_use_nat64_only_when_every_place_is():
    assert AddressPolicy().refusal("::ffff:0:5db8:d70e") is None  # 93.184.215.14
    assert AddressPolicy().refusal("64:ff9b::5db8:d70e") is None
    # Local-use NAT64 is the site's own translator, whose prefix length the agent cannot know:
    # with a /96 prefix the /48 places hold zeros (0.0.0.0), so it is refused unless allowed.
    assert AddressPolicy().refusal("64:ff9b:1::5db8:d70e") is not None
    assert AddressPolicy(allow_private=True).refusal("64:ff9b:1::5db8:d70e") is None
    listed = AddressPolicy(networks=(ipaddress.ip_network("64:ff9b:1::/48"),))
    assert listed.refusal("64:ff9b:1::a9fe:a9fe") is None  # named, so allowed, metadata included


@pytest.mark.parametrize("host", ["5f00::1", "3fff::1"])
def test_ranges_python_311_counts_as_global_are_refused(host):
    assert AddressPolicy().refusal(host) == f"{host}, a non-global address"
