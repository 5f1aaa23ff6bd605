"""Extra RabbitMQ nodes for the tests: a 3-node cluster and a node with a short ``consumer_timeout``.

The nodes run from the machine's own RabbitMQ install, as the ``rabbitmq`` user, on free loopback
ports, under unique node names (``drt-<random>-<n>@localhost``) with their data, logs and config in
a temporary folder, so several test runs on one machine never meet and the machine's own node
(``rabbit@localhost`` on 5672) is never touched.  Each node is a process group of its own, so
:meth:`RabbitNode.kill` is a real SIGKILL of the whole Erlang VM, and the fixtures kill and remove
everything at the end of the session, failures included.

Starting a node costs about 8-10 s and ~130 MB; a cluster of three about 20-35 s on two cores.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika

#: Where the machine's RabbitMQ keeps the Erlang cookie every node of the cluster shares.
RABBITMQ_HOME = Path("/var/lib/rabbitmq")
START_TIMEOUT_S = 90.0


def available() -> str | None:
    """Why nodes cannot be started here (None when they can): the install and a root user are needed."""
    if shutil.which("rabbitmq-server") is None or shutil.which("rabbitmqctl") is None:
        return "rabbitmq-server is not installed (the machine's RabbitMQ package provides it)"
    if os.geteuid() != 0:
        return "starting RabbitMQ nodes as the rabbitmq user needs root"
    try:
        import pwd

        pwd.getpwnam("rabbitmq")
    except KeyError:
        return "there is no rabbitmq user (the machine's RabbitMQ package creates it)"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_rabbitmq() -> list[str]:
    return ["setpriv", "--reuid=rabbitmq", "--regid=rabbitmq", "--init-groups"]


class RabbitNode:
    """One RabbitMQ node: ``start()``, ``stop()`` (graceful), ``kill()`` (SIGKILL), ``ctl(...)``."""

    def __init__(self, root: Path, name: str, *, config: str = "", advanced: str = "") -> None:
        self.name = f"{name}@localhost"
        self.root = root / name
        self.root.mkdir(parents=True)
        self._config = config
        self._pick_ports()
        (self.root / "advanced.config").write_text(f"[{{rabbit, [{advanced}]}}].\n")
        (self.root / "enabled_plugins").write_text("[].\n")
        (self.root / "rabbitmq-env.conf").write_text("")  # not the machine's (it names rabbit@localhost)
        shutil.chown(self.root, "rabbitmq", "rabbitmq")
        for path in self.root.iterdir():
            shutil.chown(path, "rabbitmq", "rabbitmq")
        self._process: subprocess.Popen[bytes] | None = None
        self._ever_started = False

    def _pick_ports(self) -> None:
        """Free ports for AMQP and Erlang distribution, written into the node's config."""
        self.amqp_port = free_port()
        self.dist_port = free_port()
        self.url = f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"
        (self.root / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.amqp_port}\nloopback_users = none\n{self._config}"
        )

    @property
    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(RABBITMQ_HOME),  # the shared Erlang cookie
            "LANG": "C.UTF-8",
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.root / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"),
            "RABBITMQ_PID_FILE": str(self.root / "node.pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def __repr__(self) -> str:
        return f"RabbitNode({self.name!r}, amqp_port={self.amqp_port})"

    # -- lifecycle ----------------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the node's VM in the background; :meth:`wait_started` waits for it."""
        if self.running:
            return
        log = open(self.root / "server.out", "ab")  # noqa: SIM115 (the child keeps it)
        self._process = subprocess.Popen(
            [*_as_rabbitmq(), "rabbitmq-server"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: kill() takes the whole VM
        )
        log.close()

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll until the node accepts AMQP connections; raise with its log tail otherwise.

        A free port can be taken by another process between :func:`free_port` and the node's
        bind (``eaddrinuse``): on its first start the node then picks new ports and starts again.
        """
        deadline = time.monotonic() + timeout_s
        retries = 3
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                if not self._ever_started and retries and "eaddrinuse" in self.log_tail(200):
                    retries -= 1
                    self._process = None
                    self._pick_ports()
                    self.spawn()
                    continue
                raise RuntimeError(f"{self.name} exited with {self._process.returncode}:\n{self.log_tail()}")
            if self.accepts_connections():
                self._ever_started = True
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} did not start within {timeout_s:.0f} s:\n{self.log_tail()}")

    def start(self) -> None:
        self.spawn()
        self.wait_started()

    def stop(self) -> None:
        """Stop the node gracefully (``rabbitmqctl stop``), as an operator or a rolling restart would."""
        if not self.running:
            return
        self.ctl("stop", timeout_s=60)
        assert self._process is not None
        self._process.wait(timeout=60)
        self._process = None

    def kill(self) -> None:
        """SIGKILL the node's whole process group: a crash, no goodbye to clients or peers."""
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(timeout=30)
        self._process = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # -- looking at it ------------------------------------------------------------------------------

    def accepts_connections(self) -> bool:
        parameters = pika.URLParameters(self.url)
        parameters.connection_attempts = 1
        parameters.socket_timeout = 1
        parameters.blocked_connection_timeout = 1
        try:
            pika.BlockingConnection(parameters).close()
        except Exception:
            return False
        return True

    def ctl(self, *args: str, timeout_s: float = 60) -> str:
        """Run ``rabbitmqctl -n <this node> ARGS`` and return its output; raise with it on failure."""
        return self._tool("rabbitmqctl", *args, timeout_s=timeout_s)

    def queues_ctl(self, *args: str, timeout_s: float = 60) -> str:
        """Run ``rabbitmq-queues -n <this node> ARGS`` (quorum queue membership and leaders)."""
        return self._tool("rabbitmq-queues", *args, timeout_s=timeout_s)

    def _tool(self, tool: str, *args: str, timeout_s: float) -> str:
        done = subprocess.run(
            [*_as_rabbitmq(), tool, "-q", "-n", self.name, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} on {self.name} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def log_tail(self, lines: int = 30) -> str:
        text = ""
        for path in [self.root / "server.out", *sorted((self.root / "log").glob("*.log"))]:
            with contextlib.suppress(OSError):
                text += f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        return text

    def log_text(self) -> str:
        """The node's whole log (to count channel closes, say)."""
        return "".join(
            path.read_text(errors="replace") for path in sorted((self.root / "log").glob("*.log")) if path.is_file()
        )


class RabbitCluster:
    """Three (or ``size``) nodes clustered with ``join_cluster``; ``urls`` lists their AMQP URLs."""

    def __init__(self, nodes: list[RabbitNode]) -> None:
        self.nodes = nodes

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def node_named(self, name: str) -> RabbitNode:
        """The node whose Erlang name is ``name`` (as ``list_queues leader`` prints it)."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise LookupError(f"no node named {name!r} in {[node.name for node in self.nodes]}")

    def running_nodes(self) -> list[RabbitNode]:
        return [node for node in self.nodes if node.running]

    def heal(self) -> None:
        """Start every node that was stopped or killed and wait until it is back in the cluster."""
        stopped = [node for node in self.nodes if not node.running]
        for node in stopped:
            node.spawn()
        for node in stopped:
            node.wait_started()
            node.ctl("await_startup", timeout_s=90)


class _Nodes:
    """Owns a temporary folder and every node started in it; :meth:`close` kills and removes all."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="drt-rabbit-"))
        shutil.chown(self.root, "rabbitmq", "rabbitmq")
        self.root.chmod(0o755)
        self.tag = uuid.uuid4().hex[:6]
        self.nodes: list[RabbitNode] = []
        atexit.register(self.close)

    def node(self, label: str, *, config: str = "", advanced: str = "") -> RabbitNode:
        node = RabbitNode(self.root, f"drt-{self.tag}-{label}", config=config, advanced=advanced)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.kill()
        self.nodes.clear()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def cluster(size: int = 3) -> Iterator[RabbitCluster]:
    """Start ``size`` fresh nodes, join them into one cluster, yield it, kill and remove all after."""
    owner = _Nodes()
    try:
        nodes = [owner.node(str(index + 1)) for index in range(size)]
        for node in nodes:
            node.spawn()  # the VMs boot in parallel
        for node in nodes:
            node.wait_started()
        first = nodes[0]
        for node in nodes[1:]:
            node.ctl("stop_app")
            node.ctl("join_cluster", first.name, timeout_s=90)
            node.ctl("start_app", timeout_s=90)
        members = first.ctl("eval", "length(rabbit_nodes:all_running()).")
        if members.strip() != str(size):
            raise RuntimeError(f"cluster has {members.strip()} running nodes, expected {size}")
        yield RabbitCluster(nodes)
    finally:
        owner.close()


@contextlib.contextmanager
def single_node(*, consumer_timeout_ms: int | None = None, channel_tick_ms: int | None = None) -> Iterator[RabbitNode]:
    """One fresh node; ``consumer_timeout_ms`` and ``channel_tick_ms`` shorten RabbitMQ's timeout check.

    RabbitMQ checks ``consumer_timeout`` on each channel tick (``channel_tick_interval``, 60 s by
    default), so a short timeout needs a short tick too to be seen within seconds.
    """
    owner = _Nodes()
    try:
        config = f"consumer_timeout = {consumer_timeout_ms}\n" if consumer_timeout_ms is not None else ""
        advanced = f"{{channel_tick_interval, {channel_tick_ms}}}" if channel_tick_ms is not None else ""
        node = owner.node("solo", config=config, advanced=advanced)
        node.start()
        yield node
    finally:
        owner.close()
