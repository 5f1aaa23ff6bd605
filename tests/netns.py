"""A silent network partition made for real: a client in its own network namespace, cut with DROP.

The client (a small Python script per scenario) runs in a network namespace joined to the root
namespace by a veth pair on a private /30.  The machine's Postgres and RabbitMQ listen on
127.0.0.1 only, so the root side rewrites what the client sends to the veth's address to
127.0.0.1 (DNAT, with ``route_localnet`` on the veth so the kernel routes to loopback from it)
and its source to 127.0.0.1 too (SNAT in ``nat INPUT``), so Postgres sees a local client and its
``pg_hba.conf`` is left alone.  :meth:`Netns.cut` inserts ``-j DROP`` rules for one port, both
ways, in the root namespace's filter table: the client's segments vanish on their way in and
the server's on their way out, with no RST and no ICMP, as in a real partition.  The client's own
namespace has no rule, so its kernel sees only silence (an ``OUTPUT`` DROP on its side would
fail its ``connect()`` at once with EPERM, which is not a partition).  :meth:`Netns.heal`
deletes the rules; connections the kernels did not give up on resume.

Every rule carries a comment naming this namespace, and :meth:`Netns.close` removes the
namespace, the veth (with it) and every rule so tagged, also after a failure; it is idempotent.
Needs root, ``ip`` and ``iptables`` (``.ci/run`` installs iptables).

>>> with Netns.create() as net:                                       # doctest: +SKIP
...     url = net.url("postgresql://postgres@127.0.0.1:5432/postgres")
...     client = net.popen([sys.executable, "scenario.py", url])
...     net.cut(5432)
...     net.heal(5432)
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Netns", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (``None`` when they can): root, ``ip``, ``iptables``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (apt-get install -y iproute2 iptables)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


class Netns:
    """One namespace, its veth pair and its iptables rules.  Build it with :meth:`create`."""

    def __init__(self, name: str, host_if: str, client_if: str, subnet: int) -> None:
        self.name = name
        self.host_if = host_if
        self.client_if = client_if
        #: The address the client reaches the machine's servers at (the root side of the veth).
        self.host_address = f"10.{200 + subnet // 256}.{subnet % 256}.1"
        self.client_address = f"10.{200 + subnet // 256}.{subnet % 256}.2"
        self.tag = f"dr-netns-{name}"
        self._cuts: list[tuple[str, ...]] = []

    @classmethod
    def create(cls) -> Netns:
        """A new namespace whose client reaches the machine's 127.0.0.1 servers at :attr:`host_address`."""
        suffix = uuid.uuid4().hex[:8]
        # Interface names are at most 15 bytes; the /30 is picked at random among 10.200-10.231.
        net = cls(f"drp{suffix}", f"drh{suffix}", f"drc{suffix}", random.randrange(32 * 256))
        try:
            net._setup()
        except BaseException:
            net.close()
            raise
        return net

    def _setup(self) -> None:
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.client_if)
        _run("ip", "link", "set", self.client_if, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_address}/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        _run("ip", "-n", self.name, "addr", "add", f"{self.client_address}/30", "dev", self.client_if)
        _run("ip", "-n", self.name, "link", "set", self.client_if, "up")
        _run("ip", "-n", self.name, "link", "set", "lo", "up")
        _run("ip", "-n", self.name, "route", "add", "default", "via", self.host_address)
        # Let packets from the veth be routed to 127.0.0.1 (loopback is otherwise martian there).
        _run("sysctl", "-q", "-w", f"net.ipv4.conf.{self.host_if}.route_localnet=1")
        tag = f"-m comment --comment {self.tag}"
        nat = [
            f"PREROUTING -i {self.host_if} -d {self.host_address} -p tcp {tag} -j DNAT --to-destination 127.0.0.1",
            # Postgres then sees a local client: its pg_hba.conf is left alone.
            f"INPUT -i {self.host_if} -p tcp {tag} -j SNAT --to-source 127.0.0.1",
        ]
        for rule in nat:
            _run("iptables", "-t", "nat", "-A", *rule.split())

    # -- the client side ---------------------------------------------------------------------

    def url(self, url: str) -> str:
        """``url`` (a Postgres or AMQP URL to 127.0.0.1 or localhost) as the client reaches it."""
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"the partition harness reaches only the machine's own servers, not {host!r}")
        netloc = parts.netloc.rsplit("@", 1)
        where = f"{self.host_address}:{parts.port}" if parts.port else self.host_address
        return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{where}" if len(netloc) == 2 else where))

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``args`` inside the namespace (text mode, stdout and stdin piped unless given)."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stdin", subprocess.PIPE)
        kwargs.setdefault("text", True)
        return subprocess.Popen(["ip", "netns", "exec", self.name, *args], **kwargs)

    # -- the partition -----------------------------------------------------------------------

    def _rules(self, port: int) -> list[tuple[str, ...]]:
        tag = f"-m comment --comment {self.tag}"
        # After DNAT the client's segments arrive for 127.0.0.1:port.  The server's replies are
        # matched by their connection's original source (the client), since the output device
        # a filter rule sees for them is still loopback's, before the reply is de-NATed.
        rules = [
            f"INPUT -i {self.host_if} -p tcp --dport {port} {tag} -j DROP",
            f"OUTPUT -p tcp --sport {port} -m conntrack --ctorigsrc {self.client_address} {tag} -j DROP",
        ]
        return [tuple(rule.split()) for rule in rules]

    def cut(self, port: int) -> None:
        """Drop every packet between the client and the server on ``port``, both ways (no RST)."""
        for rule in self._rules(port):
            _run("iptables", "-I", *rule)
            self._cuts.append(rule)

    def heal(self, port: int) -> None:
        """Remove :meth:`cut`'s rules for ``port``."""
        for rule in self._rules(port):
            if rule in self._cuts:
                _run("iptables", "-D", *rule)
                self._cuts.remove(rule)

    # -- cleanup -----------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the namespace, the veth pair and every rule tagged with this namespace."""
        _run("ip", "netns", "del", self.name, check=False)  # takes the client end of the veth
        _run("ip", "link", "del", self.host_if, check=False)
        for table in ("filter", "nat"):
            listed = _run("iptables", "-t", table, "-S", check=False).stdout.splitlines()
            for line in listed:
                if line.startswith("-A ") and f"--comment {self.tag}" in line:
                    _run("iptables", "-t", table, "-D", *line.split()[1:], check=False)
        self._cuts = []

    def __enter__(self) -> Netns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
