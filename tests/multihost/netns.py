"""Hosts for the multi-host test: one Linux network namespace per host, each with its own address
on a bridge that lives in a namespace of its own, so the hosts reach one another and nothing else
(not the machine's loopback, not the outside world).

The machine's PostgreSQL and Redis listen on its loopback, which no namespace reaches. The `db` and
`redis` hosts stand in for them with socat, in two hops joined by a Unix socket (a path in the file
system, which namespaces share): in the machine's namespace `UNIX-LISTEN:<sock> -> TCP:127.0.0.1:P`,
in the host's namespace `TCP-LISTEN:<its address>:P -> UNIX-CONNECT:<sock>`. socat (Debian's
package, in C) copies bytes both ways and nothing else, so no Python event loop sits between every
query and the database on a two-core machine; a Python forwarder would also need setns(2), which
the os module has only from Python 3.12.

The test's own HTTP calls run in threads that joined the `client` host's namespace (`enter`).
Namespaces are named `tmh<pid>-<host>`; `up()` first removes those of test runs that are gone, and
`down()` removes this run's, whatever state it is in. Every process started here is killed by the
kernel when the test process dies (PR_SET_PDEATHSIG), so a test run killed outright leaves no host
running, nor the relays in the machine's own namespace, which no namespace clean-up would find."""

import ctypes
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PREFIX = "tmh"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Network:
    """Namespaces `tmh<pid>-<host>` on the subnet `<subnet>.0/24`, host i at `<subnet>.<i>`."""

    def __init__(self, hosts: dict[str, int], *, subnet: str, workdir: Path) -> None:
        self.hosts = hosts
        self.subnet = subnet
        self.workdir = workdir
        self.tag = f"{PREFIX}{os.getpid()}"
        self.procs: list[subprocess.Popen] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    def up(self) -> None:
        remove_stale()
        switch = self.ns("switch")
        ip("netns", "add", switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            ns = self.ns(host)
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            # Made in this namespace under names unique to the run, then each end moved out: none stays here.
            inner, outer = f"{self.tag}{index}a", f"{self.tag}{index}b"
            ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "netns", switch)
            ip("-n", ns, "link", "set", inner, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", switch, "link", "set", outer, "master", "br0")
            ip("-n", switch, "link", "set", outer, "up")

    def down(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        remove(self.tag)

    def run(
        self, host: str | None, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen:
        """`argv` on `host` (None: in the machine's own namespace), output to <workdir>/<name>.log.
        `ip netns exec` execs the command, so the process's pid is the command's own."""
        log = open(self.workdir / f"{name}.log", "w")
        prefix = [] if host is None else ["ip", "netns", "exec", self.ns(host)]
        proc = subprocess.Popen(
            [*prefix, *argv], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        proc.log_path = self.workdir / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def forward(self, host: str, port: int, upstream: str) -> None:
        """Serve `upstream` (host:port, reached from this namespace) on `host`'s address, `port`."""
        sock = self.workdir / f"{host}.sock"
        env = dict(os.environ)
        relay = ["socat", f"UNIX-LISTEN:{sock},fork,unlink-early", f"TCP:{upstream},nodelay"]
        self.run(None, f"{host}-relay", relay, env)
        deadline = time.monotonic() + 10
        while not sock.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"socat did not create {sock}")
            time.sleep(0.02)
        listen = f"TCP-LISTEN:{port},bind={self.address(host)},fork,reuseaddr,nodelay,backlog=1024"
        self.run(host, f"{host}-forward", ["socat", listen, f"UNIX-CONNECT:{sock}"], env)

    def enter(self, host: str) -> None:
        """Move the calling thread (only it) into `host`'s network namespace: sockets it opens from
        now on are that host's."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/run/netns/{self.ns(host)}") as handle:
            if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.ns(host)}")


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it (the test's) exits. The
    setting survives exec (`ip netns exec` execs the command in turn)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def remove(tag: str) -> None:
    """Kill what runs in the namespaces of run `tag` and delete them (their links go with them)."""
    for ns in namespaces():
        if ns.startswith(f"{tag}-"):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def remove_stale() -> None:
    """Namespaces left by a run whose process is gone (killed before its clean-up ran)."""
    for tag in {m.group(0) for ns in namespaces() if (m := re.match(rf"{PREFIX}(\d+)", ns))}:
        pid = int(tag[len(PREFIX) :])
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            remove(tag)


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def wait_listening(address: str, port: int, *, timeout: float, what: str) -> None:
    """Until something accepts TCP connections at address:port (from the calling thread's namespace)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what} on {address}:{port}") from None
            time.sleep(0.1)
