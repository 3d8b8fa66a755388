"""Where a webhook may send: no server-side request forgery into the operator's network.

A receiver's host is resolved and every address it resolves to must be public (not private,
loopback, link-local, shared, reserved, multicast or unspecified; an IPv4 address mapped into
IPv6 is judged as the IPv4 one), unless TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE. It is checked when a
webhook is registered and again before every attempt, and the attempt connects to the address
that was checked (`Target.url`, with the name kept for the Host header and TLS), so a name that
resolves elsewhere between the check and the connection (DNS rebinding) cannot steer it inside."""

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class AddressRefused(ValueError):
    """The URL is not one a webhook may send to; the message says why, for the person who gave it."""


@dataclass(frozen=True)
class Target:
    """A checked receiver: `url` names the checked address, `host` is the name to send as the Host
    header and to verify the receiver's TLS certificate against."""

    url: str
    host: str
    address: Address


def _kind(address: Address) -> str | None:
    """Why the address is not public, or None when it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for kind, flag in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("private", address.is_private),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
    ):
        if flag:
            return kind
    return None if address.is_global else "non-public"


def webhook_target(url: str, *, allow_private: bool) -> Target:
    """Resolve the URL's host and check every address it resolves to; the first is the one to
    connect to. Raises AddressRefused for a URL that is not http(s), has no host, does not
    resolve, or resolves to an address that is not public (unless `allow_private`)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise AddressRefused("Only http and https URLs can receive webhooks.")
    host = parts.hostname
    if not host:
        raise AddressRefused("The URL names no host.")
    if parts.username or parts.password:
        raise AddressRefused("The URL may not carry credentials; the signature authenticates each delivery.")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise AddressRefused("The URL's port is not a number from 1 to 65535.") from None
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise AddressRefused(f"{host} does not resolve ({exc}).") from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in found))
    if not addresses:
        raise AddressRefused(f"{host} does not resolve.")
    if not allow_private:
        for address in addresses:
            if (kind := _kind(address)) is not None:
                raise AddressRefused(f"{host} resolves to {address} ({kind}): webhooks go to public addresses only.")
    address = addresses[0]
    literal = f"[{address}]" if address.version == 6 else str(address)
    netloc = f"{literal}:{parts.port}" if parts.port else literal
    return Target(
        url=urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, "")), host=host, address=address
    )


def host_header(url: str) -> str:
    """The Host header of a request to `url`: its host, and its port when it names one."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port}" if parts.port else host
