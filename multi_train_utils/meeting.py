"""What to say when the processes of a job do not meet: the diagnostics here run once init_process_group has failed,
to turn PyTorch's page of C++ into one line that names the cause; and, across machines, the network interface gloo
uses where this machine's name resolves to loopback. The spawn script's free port is found here too."""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import MutableMapping

from .errors import GroupNotFormedError, UserInputError, report


def meeting_failure(err: Exception, rank: int, world_size: int, timeout_s: float,
                    dist_url: str) -> UserInputError | None:
    """The one-line error for processes that could not meet (where to meet unsaid or no port, their port taken,
    some never came), or None."""
    for name in ("MASTER_ADDR", "MASTER_PORT") if dist_url == "env://" else ():
        if not os.environ.get(name):  # a launcher sets them; by hand, with RANK and WORLD_SIZE, easily forgotten
            return meeting_point_unset(name)
    port = os.environ.get("MASTER_PORT", "1").strip()
    if dist_url == "env://" and not (port.isdigit() and 0 < int(port) < 65536):
        return UserInputError(f"MASTER_PORT={port}: a port is a number from 1 to 65535")
    if "EADDRINUSE" in str(err) or "address already in use" in str(err).lower():
        return UserInputError(port_taken_line(os.environ.get("MASTER_PORT")))
    if "ping failed" in str(err).lower():  # the store's first exchange had an answer no store gives
        return GroupNotFormedError(f"rank {rank}: another program, not rank 0's store, answers at "
                                   f"{meeting_place(dist_url)}; choose a port that nothing else listens on")
    missing = processes_missing_line(err, rank, world_size, timeout_s, dist_url)
    return None if missing is None else GroupNotFormedError(missing)


def meeting_point_unset(name: str) -> UserInputError:
    return UserInputError(f"{name} is not set: the processes meet at MASTER_ADDR:MASTER_PORT (rank 0's address and "
                          "a free port), which a launcher such as torchrun sets")


def port_taken_line(port: str | None) -> str:
    if os.environ.get("MASTER_PORT_CHOSEN_BY") == "spawn":  # free when chosen, taken a moment later
        return (f"port {port}, free when the spawn script chose it, was taken by another program before the "
                "processes met there; start the job again")
    return (f"MASTER_PORT {port}: another program listens on that port; choose a free one, or unset "
            "MASTER_PORT for the spawn script to pick one")


def processes_missing_line(err: BaseException, rank: int, world_size: int, timeout_s: float,
                           dist_url: str = "env://") -> str | None:
    """For a group that never formed within --dist-timeout: on rank 0, how many of the processes came (the store
    counts them); on the others, that rank 0's address did not answer. None for other errors."""
    message, where = str(err), meeting_place(dist_url)
    joined = re.search(r"(\d+)/(\d+) clients joined", message)
    if joined:
        return (f"only {joined.group(1)} of the {joined.group(2)} processes joined within --dist-timeout "
                f"{timeout_s:g} s (WORLD_SIZE={world_size}): start every rank (torchrun --nproc_per_node "
                f"starts them all), or check that the other machines reach {where}")
    if re.search(r"failed to connect|connection refused|timed out|timeout", message, re.IGNORECASE):
        return (f"rank {rank} could not reach rank 0's {where} within "
                f"--dist-timeout {timeout_s:g} s: is rank 0 running, and is that its address on this network "
                "(not 127.0.0.1 from another machine)?")
    return None


def meeting_place(dist_url: str) -> str:
    """Where the processes meet, as the job was told: MASTER_ADDR:MASTER_PORT, or --dist-url."""
    return f"MASTER_ADDR:MASTER_PORT {meeting_point()}" if dist_url == "env://" else f"--dist-url {dist_url}"


def meeting_point() -> str:
    """MASTER_ADDR:MASTER_PORT, where the processes of an env:// group meet (rank 0's store), or "" unset."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{host}:{port}" if host and port else ""


def choose_gloo_interface(env: MutableMapping[str, str], says: bool) -> None:
    """On several machines: where this machine's name resolves to loopback (127.0.1.1 in /etc/hosts, the default of
    many images), gloo gives the others an address they cannot reach, and every process waits until --dist-timeout.
    Unless GLOO_SOCKET_IFNAME names one, the interface that routes to MASTER_ADDR is chosen (on MASTER_ADDR's own
    machine: its only other interface, or its default route's), and the process that `says` says so; where none
    is found, one line names the host and the fix."""
    if "GLOO_SOCKET_IFNAME" in env or not own_name_is_loopback():
        return
    try:
        master_ip = socket.gethostbyname(env.get("MASTER_ADDR", ""))
    except OSError:
        master_ip = ""
    chosen = interface_towards(master_ip) if master_ip and not is_loopback(master_ip) else None
    if chosen is None:  # this is MASTER_ADDR's machine (or its name is loopback here too)
        others = [name for name, ip in interface_addresses().items() if not is_loopback(ip)]
        chosen = others[0] if len(others) == 1 else interface_towards("192.0.2.1")  # TEST-NET: the default route
    if chosen is None:
        raise GroupNotFormedError(
            f"this machine's name, {socket.gethostname()}, resolves to a loopback address, which the other "
            "machines cannot reach, and no network interface towards them was found; set GLOO_SOCKET_IFNAME to "
            "the interface they reach this machine through (see `ip -o -4 addr`)")
    env["GLOO_SOCKET_IFNAME"] = chosen
    if says:
        report(f"| {socket.gethostname()} resolves to a loopback address: gloo uses the network interface "
               f"{chosen} (set GLOO_SOCKET_IFNAME to choose another)", sys.stdout)


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def own_name_is_loopback() -> bool:
    """Whether this machine's name resolves to a loopback address only."""
    try:
        return all(is_loopback(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        return False


def interface_towards(address: str) -> str | None:
    """The network interface this machine reaches `address` through, by the routing table (a UDP socket's
    connect sends nothing); None if no route leads there or the interface cannot be named."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    return next((name for name, ip in interface_addresses().items() if ip == local and not is_loopback(ip)), None)


def interface_addresses() -> dict[str, str]:
    """Each network interface's IPv4 address (Linux: SIOCGIFADDR)."""
    import fcntl
    import struct

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` (IPv4 or IPv6) nobody listens on right now (another program may take it before it is used:
    port_taken_line). OSError where this machine cannot listen at `host`."""
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(address)
        return sock.getsockname()[1]
