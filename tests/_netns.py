"""Simulated nodes: one network namespace per node, each with its own shaped link.

On one machine every writer shares the CPUs and the loopback interface, so "N nodes write
at once" measures the machine. :class:`Nodes` gives each simulated node its own network
link instead, fixed at a rate, so that the links (as on a real cluster, each node's NIC)
and not this machine's CPUs are what a transfer waits on:

* a bridge ``tpb<pid>`` in the root namespace holds the host address ``10.A.B.1/24``
  (:attr:`Nodes.host`): servers standing in for the store listen there;
* node ``k`` is the namespace ``taskpoint-<pid>-<k>``, joined to the bridge by a veth pair
  (``tpv<pid>n<k>`` in the root namespace, ``tpeth`` inside, address ``10.A.B.<k+2>``,
  :meth:`Nodes.address`);
* a token-bucket filter (``tc qdisc ... tbf``) caps each end at the rate: the node's end
  caps what it sends (uploads), the root end what it receives (downloads). Traffic between
  two nodes (a process group's) crosses both nodes' links.

Processes run in a node with ``ip netns exec`` (:meth:`Nodes.popen`); they share this
machine's file system, so files can still tell them when to start. Needs Linux, root (or
``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``) and iproute2 (``ip``, ``tc``):
:func:`why_unavailable` says what is missing, and :class:`Nodes` raises
:class:`NetnsUnavailable` (having removed what it made) when the kernel refuses.

:meth:`Nodes.close` (also on ``with`` exit, and at interpreter exit if forgotten) stops the
processes it started and removes the namespaces, links and bridge; a run killed with
SIGKILL leaves them behind, and the next :class:`Nodes` removes those of dead processes.

Example::

    with Nodes(2, rate_mbit=100) as nodes:
        server = start_server_on(nodes.host)          # reachable from every node
        child = nodes.popen(0, [sys.executable, "writer.py"])
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["NODE_IFNAME", "NetnsUnavailable", "Nodes", "why_unavailable"]

NODE_IFNAME = "tpeth"
"""The name of each node's own interface, inside its namespace (``GLOO_SOCKET_IFNAME``)."""
_NS_RE = re.compile(r"^taskpoint-(\d+)-\d+$")


class NetnsUnavailable(RuntimeError):
    """Network namespaces with shaped links cannot be made here (says why)."""


def why_unavailable() -> str | None:
    """Why :class:`Nodes` cannot even be tried here (not Linux, not root, no ``ip`` or
    ``tc``), or ``None`` when it can."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    missing = [tool for tool in ("ip", "tc") if _tool(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (this process runs as uid " \
               f"{os.geteuid()})"
    return None


def _tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (f"{d}/{name}" for d in ("/usr/sbin", "/sbin") if os.access(f"{d}/{name}", os.X_OK)), None
    )


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    tool = _tool(argv[0]) or argv[0]
    done = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise NetnsUnavailable(
            f"`{' '.join(argv)}` failed with status {done.returncode}: "
            f"{(done.stderr or done.stdout).strip()}"
        )
    return done


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (kept across
    ``ip netns exec``'s exec), so no writer outlives a killed run."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces, links and bridges of :class:`Nodes` whose process is gone (a
    run killed with SIGKILL); the names removed."""
    removed: list[str] = []
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    dead = set()
    for name in listed:
        match = _NS_RE.match(name)
        if match and not _alive(int(match.group(1))):
            dead.add(match.group(1))
            _run("ip", "netns", "delete", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        match = re.match(r"^\d+: (tp[bv])(\d+)(n\d+)?[@:]", line)
        if match and (match.group(2) in dead or not _alive(int(match.group(2)))):
            name = "".join(g or "" for g in match.groups())
            _run("ip", "link", "delete", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route here overlaps."""
    used: list[ipaddress.IPv4Network] = []
    for line in _run("ip", "-o", "-4", "addr", "show", check=False).stdout.splitlines():
        match = re.search(r"inet (\S+)", line)
        if match:
            used.append(ipaddress.IPv4Interface(match.group(1)).network)
    for line in _run("ip", "-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):
            if first not in ("default", "broadcast", "local", "unreachable"):
                used.append(ipaddress.IPv4Network(first, strict=False))
    start = os.getpid() % 200
    for step in range(200):
        candidate = ipaddress.IPv4Network(f"10.{201 + (start + step) % 50}.{(start + step) % 250}.0/24")
        if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
            return candidate
    raise NetnsUnavailable("no free 10.x.y.0/24 subnet for the simulated nodes")


class Nodes:
    """``count`` simulated nodes, each a network namespace with its own link at
    ``rate_mbit`` megabits per second each way (see the module docstring).

    Args:
        count: how many nodes (1 to 200).
        rate_mbit: each link's rate, in megabits (10^6 bits) per second, each direction.
        latency_ms: how long a packet may queue at a link's filter before it is dropped
            (the queue's depth, in milliseconds at the rate).

    Raises:
        NetnsUnavailable: :func:`why_unavailable` says why, or a command failed (the message
            quotes it); whatever was made is removed first.
        ValueError: ``count`` or ``rate_mbit`` is out of range.
    """

    def __init__(self, count: int, rate_mbit: float, *, latency_ms: float = 50.0) -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"count must be from 1 to 200; got {count!r}")
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive; got {rate_mbit!r}")
        reason = why_unavailable()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self.count, self.rate_mbit = count, float(rate_mbit)
        pid = os.getpid()
        self._bridge = f"tpb{pid}"
        self._names = [f"taskpoint-{pid}-{k}" for k in range(count)]
        self._links = [f"tpv{pid}n{k}" for k in range(count)]
        self._processes: list[subprocess.Popen[Any]] = []
        self._made: list[tuple[str, str]] = []  # ("ns" | "link", name), in creation order
        self._closed = False
        remove_stale()
        subnet = _free_subnet()
        hosts = list(subnet.hosts())
        self.host = str(hosts[0])
        self._addresses = [str(hosts[k + 1]) for k in range(count)]
        self._prefix = subnet.prefixlen
        atexit.register(self.close)
        try:
            self._make(latency_ms)
        except BaseException:
            self.close()
            raise

    def _make(self, latency_ms: float) -> None:
        rate_bits = self.rate_mbit * 1e6
        # The bucket holds 5 ms at the rate (at least 32 KiB); the queue latency_ms.
        burst = max(32 * 1024, int(rate_bits / 8 * 0.005))
        shape = ("root", "tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst),
                 "latency", f"{latency_ms:g}ms")
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        self._made.append(("link", self._bridge))
        _run("ip", "addr", "add", f"{self.host}/{self._prefix}", "dev", self._bridge)
        _run("ip", "link", "set", self._bridge, "up")
        for name, link, address in zip(self._names, self._links, self._addresses, strict=True):
            _run("ip", "netns", "add", name)
            self._made.append(("ns", name))
            _run("ip", "link", "add", link, "type", "veth", "peer", "name", NODE_IFNAME,
                 "netns", name)
            self._made.append(("link", link))
            _run("ip", "link", "set", link, "master", self._bridge)
            _run("ip", "link", "set", link, "up")
            _run("tc", "qdisc", "add", "dev", link, *shape)
            inside = ("ip", "netns", "exec", name)
            _run(*inside, "ip", "addr", "add", f"{address}/{self._prefix}", "dev", NODE_IFNAME)
            _run(*inside, "ip", "link", "set", NODE_IFNAME, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "tc", "qdisc", "add", "dev", NODE_IFNAME, *shape)

    def __repr__(self) -> str:
        return f"Nodes({self.count}, rate_mbit={self.rate_mbit:g}, host={self.host!r})"

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def namespace(self, node: int) -> str:
        """Node ``node``'s namespace name."""
        return self._names[node]

    def address(self, node: int) -> str:
        """Node ``node``'s own IPv4 address (on :data:`NODE_IFNAME`)."""
        return self._addresses[node]

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node`` (with ``ip netns exec``)."""
        return [_tool("ip") or "ip", "netns", "exec", self._names[node], *argv]

    def popen(self, node: int, argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside node ``node``; :meth:`close` kills it if still running.

        The process dies with this one (``PR_SET_PDEATHSIG``). ``options`` go to
        ``subprocess.Popen``.
        """
        process = subprocess.Popen(
            self.command(node, argv), preexec_fn=_die_with_parent, **options
        )
        self._processes.append(process)
        return process

    def cut(self, node: int) -> None:
        """Silence node ``node``'s link until :meth:`restore`: its end on the bridge goes
        down, so every packet either way vanishes with no error, as when a switch or a
        cable upstream fails. Both ends' neighbour entries are pinned first, so neither
        side learns of the cut from a failed address resolution either: a connection
        waits, as on a routed network, rather than failing fast."""
        inside = ("ip", "netns", "exec", self._names[node])
        node_mac = _run(*inside, "cat", f"/sys/class/net/{NODE_IFNAME}/address").stdout.strip()
        host_mac = Path(f"/sys/class/net/{self._bridge}/address").read_text().strip()
        _run(*inside, "ip", "neigh", "replace", self.host, "lladdr", host_mac, "dev",
             NODE_IFNAME, "nud", "permanent")
        _run("ip", "neigh", "replace", self._addresses[node], "lladdr", node_mac, "dev",
             self._bridge, "nud", "permanent")
        _run("ip", "link", "set", self._links[node], "down")

    def restore(self, node: int) -> None:
        """Bring node ``node``'s link back after :meth:`cut`."""
        _run("ip", "link", "set", self._links[node], "up")

    def link_bytes(self, node: int) -> tuple[int, int]:
        """``(sent, received)``: bytes node ``node``'s link carried each way so far (the
        filters' counters)."""
        up = _run("ip", "netns", "exec", self._names[node], "tc", "-s", "qdisc", "show", "dev",
                  NODE_IFNAME).stdout
        down = _run("tc", "-s", "qdisc", "show", "dev", self._links[node]).stdout

        def sent(text: str) -> int:
            match = re.search(r"Sent (\d+) bytes", text)
            return int(match.group(1)) if match else 0

        return sent(up), sent(down)

    def close(self) -> None:
        """Kill the processes still running in the nodes, then remove the namespaces,
        links and bridge (idempotent; errors are ignored so that all of it is tried)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for process in self._processes:
            if process.poll() is None:
                with contextlib.suppress(OSError):
                    process.kill()
        for process in self._processes:
            with contextlib.suppress(Exception):
                process.wait(timeout=10)
        for kind, name in reversed(self._made):
            if kind == "link":
                _run("ip", "link", "delete", name, check=False)
            else:
                _run("ip", "netns", "delete", name, check=False)
        self._made.clear()


def _self_check() -> None:
    """``python tests/_netns.py``: make two nodes, show them, remove them."""
    with Nodes(2, rate_mbit=100) as nodes:
        print(nodes, [nodes.address(k) for k in range(nodes.count)])
        print(_run("ip", "netns", "list").stdout.strip())
    print("after:", _run("ip", "netns", "list").stdout.strip() or "(no namespaces)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _self_check()
