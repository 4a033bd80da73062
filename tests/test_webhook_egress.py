"""The webhook egress policy (gateway/jobs/egress.py): --webhook-allow patterns, the submit-time URL check and the
delivery-time resolution, on the URLs an SSRF attempt would use."""
from __future__ import annotations

import ipaddress

import pytest

from gateway.jobs.egress import OFF_MESSAGE, EgressPolicy, EgressRefused, EgressUnresolved, is_public


def refusal(policy: EgressPolicy, url: str) -> str:
    with pytest.raises(EgressRefused) as e:
        policy.check_url(url)
    return e.value.message


@pytest.mark.parametrize("pattern", [
    "*.example.com", "hooks.example.com", "https://hooks.example.com:8443", "http://hooks.example.com",
    "127.0.0.1", "http://127.0.0.1:8080", "10.0.0.0/8", "[::1]", "[::1]:8443", "[fd00::/8]", "fd00::/8",
    "https://hooks.example.com/", "*",
])
def test_good_patterns_parse(pattern: str) -> None:
    assert EgressPolicy.from_patterns([pattern]).enabled


@pytest.mark.parametrize(("pattern", "why"), [
    ("ftp://hooks.example.com", "scheme"),
    ("https://", "no host"),
    ("10.0.0.1/8", "not an IP address or network"),  # host bits set: a mistyped network
    ("300.1.2.3", "not an IP address or network"),
    ("exa mple.com", "not a hostname glob"),
    ("a?.example.com", "not a hostname glob"),
    ("hooks.example.com:99999", "port"),
    ("hooks.example.com:http", "port"),
    ("[::1", "unclosed"),
    ("[1.2.3.4]", "brackets are for IPv6"),
    ("https://hooks.example.com/path", "no path"),
])
def test_bad_patterns_name_themselves(pattern: str, why: str) -> None:
    with pytest.raises(ValueError) as e:
        EgressPolicy.from_patterns(["*.example.com", pattern])
    assert repr(pattern) in str(e.value) and why in str(e.value)


def test_no_pattern_refuses_every_url() -> None:
    policy = EgressPolicy.from_patterns([])
    assert not policy.enabled
    for url in ("https://hooks.example.com/x", "https://8.8.8.8/", "http://127.0.0.1/"):
        assert refusal(policy, url) == OFF_MESSAGE


# Any public hostname, and one public network by address: what an operator might allow, and what an SSRF attempt
# against it tries.
OPEN = EgressPolicy.from_patterns(["*", "8.8.8.0/24"])


@pytest.mark.parametrize("url", [
    "https://127.0.0.1/hook", "https://127.0.0.1:8443/", "https://[::1]/", "https://169.254.169.254/latest/meta-data",
    "https://10.0.0.5/", "https://192.168.1.1/", "https://172.16.0.1/", "https://[::ffff:127.0.0.1]/",
    "https://[::ffff:8.8.8.8]/", "https://0.0.0.0/", "https://[::]/", "https://100.64.0.1/", "https://224.0.0.1/",
    "https://[fe80::1]/", "https://[fd00::1]/", "https://255.255.255.255/",
])
def test_private_and_special_addresses_are_refused(url: str) -> None:
    assert "not allowed by --webhook-allow" in refusal(OPEN, url)


@pytest.mark.parametrize("url", [
    "https://2130706433/", "https://127.1/", "https://0x7f.0.0.1/", "https://0177.0.0.1/", "https://1.2.3.4.5/",
])
def test_numeric_forms_of_addresses_are_refused(url: str) -> None:
    # A resolver reads these as 127.0.0.1 (or refuses them); they are no hostname a pattern could mean.
    assert "neither a hostname nor a canonical IP address" in refusal(OPEN, url)


@pytest.mark.parametrize(("url", "why"), [
    ("file:///etc/passwd", "must be an https URL"),
    ("gopher://hooks.example.com:70/_GET", "must be an https URL"),
    ("ftp://hooks.example.com/", "must be an https URL"),
    ("http://hooks.example.com/", "must be an https URL"),  # OPEN's patterns say no http://
    ("https://user:pw@hooks.example.com/", "user name or password"),
    ("https://hooks.example.com@127.0.0.1/", "user name or password"),
    ("https://hooks.example.com\\@127.0.0.1/", "backslashes"),
    ("https://hooks.example.com /", "without spaces"),
    ("https://hooks.exa\tmple.com/", "without spaces"),
    ("https://bücher.example/", "xn-- form"),
    ("https://hooks.example.com/#frag", "fragment"),
    ("https:///path", "no host"),
    ("https://[::1/", "not a valid URL"),
    ("https://hooks.example.com:99999/", "not a valid URL"),
    ("https://hooks.example.com:0/", "from 1 to 65535"),
    ("https://under%73core.example.com/", "not a valid hostname"),
    ("https://" + "a" * 64 + ".example.com/", "not a valid hostname"),
    ("https://hooks.example.com/" + "a" * 2048, "longer than 2048"),
    ("https://[fe80::1%25eth0]/", "zone"),
])
def test_malformed_urls_are_refused(url: str, why: str) -> None:
    assert why in refusal(OPEN, url)


def test_addresses_named_by_a_pattern_are_allowed() -> None:
    policy = EgressPolicy.from_patterns(["127.0.0.1", "[::1]:8443", "10.0.0.0/8", "http://192.168.7.7:8080"])
    target = policy.check_url("https://127.0.0.1:9999/hook?x=1")
    assert (target.scheme, target.host, target.port, target.path, target.query) == \
        ("https", "127.0.0.1", 9999, "/hook", "x=1")
    assert target.ip == ipaddress.ip_address("127.0.0.1")
    assert policy.check_url("https://[::1]:8443/").netloc_host == "[::1]"
    assert "not allowed" in refusal(policy, "https://[::1]/")  # port 443, the pattern names 8443
    assert policy.check_url("https://10.200.3.4/").ip == ipaddress.ip_address("10.200.3.4")
    assert "not allowed" in refusal(policy, "https://192.168.1.1/")
    assert policy.check_url("http://192.168.7.7:8080/").scheme == "http"
    assert policy.check_url("https://192.168.7.7:8080/").scheme == "https"  # http:// admits TLS too
    assert "not allowed" in refusal(policy, "https://localhost/")  # IP patterns admit no hostname
    # An address written in a URL needs an address pattern, even a public one: a hostname glob names hostnames.
    assert "not allowed" in refusal(EgressPolicy.from_patterns(["*"]), "https://8.8.8.8/")
    assert OPEN.check_url("https://8.8.8.8/").ip == ipaddress.ip_address("8.8.8.8")


def test_hostname_patterns() -> None:
    policy = EgressPolicy.from_patterns(["*.example.com", "https://hooks.example.org:8443"])
    for url in ("https://a.example.com/", "https://a.b.example.com/x", "https://A.Example.COM/", "https://a.example.com./",
                "https://a.example.com:8080/", "https://hooks.example.org:8443/"):
        assert policy.check_url(url).scheme == "https", url
    for url in ("https://example.com/", "https://evilexample.com/", "https://example.com.evil.org/",
                "https://hooks.example.org/", "https://hooks.example.org:8444/", "https://other.example.org:8443/"):
        assert "not allowed" in refusal(policy, url), url
    assert refusal(policy, "http://a.example.com/") == "webhook_url must be an https URL"
    assert policy.check_url("https://a.example.com/").host == "a.example.com"


def test_public_addresses() -> None:
    public = ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888", "64:ff9b::808:808", "2002:808:808::1"]
    special = ["127.0.0.1", "10.1.2.3", "172.31.0.1", "192.168.0.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
               "224.0.0.251", "240.0.0.1", "255.255.255.255", "192.0.2.1", "::1", "::", "fe80::1", "fc00::1",
               "ff02::1", "::ffff:8.8.8.8", "::ffff:127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::1",
               "2001:0:4136:e378:8000:63bf:3fff:fdd2"]  # Teredo
    assert [a for a in public if not is_public(ipaddress.ip_address(a))] == []
    assert [a for a in special if is_public(ipaddress.ip_address(a))] == []


def test_each_resolved_address_is_checked() -> None:
    policy = EgressPolicy.from_patterns(["*.example.com", "10.9.0.0/16"])
    target = policy.check_url("https://hooks.example.com/")
    assert policy.address_allowed(target, ipaddress.ip_address("93.184.216.34"))
    assert policy.address_allowed(target, ipaddress.ip_address("10.9.1.1"))  # named by a pattern
    for addr in ("10.8.0.1", "127.0.0.1", "169.254.169.254", "::ffff:93.184.216.34", "fd00::1"):
        assert not policy.address_allowed(target, ipaddress.ip_address(addr)), addr


async def test_a_hostname_resolving_to_loopback_is_refused() -> None:
    # localhost resolves to a loopback address: a hostname pattern admits public addresses only.
    policy = EgressPolicy.from_patterns(["localhost"])
    target = policy.check_url("https://localhost:8443/hook")
    with pytest.raises(EgressRefused) as e:
        await policy.resolve(target)
    assert "resolves to" in e.value.message and "127.0.0.1" in e.value.message


async def test_an_address_pattern_admits_a_hostname_resolving_to_it() -> None:
    policy = EgressPolicy.from_patterns(["localhost", "127.0.0.1"])
    assert await policy.resolve(policy.check_url("https://localhost:8443/")) == ipaddress.ip_address("127.0.0.1")
    # A literal address is its own resolution.
    assert await policy.resolve(policy.check_url("https://127.0.0.1/")) == ipaddress.ip_address("127.0.0.1")


async def test_resolution_rechecks_the_url_under_the_current_patterns() -> None:
    # A job submitted under other patterns (the gateway restarted with fewer) is refused at delivery.
    target = EgressPolicy.from_patterns(["*.example.com"]).check_url("https://hooks.example.com/")
    with pytest.raises(EgressRefused):
        await EgressPolicy.from_patterns(["*.example.org"]).resolve(target)


async def test_an_unresolvable_name_may_heal() -> None:
    # .invalid never resolves (RFC 6761); a DNS failure is EgressUnresolved, which a sender retries.
    policy = EgressPolicy.from_patterns(["*.invalid"])
    with pytest.raises(EgressUnresolved):
        await policy.resolve(policy.check_url("https://hooks.invalid/"), timeout=5)
