"""Two real "hosts" on one machine, for the multi-node tests.

Each host is a network namespace of its own, joined to the other by a veth pair with addresses of
this module's own subnet; every command run "on host i" also gets a mount and UTS namespace of
its own: hostname ``node<i>``, a fresh, empty tmpfs on ``/dev/shm`` that neither the other host nor
the root namespace can see, and an ``/etc/hosts`` naming both nodes (bind-mounted over the real one
inside that private mount namespace only)::

    ip netns exec <ns> unshare --mount --uts --propagation private \
        sh -c 'mount -t tmpfs tmpfs /dev/shm && mount --bind <hosts> /etc/hosts && hostname node<i> && exec "$@"'

Usage::

    ok, reason = available()           # (False, why) where namespaces cannot be created
    with two_hosts() as hosts:
        results = hosts.run_on_both([argv0, argv1], timeout=60)

Everything is bounded: commands are killed (every process of the host's network namespace,
whatever session or process group it put itself in) once their time is up, and the namespaces
are deleted on the way out, also on errors. Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN), ``ip``
(iproute2), ``unshare`` and ``mount`` (util-linux).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUBNET = "10.231.77"  # an unusual private /24; it exists only inside the namespaces created here
_counter = itertools.count()

# Variables of the caller's own launch that must not leak into the hosts' processes.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "TORCHELASTIC_RUN_ID",
                "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOSTNAME")

# Run on host i: a private mount + UTS namespace inside the host's network namespace.
# ODC_SHM_SIZE (e.g. "16k") makes that host's /dev/shm small, as a container's default 64 MB is.
_ENTER = ('mount -t tmpfs -o "mode=1777${ODC_SHM_SIZE:+,size=$ODC_SHM_SIZE}" tmpfs /dev/shm '
          '&& mount --bind "$ODC_HOSTS_FILE" /etc/hosts && hostname "$ODC_HOSTNAME" && exec "$@"')


def _ip(*args: str, timeout: float = 10.0, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _kill_netns_processes(netns: str, deadline_s: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` (``ip netns pids``) until none is left or time is up."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            done = _ip("netns", "pids", netns, check=False, timeout=5)
        except subprocess.TimeoutExpired:
            continue
        pids = [int(p) for p in done.stdout.split() if p.strip().isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _delete_netns(netns: str) -> None:
    _kill_netns_processes(netns)
    with contextlib.suppress(Exception):
        _ip("netns", "delete", netns, check=False)


@dataclass
class Host:
    index: int
    hostname: str  # node<i>
    netns: str
    ifname: str  # this end of the veth pair
    addr: str


@dataclass
class Result:
    host: Host
    returncode: Optional[int]  # None: killed at the timeout
    output: str  # stdout and stderr together
    seconds: float
    timed_out: bool = False

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.host.hostname} rc={self.returncode} timed_out={self.timed_out} ---\n{self.output[-chars:]}"


@dataclass
class TwoHosts:
    hosts: List[Host]
    workdir: str
    hosts_file: str
    _procs: List[Tuple[Host, subprocess.Popen]] = field(default_factory=list)

    @property
    def master_addr(self) -> str:
        return self.hosts[0].addr

    def env(self, index: int, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """The environment of a process on host ``index``: the caller's, less its own launch variables,
        plus the CPU accelerator, one thread, the repository on PYTHONPATH and gloo on the veth."""
        host = self.hosts[index]
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        # PATH stays the caller's (torch picks ninja from it: a different one recompiles the CPU comm op);
        # the interpreter's bin directory is only appended where it is missing, for torchrun/deepspeed
        bindir = os.path.dirname(sys.executable)
        path = env.get("PATH", "")
        if bindir not in path.split(os.pathsep):
            env["PATH"] = path + os.pathsep + bindir if path else bindir
        env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".venv", "torch_extensions"))
        env.update({
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p),
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": host.ifname,
            "MASTER_ADDR": self.master_addr,
            "HOSTNAME": host.hostname,
            "ODC_HOSTNAME": host.hostname,
            "ODC_HOSTS_FILE": self.hosts_file,
        })
        env.update(extra or {})
        return env

    def command(self, index: int, argv: Sequence[str]) -> List[str]:
        """``argv`` wrapped to run on host ``index`` (needs :meth:`env`'s ODC_HOSTNAME/ODC_HOSTS_FILE)."""
        return ["ip", "netns", "exec", self.hosts[index].netns, "unshare", "--mount", "--uts", "--propagation",
                "private", "sh", "-c", _ENTER, "sh", *argv]

    def start(self, index: int, argv: Sequence[str], extra_env: Optional[Dict[str, str]] = None,
              log_path: Optional[str] = None) -> subprocess.Popen:
        host = self.hosts[index]
        log_path = log_path or os.path.join(self.workdir, f"{host.hostname}-{next(_counter)}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self.command(index, argv), env=self.env(index, extra_env), cwd=ROOT,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        proc.log_path = log_path  # type: ignore[attr-defined]
        self._procs.append((host, proc))
        return proc

    def kill_all(self) -> None:
        """Kill every process on both hosts (whatever session they moved to) and reap ours."""
        for host in self.hosts:
            _kill_netns_processes(host.netns)
        for _, proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._procs = [(h, p) for h, p in self._procs if p.poll() is None]

    def run_on_both(self, argvs: Sequence[Sequence[str]], timeout: float = 60.0,
                    extra_env: Optional[Sequence[Optional[Dict[str, str]]]] = None) -> List[Result]:
        """Run ``argvs[i]`` on host i, both at once; wait at most ``timeout`` s for both, then kill what
        is left (on both hosts). Returns one :class:`Result` per host."""
        return self.wait(self.start_on_both(argvs, extra_env), timeout)

    def start_on_both(self, argvs: Sequence[Sequence[str]],
                      extra_env: Optional[Sequence[Optional[Dict[str, str]]]] = None) -> List[subprocess.Popen]:
        extra_env = extra_env or [None] * len(argvs)
        procs = [self.start(i, argv, extra_env[i]) for i, argv in enumerate(argvs)]
        for proc in procs:
            proc.started_at = time.monotonic()  # type: ignore[attr-defined]
        return procs

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> List[Result]:
        """Wait at most ``timeout`` s (from their start) for ``procs`` (one per host, from
        :meth:`start_on_both`); kill everything on both hosts that is left then. One Result per host."""
        start = min(proc.started_at for proc in procs)  # type: ignore[attr-defined]
        ended: List[Optional[float]] = [None] * len(procs)
        try:
            while any(e is None for e in ended) and time.monotonic() - start <= timeout:
                for i, proc in enumerate(procs):
                    if ended[i] is None and proc.poll() is not None:
                        ended[i] = time.monotonic() - start
                time.sleep(0.1)
        finally:
            if any(e is None for e in ended):  # timed out, or interrupted
                self.kill_all()
            else:  # both launchers ended: anything they left behind on the hosts goes too
                for host in self.hosts:
                    _kill_netns_processes(host.netns, deadline_s=5)
        results = []
        for i, proc in enumerate(procs):
            with open(proc.log_path, errors="replace") as log:  # type: ignore[attr-defined]
                output = log.read()
            finished = ended[i] is not None
            results.append(Result(self.hosts[i], proc.returncode if finished else None, output,
                                  ended[i] if finished else time.monotonic() - start, timed_out=not finished))
        return results


def sweep_stale(prefix: str = "odc") -> List[str]:
    """Delete namespaces this module made in a run that was killed before it could clean up
    (``<prefix>-<pid>x<n>-node<i>`` whose pid is gone and that hold no process). Returns their names."""
    done = _ip("netns", "list", check=False)
    stale = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{re.escape(prefix)}-(\d+)x\d+-node\d", name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its test run is still alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if _ip("netns", "pids", name, check=False).stdout.strip():
            continue
        _ip("netns", "delete", name, check=False)
        stale.append(name)
    return stale


@contextlib.contextmanager
def two_hosts(prefix: str = "odc") -> Iterator[TwoHosts]:
    """Create two network namespaces joined by a veth pair (``SUBNET``.1 and .2, links and loopback up),
    yield a :class:`TwoHosts`, and delete everything again (processes, namespaces, temp files)."""
    with contextlib.suppress(Exception):
        sweep_stale(prefix)
    tag = f"{os.getpid()}x{next(_counter)}"
    hosts = [Host(i, f"node{i}", f"{prefix}-{tag}-node{i}", f"{prefix}{tag}{'ab'[i]}"[:15], f"{SUBNET}.{i + 1}")
             for i in range(2)]
    workdir = tempfile.mkdtemp(prefix=f"{prefix}-two-hosts-")
    hosts_file = os.path.join(workdir, "hosts")
    with open(hosts_file, "w") as out:
        out.write("127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.hostname}\n" for h in hosts))
    os.chmod(workdir, 0o755)
    pair = TwoHosts(hosts, workdir, hosts_file)
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
        a, b = hosts
        _ip("link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname, "netns", b.netns)
        for host in hosts:
            # IPv4 only: no IPv6 link-local address for gloo or the rendezvous to pick instead
            for knob in ("all", "default"):
                subprocess.run(["ip", "netns", "exec", host.netns, "sh", "-c",
                                f"echo 1 > /proc/sys/net/ipv6/conf/{knob}/disable_ipv6"],
                               capture_output=True, timeout=10)
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
        yield pair
    finally:
        try:
            pair.kill_all()
        finally:
            for host in hosts:
                _delete_netns(host.netns)  # deleting a namespace deletes its end of the veth, and so the pair
            shutil.rmtree(workdir, ignore_errors=True)


_available: Optional[Tuple[bool, str]] = None


def available() -> Tuple[bool, str]:
    """``(True, "")`` where two hosts can be made here, else ``(False, reason)``: tries to create a
    namespace, enter it with a private mount + UTS namespace and a fresh /dev/shm, and delete it."""
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> Tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    missing = [tool for tool in ("ip", "unshare", "mount", "sh") if shutil.which(tool) is None]
    if missing:
        return False, f"missing {', '.join(missing)} (iproute2/util-linux) to create namespaces"
    if os.geteuid() != 0:
        return False, f"creating network/mount namespaces needs root (euid {os.geteuid()})"
    netns = f"odcprobe-{os.getpid()}x{next(_counter)}"
    try:
        done = _ip("netns", "add", netns, check=False)
        if done.returncode != 0:
            return False, f"cannot create a network namespace (ip netns add): {done.stderr.strip()}"
        probe = subprocess.run(["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation", "private",
                                "sh", "-c", "mount -t tmpfs tmpfs /dev/shm && hostname odcprobe && hostname"],
                               capture_output=True, text=True, timeout=20)
        if probe.returncode != 0 or probe.stdout.strip() != "odcprobe":
            return False, ("cannot give a namespace its own hostname and /dev/shm (unshare --mount --uts; "
                           f"mount -t tmpfs): {(probe.stderr or probe.stdout).strip()}")
        return True, ""
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"cannot create namespaces: {err}"
    finally:
        _delete_netns(netns)
