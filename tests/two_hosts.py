"""Two machines on one: two Linux network namespaces joined by one virtual cable (a veth pair), each with its
own address, its own /etc/hosts and its own host name, and each pinned to a core of its own, as two real
machines would each have their own. tests/test_two_hosts.py trains across them.

    with two_hosts(loopback_names=False) as hosts:
        hosts[0].run([...])          # a command on the first machine; hosts[0].address is 10.87.0.1

Needs root and iproute2 (`ip netns`); `require_two_hosts()` skips the test, with its reason, where they are
missing. Everything it made is removed on the way out, however the block ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SUBNET = "10.87.0"
NETNS_CONFIG = Path("/etc/netns")


@dataclass
class Host:
    name: str  # the host name, as `hostname` says it on the machine
    namespace: str
    address: str
    core: int
    cable_end: str  # this machine's end of the cable: its network interface

    def cable(self, connected: bool) -> None:
        """Plug this machine's end of the cable in or pull it out: pulled, its link is down, and nothing it
        sends or was sent arrives, nor is refused (no reset reaches the other end); plugged, it is as before."""
        subprocess.run(["ip", "netns", "exec", self.namespace, "ip", "link", "set", self.cable_end,
                        "up" if connected else "down"], check=True)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this machine: in its network namespace (whose /etc/hosts `ip netns exec` puts in place),
        with its own host name (a UTS namespace of its own), on its own core."""
        script = f'hostname {self.name} && exec "$@"'
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", script, "sh",
                "taskset", "-c", str(self.core), *argv]

    def start(self, argv: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen(self.command(argv), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True)


def require_two_hosts() -> None:
    """Skip, saying why, where two hosts cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("two hosts in network namespaces need root")
    for tool in ("ip", "unshare", "taskset"):
        if shutil.which(tool) is None:
            pytest.skip(f"two hosts in network namespaces need {tool}")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two hosts need a core each")
    probe = f"probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], check=False)


@contextlib.contextmanager
def two_hosts(loopback_names: bool) -> Iterator[list[Host]]:
    """Two hosts, "node-a" and "node-b", on one cable. With `loopback_names`, each machine's /etc/hosts maps
    its own name to 127.0.1.1, as many cloud and container images ship it; else to its own address."""
    require_two_hosts()
    tag = f"{os.getpid() % 100000}"
    hosts = [Host("node-a", f"tha{tag}", f"{SUBNET}.1", 0, f"vtha{tag}"),
             Host("node-b", f"thb{tag}", f"{SUBNET}.2", 1, f"vthb{tag}")]
    try:
        for host in hosts:
            subprocess.run(["ip", "netns", "add", host.namespace], check=True)
            own = "127.0.1.1" if loopback_names else host.address
            (NETNS_CONFIG / host.namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_CONFIG / host.namespace / "hosts").write_text(
                f"127.0.0.1 localhost\n{own} {host.name}\n"
                + "".join(f"{other.address} {other.name}\n" for other in hosts if other is not host))
        subprocess.run(["ip", "link", "add", hosts[0].cable_end, "type", "veth", "peer", "name", hosts[1].cable_end],
                       check=True)
        for host in hosts:
            inside = ["ip", "netns", "exec", host.namespace]
            subprocess.run(["ip", "link", "set", host.cable_end, "netns", host.namespace], check=True)
            subprocess.run([*inside, "ip", "addr", "add", f"{host.address}/24", "dev", host.cable_end], check=True)
            host.cable(connected=True)
            subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True)
        yield hosts
    finally:
        for host in hosts:
            end_processes_in(host.namespace)
            subprocess.run(["ip", "netns", "del", host.namespace], check=False, capture_output=True)
            shutil.rmtree(NETNS_CONFIG / host.namespace, ignore_errors=True)


def end_processes_in(namespace: str) -> None:
    """SIGKILL whatever still runs in `namespace`, by PID."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
