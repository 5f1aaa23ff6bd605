"""A TCP proxy in front of Postgres and one in front of RabbitMQ, and the URLs that go through them.

Every process of a chaos run connects through these, so stopping a proxy is an outage for all of
them at once while the machine's servers keep running for everybody else.  The URLs keep the
configured user, password, database and vhost; only the host and port change.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit, urlunsplit

from support import TcpProxy

DEFAULT_PORTS = {"postgresql": 5432, "postgres": 5432, "amqp": 5672}


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.hostname.startswith("/"):
        raise ValueError(
            f"the chaos suite needs a TCP URL (postgresql://host:port/db or amqp://host:port/vhost) to put a proxy "
            f"in front of, got one with scheme {parts.scheme!r} and host {parts.hostname!r}; set DATABASE_URL or "
            "RABBITMQ_URL to a host and port"
        )
    if "host=" in parts.query or "port=" in parts.query:
        raise ValueError("the chaos suite cannot proxy a URL whose query sets host= or port=; put them in the netloc")
    return parts.hostname, parts.port or DEFAULT_PORTS[parts.scheme]


def through(url: str, port: int) -> str:
    """``url`` with its host and port replaced by the local proxy's, credentials and path kept."""
    parts = urlsplit(url)
    userinfo, _, _ = parts.netloc.rpartition("@")
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclasses.dataclass
class Proxies:
    """The two proxies of a run; ``cut`` and ``restore`` take ``"postgres"`` or ``"rabbitmq"``."""

    postgres: TcpProxy
    rabbitmq: TcpProxy | None
    database_url: str
    rabbitmq_url: str
    down: set[str] = dataclasses.field(default_factory=set)

    @classmethod
    def start(cls, database_url: str, rabbitmq_url: str, *, rabbitmq: bool = True) -> Proxies:
        """Proxies in front of both servers; ``rabbitmq=False`` keeps ``rabbitmq_url`` as it is
        (on a cluster the outages are the nodes' own, and every process takes every node's URL)."""
        postgres = TcpProxy(*_address(database_url)).start()
        if not rabbitmq:
            return cls(postgres, None, through(database_url, postgres.port), rabbitmq_url)
        rabbitmq_first = rabbitmq_url.split(";")[0]
        proxy = TcpProxy(*_address(rabbitmq_first)).start()
        return cls(postgres, proxy, through(database_url, postgres.port), through(rabbitmq_first, proxy.port))

    def cut(self, which: str) -> None:
        """Close the proxy's port and every connection through it (clients see a reset)."""
        if which not in self.down and getattr(self, which) is not None:
            getattr(self, which).stop()
            self.down.add(which)

    def restore(self, which: str) -> None:
        """Listen again on the same port: the URLs stay valid."""
        if which in self.down and getattr(self, which) is not None:
            getattr(self, which).start()
            self.down.discard(which)

    def close(self) -> None:
        self.postgres.stop()
        if self.rabbitmq is not None:
            self.rabbitmq.stop()
