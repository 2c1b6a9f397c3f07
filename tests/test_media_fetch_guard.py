"""gateway/media_fetch_guard.py: which addresses image URLs may reach, and that the connection goes
to exactly the address checked (IP literals, names, rebinding DNS), over both of vLLM's HTTP clients,
with real loopback servers. The gateway end to end: tests/test_e2e_vision.py."""
from __future__ import annotations

import asyncio
import base64
import http.server
import io
import ipaddress
import socket
import ssl
import threading

import aiohttp
from aiohttp.abc import AbstractResolver
import pytest
from vllm.exceptions import VLLMClientError

from ttserve.gateway.media_fetch_guard import (GuardedHTTPConnection, GuardedTCPConnector, MediaAddressPolicy,
                                               MediaAddressRefused, non_public_kind)

NON_PUBLIC = {
    "0.0.0.0": "unspecified", "0.1.2.3": "unspecified", "::": "unspecified",
    "127.0.0.1": "loopback", "127.255.0.9": "loopback", "::1": "loopback",
    "10.1.2.3": "private", "172.16.0.1": "private", "172.31.255.254": "private", "192.168.1.1": "private",
    "fc00::1": "private (unique local)", "fd12:3456::1": "private (unique local)",
    "169.254.169.254": "link-local", "169.254.0.1": "link-local", "fe80::1": "link-local",
    "fe80::1%1": "link-local", "febf::1": "link-local", "fec0::1": "site-local",
    "100.64.0.1": "shared (CGNAT)", "100.127.255.254": "shared (CGNAT)",
    "224.0.0.1": "multicast", "239.255.255.250": "multicast", "ff02::1": "multicast",
    "240.0.0.1": "reserved", "255.255.255.255": "reserved", "::7f00:1": "reserved",
    # IPv6 addresses that carry an IPv4 one: that one decides.
    "::ffff:127.0.0.1": "IPv4-mapped loopback", "::ffff:169.254.169.254": "IPv4-mapped link-local",
    "::ffff:10.0.0.1": "IPv4-mapped private", "::ffff:100.64.0.1": "IPv4-mapped shared (CGNAT)",
    "64:ff9b::a00:1": "NAT64 private", "2002:7f00:1::": "6to4 loopback",
    # Neither public nor in a named range.
    "192.0.2.1": "special-purpose", "198.18.0.1": "special-purpose", "192.0.0.8": "special-purpose",
    "2001:db8::1": "special-purpose", "100::1": "special-purpose",
}
PUBLIC = ["8.8.8.8", "1.1.1.1", "172.32.0.1", "100.128.0.1", "2606:4700:4700::1111", "::ffff:8.8.8.8",
          "64:ff9b::808:808", "2002:808:808::1"]


@pytest.mark.parametrize("address", sorted(NON_PUBLIC))
def test_every_non_public_range_is_named(address):
    assert non_public_kind(ipaddress.ip_address(address)) == NON_PUBLIC[address]
    assert MediaAddressPolicy().refusal(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address):
    assert non_public_kind(ipaddress.ip_address(address)) is None
    assert MediaAddressPolicy().refusal(ipaddress.ip_address(address)) is None


def networks(*cidrs: str) -> list:
    return [ipaddress.ip_network(c) for c in cidrs]


def test_a_listed_network_is_allowed_and_nothing_beyond_it():
    policy = MediaAddressPolicy(networks("10.0.0.0/8", "fd00::/8"))
    for allowed in ("10.1.2.3", "fd00::5", "::ffff:10.1.2.3", "64:ff9b::a01:203"):
        assert policy.refusal(ipaddress.ip_address(allowed)) is None, allowed
    for refused in ("192.168.1.1", "127.0.0.1", "fc00::1", "::ffff:127.0.0.1", "169.254.169.254"):
        assert policy.refusal(ipaddress.ip_address(refused)) is not None, refused


def test_refusals_name_the_host_each_address_and_what_is_allowed():
    with pytest.raises(MediaAddressRefused) as e:
        MediaAddressPolicy().permitted("127.0.0.1", ["127.0.0.1"])
    assert str(e.value) == ("image URL host '127.0.0.1' is a loopback address: image URLs may reach only "
                            "public addresses (add the network to --allowed-media-networks to allow it)")
    with pytest.raises(MediaAddressRefused) as e:
        MediaAddressPolicy(networks("10.0.0.0/8")).permitted("metadata.example", ["169.254.169.254", "fe80::1"])
    assert str(e.value).startswith("image URL host 'metadata.example' resolves to 169.254.169.254, a link-local "
                                   "address and fe80::1, a link-local address: image URLs may reach only "
                                   "public addresses and those in 10.0.0.0/8 (add the network")


def test_of_a_name_with_public_and_non_public_addresses_only_the_public_ones_are_connected_to():
    assert MediaAddressPolicy().permitted("mixed.example", ["127.0.0.1", "8.8.8.8", "::1", "8.8.4.4"]) == [
        "8.8.8.8", "8.8.4.4"]


# ---- real connections ------------------------------------------------------------------------

class LoopbackServer:
    """An HTTP(S) server on 127.0.0.1 answering every GET with `body`; records the paths asked
    for, their Host headers and (HTTPS) the TLS server names sent."""

    def __init__(self, body: bytes = b"image bytes", context: ssl.SSLContext | None = None) -> None:
        self.asked: list[tuple[str, str]] = []
        self.server_names: list[str | None] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                outer.asked.append((self.path, self.headers["Host"]))
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if context is not None:
            context.sni_callback = lambda sock, name, ctx: self.server_names.append(name)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    s = LoopbackServer()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def one_attempt(monkeypatch):
    """vLLM retries a failed connection with backoff (1 s, 4 s); these tests want the first answer."""
    monkeypatch.setenv("VLLM_MEDIA_FETCH_MAX_RETRIES", "1")


def fetch_both_ways(connection: GuardedHTTPConnection, url: str) -> list[bytes | Exception]:
    """vLLM's async fetch (the serving path) and its sync one, each a result or the error."""
    async def fetch_async():
        try:
            return await connection.async_get_bytes(url, timeout=5)
        except Exception as e:
            return e
        finally:
            if connection._async_client is not None:
                await connection._async_client.close()
                connection._async_client = None

    try:
        sync = connection.get_bytes(url, timeout=5)
    except Exception as e:
        sync = e
    return [asyncio.run(fetch_async()), sync]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"])
def test_loopback_is_refused_before_any_connection_unless_its_network_is_allowed(server, host):
    url = f"http://{host}:{server.port}/cat.png"
    for outcome in fetch_both_ways(GuardedHTTPConnection(MediaAddressPolicy()), url):
        assert isinstance(outcome, MediaAddressRefused), outcome
        assert "loopback address: image URLs may reach only public addresses" in str(outcome)
        if host.startswith("["):
            assert "IPv4-mapped loopback" in str(outcome)  # the host as the client spells it (::ffff:7f00:1)
        else:
            assert f"image URL host '{host}'" in str(outcome)
    assert server.asked == []
    if host.startswith("["):
        return  # the server listens on 127.0.0.1 only
    allowed = GuardedHTTPConnection(MediaAddressPolicy(networks("127.0.0.0/8")))
    assert fetch_both_ways(allowed, url) == [b"image bytes", b"image bytes"]
    # The name stays in the Host header: only the socket goes to the address.
    assert server.asked == [("/cat.png", f"{host}:{server.port}")] * 2


def test_a_name_is_resolved_once_and_the_connection_goes_to_the_address_checked(server, monkeypatch):
    """DNS rebinding: the first answer passes the check, every later one is loopback. The only
    connection goes to the first answer (127.0.0.2, allowed, where nothing listens), never to the
    loopback server on 127.0.0.1."""
    policy = MediaAddressPolicy(networks("127.0.0.2/32"))
    lookups: list[str] = []

    def answer() -> str:
        lookups.append("rebind.test")
        return "127.0.0.2" if len(lookups) == 1 else "127.0.0.1"

    class Rebinding(AbstractResolver):
        async def resolve(self, host, port=0, family=socket.AF_INET):
            return [{"hostname": host, "host": answer(), "port": port, "family": socket.AF_INET,
                     "proto": 0, "flags": socket.AI_NUMERICHOST}]

        async def close(self):
            pass

    async def fetch_async():
        connector = GuardedTCPConnector(policy, resolver=Rebinding(), use_dns_cache=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            with pytest.raises(aiohttp.ClientConnectorError) as e:
                await session.get(f"http://rebind.test:{server.port}/cat.png")
        return e.value

    error = asyncio.run(fetch_async())
    assert "127.0.0.2" in str(error) and lookups == ["rebind.test"] and server.asked == []

    real_getaddrinfo = socket.getaddrinfo

    def rebinding_getaddrinfo(host, port, *args, **kwargs):
        if host == "rebind.test":
            return real_getaddrinfo(answer(), port, *args, **kwargs)
        return real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_getaddrinfo)
    lookups.clear()
    with pytest.raises(Exception) as e:  # requests' ConnectionError
        GuardedHTTPConnection(policy).get_bytes(f"http://rebind.test:{server.port}/cat.png", timeout=5)
    assert "host='127.0.0.2'" in str(e.value) and lookups == ["rebind.test"] and server.asked == []


def test_https_keeps_the_name_for_sni_and_the_certificate_check(tmp_path):
    """Pinned to 127.0.0.1, the TLS handshake still sends the URL's name and verifies the
    certificate against it: a certificate for 'localhost' passes for https://localhost and fails
    for https://127.0.0.1."""
    from certs import CertificateAuthority

    ca = CertificateAuthority(tmp_path, "media-ca")
    leaf = ca.issue("localhost", hosts=("localhost",))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(leaf.cert, leaf.key)
    server = LoopbackServer(context=context)
    client_context = ssl.create_default_context(cafile=str(ca.cert))
    policy = MediaAddressPolicy(networks("127.0.0.0/8"))
    try:
        async def fetch_async(url: str):
            connector = GuardedTCPConnector(policy, ssl=client_context)
            async with aiohttp.ClientSession(connector=connector) as session:
                async with session.get(url) as response:
                    return await response.read()

        sync = GuardedHTTPConnection(policy)
        sync.get_sync_client().verify = str(ca.cert)
        assert asyncio.run(fetch_async(f"https://localhost:{server.port}/a")) == b"image bytes"
        assert sync.get_bytes(f"https://localhost:{server.port}/b", timeout=5) == b"image bytes"
        assert server.server_names == ["localhost", "localhost"]
        assert server.asked == [("/a", f"localhost:{server.port}"), ("/b", f"localhost:{server.port}")]
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            asyncio.run(fetch_async(f"https://127.0.0.1:{server.port}/c"))
        with pytest.raises(Exception, match="certificate"):
            sync.get_bytes(f"https://127.0.0.1:{server.port}/d", timeout=5)
    finally:
        server.close()


def png_data_url() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_installed_vllm_loads_the_guarded_connector_and_both_checks_apply(server, monkeypatch, tmp_path):
    """vLLM's own connector, as its chat parser loads it: the domain list first (on the name, no
    lookup), then the address; data: URLs unaffected, file: URLs still vLLM's refusal."""
    from vllm import envs
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    from ttserve.gateway import vllm_patches

    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", "http")  # restored after; guard_media_urls sets it
    vllm_patches.guard_media_urls([])
    connector = MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR, media_io_kwargs=None,
                                              allowed_local_media_path="", allowed_media_domains=["localhost"])

    async def fetch_all(urls: list[str]) -> list:
        outcomes = []
        for url in urls:
            try:
                outcomes.append(await connector.fetch_image_async(url))
            except Exception as e:
                outcomes.append(e)
        if connector.connection._async_client is not None:
            await connector.connection._async_client.close()
        return outcomes

    data, by_name, by_literal, by_file = asyncio.run(fetch_all([
        png_data_url(), f"http://localhost:{server.port}/cat.png", f"http://127.0.0.1:{server.port}/cat.png",
        f"file://{tmp_path}/cat.png"]))
    assert data.size == (4, 3)
    assert isinstance(by_name, MediaAddressRefused) and "loopback address" in str(by_name)
    assert "allowed domains" in str(by_literal)  # vLLM's check on the name, before any lookup
    assert "allowed-local-media-path" in str(by_file)
    assert isinstance(by_file, VLLMClientError)  # a 400: vLLM raises a RuntimeError (HTTP 500)
    assert server.asked == []


def test_an_unloadable_media_url_is_the_requests_fault(monkeypatch):
    """A host that refuses the connection: vLLM lets aiohttp's ClientConnectorError through as
    an HTTP 500 after three attempts; here it is a ValueError (400) naming the URL."""
    from vllm import envs
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    from ttserve.gateway import media_fetch_guard, vllm_patches

    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", "http")
    vllm_patches.guard_media_urls([ipaddress.ip_network("127.0.0.0/8")])
    connector = MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR, media_io_kwargs=None,
                                              allowed_local_media_path="", allowed_media_domains=None)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    url = f"http://127.0.0.1:{closed}/cat.png"

    async def fetch():
        try:
            return await connector.fetch_image_async(url)
        except Exception as e:
            return e
        finally:
            if connector.connection._async_client is not None:
                await connector.connection._async_client.close()

    error = asyncio.run(fetch())
    assert isinstance(error, media_fetch_guard.UnloadableMediaUrl), repr(error)
    assert f"the media URL {url} could not be loaded" in str(error)
    with pytest.raises(VLLMClientError, match="could not be loaded"):
        connector.fetch_image(url)


def test_the_flag_takes_networks_and_refuses_what_is_not_one(capsys):
    import argparse

    from ttserve.gateway import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    assert parser.parse_args([]).allowed_media_networks == []
    assert parser.parse_args(["--allowed-media-networks", "127.0.0.0/8", "fd00::/8", "10.1.2.3"]
                             ).allowed_media_networks == networks("127.0.0.0/8", "fd00::/8", "10.1.2.3/32")
    for wrong, why in (("10.1.2.3/8", "has host bits set"), ("intranet", "does not appear to be")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--allowed-media-networks", wrong])
        assert why in capsys.readouterr().err
