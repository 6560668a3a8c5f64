"""A row's image fetched from the web while a data set is prepared: only from hosts the user names (the rule
`lt-opd serve` applies), only at public addresses unless the user lists the address (`--allowed-media-addresses`: a
named host that resolves to a loopback, private, link-local, ... address is refused, every address it resolves to
checked), connecting to the address checked (never a second lookup), never following a redirect (an allowed host
cannot send the request on to another), within a timeout and a size. Anything else is a ValueError naming the URL,
reported with the row."""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from collections.abc import Iterable
from urllib.parse import urlsplit

MAX_MEDIA_BYTES = 64 * 2**20
TIMEOUT_S = 30.0
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # an IPv4 address behind a NAT64 gateway: judged by that address

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_networks(text: str) -> tuple[Network, ...]:
    """The addresses and networks of one `--allowed-media-addresses` value ("10.0.0.0/8,127.0.0.1"); a ValueError
    naming the entry that is neither (a host name, a network with host bits set, an empty entry)."""
    networks = []
    for entry in text.split(","):
        entry = entry.strip()
        try:
            networks.append(ipaddress.ip_network(entry))
        except ValueError as exc:
            if not entry:
                raise ValueError(f"{text!r} has an empty entry; give addresses or networks separated by commas") from None
            if "/" in entry and "host bits" in str(exc):
                raise ValueError(f"{entry!r} has host bits set; write the network's first address"
                                 f" ({ipaddress.ip_network(entry, strict=False)})") from None
            raise ValueError(f"{entry!r} is not an IP address or network (a host name is allowed with --allowed-media-domains,"
                             " its addresses here)") from None
    return tuple(networks)


def media_addresses(text: str) -> tuple[Network, ...]:
    """`parse_networks` as an argparse type: a bad entry is a usage error naming it (the command exits with 2)."""
    import argparse

    try:
        return parse_networks(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _networks(allowed: Iterable) -> tuple[Network, ...]:
    return tuple(network for item in allowed for network in
                 (parse_networks(item) if isinstance(item, str) else (ipaddress.ip_network(item),)))


def _kind(ip: Address) -> str | None:
    """What makes `ip` an address images are not fetched from without the user's say, or None for a public one."""
    for kind, flag in (("a loopback", ip.is_loopback), ("an unspecified", ip.is_unspecified), ("a link-local", ip.is_link_local),
                       ("a multicast", ip.is_multicast), ("a private", ip.is_private), ("a reserved", ip.is_reserved)):
        if flag:
            return kind
    return None if ip.is_global else "a non-global (shared or special-purpose)"


def _embedded(ip: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside an IPv6 one that carries it: IPv4-mapped, NAT64 (64:ff9b::/96) or 6to4."""
    if ip.version != 6:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def address_problem(address: str, allowed: Iterable = ()) -> str | None:
    """Why images are not fetched from `address` (one sentence's end: "<address> is a loopback address"), or None:
    a public address, or one in `allowed` (addresses or networks, as strings or ipaddress objects). An IPv6 address
    carrying an IPv4 one (mapped, NAT64, 6to4) is judged by that too; a mapped or NAT64 one only by it."""
    ip = ipaddress.ip_address(address)
    inner = _embedded(ip)
    if any(form in network for network in _networks(allowed) for form in (ip, inner) if form is not None):
        return None
    carried = ip.version == 6 and inner is not None and (ip.ipv4_mapped is not None or ip in NAT64)
    for form in ([inner] if carried else [ip, inner]):
        if form is not None and (kind := _kind(form)):
            return f"{address}{f' (IPv4 {inner} inside it)' if form is inner else ''} is {kind} address"
    return None


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to `host` (its Host header) made to the addresses checked, never to a fresh lookup."""

    def __init__(self, host: str, port: int, addresses: list[str], timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.addresses = addresses

    def _socket(self) -> socket.socket:
        error: OSError | None = None
        for address in self.addresses:
            try:
                return socket.create_connection((address, self.port), self.timeout)
            except OSError as exc:
                error = exc
        raise error or OSError("no address")

    def connect(self) -> None:
        self.sock = self._socket()


class _PinnedTLS(_Pinned):
    """`_Pinned` over TLS: the certificate checked against the host's name (SNI too), the socket to the checked address."""

    default_port = http.client.HTTPS_PORT

    def connect(self) -> None:
        self.sock = tls_context().wrap_socket(self._socket(), server_hostname=self.host)


def tls_context() -> ssl.SSLContext:
    """How an https image's server is checked: the system's trusted certificates, for the URL's host name."""
    return ssl.create_default_context()


def fetch(url: str, allowed_domains: tuple[str, ...], allowed_addresses: Iterable = ()) -> bytes:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"{url}: only http(s) URLs are fetched")
    host = parts.hostname
    if host not in allowed_domains:
        raise ValueError(f"{url} is on {host}, and remote images are fetched only from hosts named with "
                         "--allowed-media-domains (or put the file under the data folder)")
    try:
        port = parts.port if parts.port is not None else 443 if scheme == "https" else 80
    except ValueError:
        raise ValueError(f"{url}: the port is not a number from 0 to 65535") from None
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{url}: {host} does not resolve ({getattr(exc, 'strerror', None) or exc})") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    for address in addresses:  # every address the name has: a rebinding answer may give a public one first
        if problem := address_problem(address, allowed_addresses):
            raise ValueError(f"{url}: {host} resolves to {problem}, and remote images are fetched only from public"
                             " addresses unless --allowed-media-addresses lists it")
    connection = (_PinnedTLS if scheme == "https" else _Pinned)(host, port, addresses, TIMEOUT_S)
    target = parts.path or "/"
    try:
        connection.request("GET", target + (f"?{parts.query}" if parts.query else ""), headers={"Accept": "*/*"})
        response = connection.getresponse()
        if 300 <= response.status < 400:
            raise ValueError(f"{url} redirects ({response.status}) to {response.getheader('Location')}: redirects are not followed")
        if response.status != 200:
            raise ValueError(f"{url}: the server answered {response.status} {response.reason}")
        data = response.read(MAX_MEDIA_BYTES + 1)
    except UnicodeError:
        raise ValueError(f"{url}: the path is not ASCII; percent-encode it") from None
    except (OSError, http.client.HTTPException) as exc:
        raise ValueError(f"{url}: {getattr(exc, 'strerror', None) or str(exc) or type(exc).__name__}") from None
    finally:
        connection.close()
    if len(data) > MAX_MEDIA_BYTES:
        raise ValueError(f"{url}: more than {MAX_MEDIA_BYTES // 2**20} MiB")
    return data
