"""Image URLs reach public addresses only: the gateway's guard against server-side request forgery.

A client's http(s) image URL makes the gateway open a connection wherever the URL points.
`--allowed-media-domains` checks the URL's host *name* only: an allowed name can resolve to the
gateway's loopback, a private network or the cloud's instance metadata (169.254.169.254), and
DNS can answer a name differently from one lookup to the next (rebinding), so a check on an
earlier, separate resolution proves nothing about the connection.

Invariant: every TCP connection the gateway opens for a media URL goes to an address taken
from the single resolution of the URL's host (or its IP literal) made for that connection, and
checked right there: public (globally routable unicast), or inside a network the operator
listed with `--allowed-media-networks`. Addresses that fail the check are never connected to;
a host with no address left is refused (HTTP 400) with a message naming the host, each address
and why. The TLS server name, the certificate check and the Host header stay the URL's name.

Both apply: the domain allow-list (vLLM's, on the name, before any lookup) and this check (on
every address connected to). data: URLs open no connection; file: URLs stay vLLM's
(refused unless --allowed-local-media-path). Redirects are not followed at all (media_limits),
and any connection a redirect would open would pass this same check.

Where it hooks in: vLLM loads its media connector by name from MEDIA_CONNECTOR_REGISTRY
(VLLM_MEDIA_CONNECTOR, its extension point). `guarded_connector_class` is vLLM's own
MediaConnector on a GuardedHTTPConnection, which gateway/vllm_patches.py (`guard_media_urls`)
registers under CONNECTOR_NAME and selects. Its aiohttp client (every async fetch, the serving
path) connects through GuardedTCPConnector, whose host resolution - which aiohttp connects to
exactly, IP literals included - is filtered by the policy; its requests client (vLLM's sync
parser) through urllib3 connections that resolve once, check, and connect to the checked
address. Neither client reads HTTP(S)_PROXY from the environment: through a proxy the address
connected to would be the proxy's, and the image host's would go unchecked.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

import aiohttp
import requests
import urllib3
from urllib3.connection import HTTPConnection as Urllib3HTTPConnection
from urllib3.connection import HTTPSConnection as Urllib3HTTPSConnection
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError

from ttserve.gateway import vllm_compat

vllm_compat.prepare()

from vllm.connections import HTTPConnection  # noqa: E402
from vllm.exceptions import VLLMClientError, VLLMValidationError  # noqa: E402

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# The name vLLM loads the guarded connector by (VLLM_MEDIA_CONNECTOR; set by vllm_patches).
CONNECTOR_NAME = "ttserve-address-guarded"

_v4, _v6 = ipaddress.IPv4Network, ipaddress.IPv6Network
# Non-public networks by kind, first match wins. Explicit rather than ipaddress's is_private /
# is_global, whose answers differ between Python patch releases (3.11.7 calls fec0::/10,
# multicast and 64:ff9b::/96 global). Addresses outside these are still refused unless global.
_IPV4_KINDS: tuple[tuple[IPNetwork, str], ...] = (
    (_v4("0.0.0.0/8"), "unspecified"),  # "this network"; 0.0.0.0 reaches the host itself
    (_v4("127.0.0.0/8"), "loopback"),
    (_v4("169.254.0.0/16"), "link-local"),  # cloud instance metadata: 169.254.169.254
    (_v4("10.0.0.0/8"), "private"),
    (_v4("172.16.0.0/12"), "private"),
    (_v4("192.168.0.0/16"), "private"),
    (_v4("100.64.0.0/10"), "shared (CGNAT)"),
    (_v4("192.0.0.0/24"), "special-purpose"),  # IETF protocol assignments (NAT64 DNS64, DS-Lite)
    (_v4("224.0.0.0/4"), "multicast"),
    (_v4("240.0.0.0/4"), "reserved"),  # 255.255.255.255 (broadcast) too
)
_IPV6_KINDS: tuple[tuple[IPNetwork, str], ...] = (
    (_v6("::/128"), "unspecified"),
    (_v6("::1/128"), "loopback"),
    (_v6("fe80::/10"), "link-local"),
    (_v6("fc00::/7"), "private (unique local)"),
    (_v6("fec0::/10"), "site-local"),
    (_v6("ff00::/8"), "multicast"),
    (_v6("::/8"), "reserved"),  # IPv4-compatible ::a.b.c.d too
)
# IPv6 addresses that carry an IPv4 address which the traffic ends up at: that one is checked.
_NAT64 = _v6("64:ff9b::/96")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[str, ipaddress.IPv4Address] | None:
    if address.ipv4_mapped is not None:
        return "IPv4-mapped", address.ipv4_mapped
    if address in _NAT64:
        return "NAT64", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return "6to4", address.sixtofour
    return None


def non_public_kind(address: IPAddress) -> str | None:
    """What makes `address` non-public, e.g. "loopback", "private", "IPv4-mapped link-local",
    "special-purpose"; None when it is public (globally routable unicast)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            how, ipv4 = embedded
            kind = non_public_kind(ipv4)
            return None if kind is None else f"{how} {kind}"
        table = _IPV6_KINDS
    else:
        table = _IPV4_KINDS
    for network, kind in table:
        if address in network:
            return kind
    return None if address.is_global else "special-purpose"


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind} address"


class MediaAddressRefused(VLLMValidationError):
    """An image URL's host has no address the gateway may connect to: HTTP 400."""


class UnloadableMediaUrl(VLLMValidationError):
    """A media URL that could not be loaded (unreachable, timed out, a scheme not allowed): 400."""


def _unloadable(url: str, error: BaseException) -> str:
    shown = url if len(url) <= 200 else url[:200] + "..."
    reason = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
    return f"the media URL {shown} could not be loaded: {reason}"


class MediaAddressPolicy:
    """Which addresses media URLs may reach: public ones, and those in `allowed_networks`
    (--allowed-media-networks). An IPv6 address carrying an IPv4 one (IPv4-mapped, NAT64, 6to4)
    is allowed when either is in a listed network."""

    def __init__(self, allowed_networks: Sequence[IPNetwork] = ()) -> None:
        self.allowed_networks = tuple(allowed_networks)

    def _listed(self, address: IPAddress) -> bool:
        candidates = [address]
        if isinstance(address, ipaddress.IPv6Address) and (embedded := _embedded_ipv4(address)):
            candidates.append(embedded[1])
        return any(a.version == n.version and a in n for a in candidates for n in self.allowed_networks)

    def refusal(self, address: IPAddress) -> str | None:
        """Why `address` may not be connected to (e.g. "a loopback address"); None if it may."""
        kind = non_public_kind(address)
        if kind is None or self._listed(address):
            return None
        return _a(kind)

    def permitted(self, host: str, addresses: Iterable[str]) -> list[str]:
        """Those of `addresses` (what `host` resolved to, or the IP literal itself) that may be
        connected to, in order. Raises MediaAddressRefused, naming the host and why, when none
        may."""
        addresses = list(dict.fromkeys(addresses))
        if not addresses:
            raise MediaAddressRefused(f"image URL host {host!r} resolves to no address")
        refused = [(a, why) for a in addresses if (why := self.refusal(ipaddress.ip_address(a)))]
        refused_addresses = {a for a, _ in refused}
        allowed = [a for a in addresses if a not in refused_addresses]
        if allowed:
            if refused:
                log.info("image URL host %r: not connecting to %s", host,
                         ", ".join(f"{a} ({why})" for a, why in refused))
            return allowed
        raise MediaAddressRefused(self._describe(host, refused))

    def _describe(self, host: str, refused: Sequence[tuple[str, str]]) -> str:
        bare = host.strip("[]")
        if len(refused) == 1 and refused[0][0] == bare:
            where = f"is {refused[0][1]}"
        else:
            where = "resolves to " + " and ".join(f"{a}, {why}" for a, why in refused)
        listed = (f" and those in {', '.join(map(str, self.allowed_networks))}"
                  if self.allowed_networks else "")
        return (f"image URL host {bare!r} {where}: image URLs may reach only public addresses"
                f"{listed} (add the network to --allowed-media-networks to allow it)")


# ---- the async client (aiohttp): the serving path ------------------------------------------

class GuardedTCPConnector(aiohttp.TCPConnector):
    """aiohttp's TCP connector connecting only to addresses `policy` permits.

    aiohttp connects to exactly what `_resolve_host` returns (the IP literal itself for one, else
    its resolver's and DNS cache's numeric answers), trying them in order; the TLS server name and
    the certificate check use the URL's host. Filtering that list is the one place every address
    passes before its connect."""

    def __init__(self, policy: MediaAddressPolicy, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.policy = policy

    async def _resolve_host(self, host: str, port: int, traces: Any = None) -> list[Any]:
        results = await super()._resolve_host(host, port, traces=traces)
        permitted = self.policy.permitted(host, [r["host"] for r in results])
        return [r for r in results if r["host"] in permitted]


# ---- the sync client (requests): vLLM's sync chat parser ------------------------------------

class _PinnedConnectionMixin:
    """A urllib3 connection that resolves its host once, keeps the addresses `policy` permits
    and connects to those, in order. Only the socket goes to the address: `host` (the Host
    header, TLS server name and certificate check) stays the URL's name."""

    policy: MediaAddressPolicy
    _dns_host: str
    port: int

    def _new_conn(self) -> socket.socket:
        name = self._dns_host
        try:
            infos = socket.getaddrinfo(name, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise NameResolutionError(name, self, e) from e  # type: ignore[arg-type]
        addresses = self.policy.permitted(name, [info[4][0] for info in infos])
        failure: Exception | None = None
        for address in addresses:
            self._dns_host = address  # urllib3 connects to _dns_host: the literal, no lookup
            try:
                return super()._new_conn()  # type: ignore[misc]
            except (NewConnectionError, ConnectTimeoutError) as e:
                failure = e
            finally:
                self._dns_host = name
        assert failure is not None
        raise failure


class _PinnedAdapter(requests.adapters.HTTPAdapter):
    def __init__(self, policy: MediaAddressPolicy) -> None:
        attrs = {"policy": policy}
        http = type("PinnedHTTPConnection", (_PinnedConnectionMixin, Urllib3HTTPConnection), attrs)
        https = type("PinnedHTTPSConnection", (_PinnedConnectionMixin, Urllib3HTTPSConnection), attrs)
        self._pool_classes = {
            "http": type("PinnedHTTPConnectionPool", (urllib3.HTTPConnectionPool,), {"ConnectionCls": http}),
            "https": type("PinnedHTTPSConnectionPool", (urllib3.HTTPSConnectionPool,), {"ConnectionCls": https}),
        }
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = self._pool_classes


class GuardedHTTPConnection(HTTPConnection):
    """vLLM's HTTP helper with both clients guarded by `policy`, and no proxy from the
    environment (trust_env off)."""

    def __init__(self, policy: MediaAddressPolicy) -> None:
        super().__init__(reuse_client=True)
        self.policy = policy

    def get_sync_client(self) -> requests.Session:
        if self._sync_client is None:
            session = requests.Session()
            session.trust_env = False  # no proxy; the CA bundle requests would read is kept:
            session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
            adapter = _PinnedAdapter(self.policy)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            self._sync_client = session
        return self._sync_client

    async def get_async_client(self) -> aiohttp.ClientSession:
        if self._async_client is None:
            self._async_client = aiohttp.ClientSession(connector=GuardedTCPConnector(self.policy),
                                                       trust_env=False)
        return self._async_client


def guarded_connector_class(allowed_networks: Sequence[IPNetwork]) -> type:
    """vLLM's MediaConnector fetching through one GuardedHTTPConnection that lets media URLs
    reach public addresses and `allowed_networks` only (--allowed-media-networks)."""
    from vllm.multimodal.media import MediaConnector

    # The two methods overridden here are the clients' own (private) ones: were one renamed, the
    # override would never run and image URLs would go unchecked. Refuse to start instead.
    for base, method in ((aiohttp.TCPConnector, "_resolve_host"), (Urllib3HTTPConnection, "_new_conn")):
        if not callable(getattr(base, method, None)):
            raise RuntimeError(f"the media URL guard overrides {base.__module__}.{base.__name__}.{method}, "
                               "which this version lacks: image URLs would go unchecked")
    connection = GuardedHTTPConnection(MediaAddressPolicy(allowed_networks))

    class AddressGuardedMediaConnector(MediaConnector):
        """vLLM's connector on the guarded connection. A URL it cannot load is the request's
        fault, a 400 saying why: vLLM lets a refused connection (aiohttp's ClientConnectorError),
        a timeout or a file: URL without --allowed-local-media-path (a RuntimeError) through as
        an HTTP 500."""

        def __init__(self, media_io_kwargs: dict[str, dict[str, Any]] | None = None, **kwargs: Any) -> None:
            super().__init__(media_io_kwargs, connection, **kwargs)

        def load_from_url(self, url: str, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().load_from_url(url, *args, **kwargs)
            except (ValueError, VLLMClientError):
                raise
            except Exception as e:  # noqa: BLE001 - every other failure to load is the URL's
                raise UnloadableMediaUrl(_unloadable(url, e)) from e

        async def load_from_url_async(self, url: str, *args: Any, **kwargs: Any) -> Any:
            try:
                return await super().load_from_url_async(url, *args, **kwargs)
            except (ValueError, VLLMClientError):
                raise
            except Exception as e:  # noqa: BLE001 - every other failure to load is the URL's
                raise UnloadableMediaUrl(_unloadable(url, e)) from e

    return AddressGuardedMediaConnector
