"""Real ``vllm serve`` processes (P and D) on CPU, with fault controls and bounded waits.

Each server runs in its own process group (``kvfail.rig.processes.PeerProcess``), so SIGKILL
and SIGSTOP reach the EngineCore and Worker children too: those hold the KV side channel,
not the API process. Every listener is bound to 127.0.0.1; `listeners_of` lets a test check.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx2 as httpx

from kvfail.faults.netns import NamespaceHost
from kvfail.peers.base import link_env
from kvfail.rig.processes import PeerProcess

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
Connector = Literal["nixl", "mooncake"]
Role = Literal["kv_producer", "kv_consumer"]
#: Whose connector a server runs: kvfail's (``connectors/``), upstream vLLM's, or
#: upstream's wrapped by kvfail's guard (``connectors.guard``).
Impl = Literal["kvfail", "upstream", "guard"]

#: Every server's environment: vLLM's CPU build, several servers sharing a small machine
#: (a 1 GiB KV cache each, OpenMP threads not pinned to cores, which every server would
#: pin to the same ones), and no network (the model is local; no usage statistics).
BASE_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # Three servers share 2 cores: one compute thread each, and no OpenMP spin-wait after
    # a parallel region (Intel OpenMP spins 200 ms by default). Spinning threads starved
    # the other servers' engine loops for seconds, enough to pass a 5 s KV deadline.
    "OMP_NUM_THREADS": "1",
    "KMP_BLOCKTIME": "0",
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_NO_USAGE_STATS": "1",
    # The worker runs inside the engine core process (no VLLM::Worker): the CPU platform
    # keeps the multiprocess executor unless this is 0, and with it, the engine core and
    # its worker hand every step over a shared-memory queue whose reader can miss a
    # wake-up and then sleeps up to 5 s (SHM_READER_RECHECK_INTERVAL_MS). On two busy
    # cores that stalled a D for several times a 5 s deadline with both sides waiting
    # (stacks in e2e/README.md), long enough to hide that deadline. The API server stays
    # a process of its own.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": HOST,
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "MC_LOG_LEVEL": "WARNING",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
    # NIXL agents poll with a 100 µs pause instead of a busy spin (kvfail.rig.nixl_progress).
    "KVFAIL_NIXL_PTHR_DELAY_US": "100",
    # Stats reach the log line "KV Transfer metrics: ..." every interval.
    "VLLM_LOG_STATS_INTERVAL": "1",
}

#: Modules `vllm serve` needs beyond the scheduler's pins: requirements/serve.txt, which
#: scripts/setup.sh installs into the venv. KVFAIL_E2E_DEPS may name an extra directory
#: for a venv set up otherwise.
DEPS_DIR = Path(os.environ.get("KVFAIL_E2E_DEPS", "/nonexistent/kvfail-e2e-deps"))
SERVE_MODULES = (
    "watchfiles",
    "setproctitle",
    "pythonjsonlogger",
    "prometheus_fastapi_instrumentator",
    "blake3",
    "ijson",
    "compressed_tensors",
    "loguru",
    "model_hosting_container_standards",
    "jmespath",
)

#: Server start budget: minutes on a small CPU machine, more with several servers starting.
START_TIMEOUT_S = 420.0


@dataclass
class ServerSpec:
    """What distinguishes one server: its role, connector (kvfail's or upstream's) and D's
    failure policy. ``deadline_s`` is kvfail's load deadline; upstream's connectors have none."""

    name: str
    connector: Connector
    role: Role
    policy: Literal["fail", "recompute"] = "fail"
    deadline_s: float = 5.0
    engine_id: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    impl: Impl = "kvfail"
    #: A simulated host's link (:mod:`kvfail.faults.netns`): P runs inside that host and
    #: serves on its address, D stays in the test's namespace and advertises its own end
    #: of the link. None: every server on loopback.
    link: NamespaceHost | None = None

    @property
    def address(self) -> str:
        """The address this server's engine and (for P) its API are reached at."""
        if self.link is None:
            return HOST
        return self.link.inner_addr if self.role == "kv_producer" else self.link.outer_addr

    @property
    def api_host(self) -> str:
        """P on a simulated host serves its API there; everything else on loopback."""
        return self.address if self.role == "kv_producer" else HOST

    def link_env(self) -> dict[str, str]:
        """What makes the transports serve and advertise on :attr:`address`."""
        if self.link is None:
            return {}
        return link_env(self.link, inside=self.role == "kv_producer")


@dataclass
class VllmServer:
    """One running ``vllm serve``; ``close`` leaves no process of its group behind."""

    spec: ServerSpec
    model: str
    port: int
    side_port: int
    proc: PeerProcess
    log_path: Path
    #: The server's own TMPDIR (see :func:`start_server`), removed by :meth:`close`.
    tmp_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.api_host}:{self.port}"

    @property
    def bootstrap_addr(self) -> str:
        """Mooncake P's bootstrap server address, as D expects it (with the scheme)."""
        return f"http://{self.spec.address}:{self.side_port}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Poll /health, then require one real completion: a bad attention config only fails
        on the first request, after /health is already 200. Returns the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with httpx.Client(timeout=10.0) as client:
            while True:
                if not self.proc.alive:
                    raise RuntimeError(f"{self.spec.name} died\n{self.tail()}")
                self.check_log()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.spec.name} not healthy in {timeout_s}s\n{self.tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
            r = client.post(
                f"{self.url}/v1/completions",
                json={
                    "model": self.model,
                    "prompt": [5, 6, 7, 8],
                    "max_tokens": 2,
                    "temperature": 0,
                    "return_token_ids": True,
                },
                timeout=120.0,
            )
            if r.status_code != 200:
                raise RuntimeError(f"{self.spec.name} warm-up got {r.status_code}: {r.text}")
        return time.monotonic() - t0

    def check_log(self) -> None:
        """Fail fast on errors that leave the server "healthy" but unable to transfer KV."""
        text = self.log_text() if self.log_path.exists() else ""
        for bad in ("Address already in use", "Exception in thread"):
            if bad in text:
                raise RuntimeError(f"{self.spec.name}: {bad!r} in its log\n{self.tail()}")

    def metrics(self) -> dict[str, float]:
        """D's Prometheus metrics, as ``{"name{labels}": value}``, without HELP/TYPE lines."""
        r = httpx.get(f"{self.url}/metrics", timeout=10.0)
        r.raise_for_status()
        return parse_prometheus(r.text)

    def metrics_or_none(self) -> dict[str, float] | None:
        """:meth:`metrics`, or None while the server does not answer in time (a P just
        thawed works through its backlog first, which can outlast a request's timeout)."""
        try:
            return self.metrics()
        except httpx.HTTPError:
            return None

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def dump_stacks(self, settle_s: float = 0.5) -> str:
        """Every thread's Python stack, from every process of this server that catches
        SIGUSR1 (``e2e.launcher`` registers faulthandler for it; a process that does not,
        like multiprocessing's resource tracker, would die of it and is left alone).
        One process at a time, ``settle_s`` apart: they share the log file, and dumps
        written at once interleave. Returns the dumps as written to the log."""
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        sent = [pid for pid in self.proc.group_members() if _catches(pid, signal.SIGUSR1)]
        for pid in sent:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(settle_s)
        with self.log_path.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith(_STACK_LINES)]
        return f"{self.spec.name} pids {sent}:\n" + "\n".join(lines)

    def close(self) -> None:
        self.proc.close(grace_s=3.0, timeout_s=15.0)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)


#: How faulthandler's dump lines begin.
_STACK_LINES = ("Thread 0x", "Current thread 0x", '  File "', "  <no Python frame>")


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric(m: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of series named ``name`` whose labels include ``labels`` (0.0 when absent)."""
    total = 0.0
    for key, value in m.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def upstream_transfer_config(connector: Connector) -> dict[str, Any]:
    """Upstream's connector with this tier's transport settings (``e2e.upstream`` for
    Mooncake's)."""
    if connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    return {
        "kv_connector": "UpstreamMooncakeConnector",
        "kv_connector_module_path": "e2e.upstream",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }


def guard_transfer_config(connector: Connector, deadline_s: float) -> dict[str, Any]:
    """Upstream's connector inside kvfail's guard: the guard's one-line configuration,
    ``inner`` naming upstream's class and ``inner_extra_config`` its extra config."""
    inner = upstream_transfer_config(connector)
    module = inner.pop("kv_connector_module_path", None)
    name = inner.pop("kv_connector")
    return {
        **inner,
        "kv_connector": "KvfailGuardConnector",
        "kv_connector_module_path": "connectors.guard",
        "kv_connector_extra_config": {
            "inner": name if module is None else f"{module}:{name}",
            "inner_extra_config": inner.pop("kv_connector_extra_config", {}),
            "deadline_s": deadline_s,
        },
    }


def kv_transfer_config(spec: ServerSpec) -> dict[str, Any]:
    """kvfail's connector loaded by module path, with a short deadline for a silent P;
    upstream's with the same transport settings; or upstream's inside the guard."""
    if spec.impl == "upstream":
        cfg = upstream_transfer_config(spec.connector)
    elif spec.impl == "guard":
        cfg = guard_transfer_config(spec.connector, spec.deadline_s)
    elif spec.connector == "nixl":
        cfg = {
            "kv_connector": "KvfailNixlConnector",
            "kv_connector_module_path": "connectors.nixl",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kvfail_deadline_s": spec.deadline_s},
        }
    else:
        cfg = {
            "kv_connector": "KvfailMooncakeConnector",
            "kv_connector_module_path": "connectors.mooncake",
            "kv_connector_extra_config": {
                "mooncake_protocol": "tcp",
                "kvfail_deadline_s": spec.deadline_s,
                "kvfail_probe_interval_s": 0.2,
            },
        }
    cfg["kv_role"] = spec.role
    cfg["kv_load_failure_policy"] = spec.policy
    if spec.engine_id:
        cfg["engine_id"] = spec.engine_id
    return cfg


def start_server(spec: ServerSpec, model: str, log_dir: Path) -> VllmServer:
    """Spawn ``vllm serve`` through our launcher; returns at once (call ``wait_ready``).

    cwd is the repo root and PYTHONPATH names it, so the engine's spawned children can import
    ``connectors``. Output goes to a file, not a pipe: a pipe nobody reads for minutes would
    fill and block the server.
    """
    port, side_port = stable_ports(2)
    env = dict(BASE_ENV)
    paths = (str(REPO), str(DEPS_DIR), os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if spec.connector == "nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    else:
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(side_port)
        env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = "30"
    # vLLM leaves its rendezvous file (``vllm_dist_*``) and IPC sockets in TMPDIR; a
    # killed server never removes them. A short directory of its own (socket paths have a
    # length limit) goes away with the server.
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvf-srv-"))
    env["TMPDIR"] = str(tmp_dir)
    env.update(spec.link_env())
    env.update(spec.extra_env)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}-{port}.log"
    argv = [
        sys.executable,
        "-m",
        "e2e.launcher",
        "serve",
        model,
        "--host",
        spec.api_host,
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        # The worker runs inside the engine core process (VLLM_ENABLE_V1_MULTIPROCESSING).
        "--distributed-executor-backend",
        "uni",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(spec)),
    ]
    # PeerProcess pipes stdout; redirect it into the log file through a tiny shell-free trick:
    # run the launcher with its own stdout bound to the file.
    wrapper = [sys.executable, "-c", _TEE, str(log_path), *argv]
    if spec.link is not None and spec.role == "kv_producer":
        wrapper = spec.link.exec_argv(wrapper)  # exec'd in place: same pid, same group
    try:
        proc = PeerProcess(wrapper, name=spec.name, env=env, cwd=REPO, max_lines=10)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return VllmServer(spec, model, port, side_port, proc, log_path, tmp_dir)


#: exec the real command with stdout/stderr on the log file (same pid, same group).
_TEE = (
    "import os,sys\n"
    "fd=os.open(sys.argv[1],os.O_WRONLY|os.O_CREAT|os.O_APPEND,0o644)\n"
    "os.dup2(fd,1);os.dup2(fd,2)\n"
    "os.execv(sys.argv[2],sys.argv[2:])\n"
)


def stable_ports(n: int) -> list[int]:
    """`n` free ports on 127.0.0.1 *below* the kernel's ephemeral range.

    Why: a server binds its side channel only late in its long startup. A port taken from
    the ephemeral range (what ``bind(port 0)`` hands out) can meanwhile be handed to one of the
    many sockets vLLM, zmq and UCX open with port 0 in the other servers; it happened: P's
    NIXL listener thread died with ``Address already in use`` while P reported healthy.
    Ports below the range are never handed out for port 0.
    """
    low = 20000
    try:
        low_eph = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low_eph = 32768
    rng = random.Random()
    chosen: list[int] = []
    for _ in range(2000):
        port = rng.randrange(low, max(low + 1000, low_eph))
        if port in chosen or port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == n:
            _handed_out.update(chosen)
            return chosen
    raise RuntimeError("no free port below the ephemeral range")


_handed_out: set[int] = set()


def listeners_of(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP listener owned by ``pids``, from /proc (no ``ss`` needed)."""
    inodes: set[str] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in fd_dir.iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                m = re.fullmatch(r"socket:\[(\d+)\]", target)
                if m:
                    inodes.add(m.group(1))
        except OSError:
            continue
    found: list[tuple[str, int]] = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A = LISTEN
                continue
            addr_hex, port_hex = cols[1].split(":")
            found.append((_addr(addr_hex, v6), int(port_hex, 16)))
    return found


def _addr(hex_addr: str, v6: bool) -> str:
    if not v6:
        return ".".join(str(int(hex_addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
    if int(hex_addr, 16) == 0:
        return "::"
    return "::1" if hex_addr == "00000000000000000000000001000000" else hex_addr


def missing_serve_modules() -> list[str]:
    """Modules the server would fail to import, looked up with DEPS_DIR on the path."""
    import importlib.util

    added = str(DEPS_DIR) not in sys.path
    if added:
        sys.path.append(str(DEPS_DIR))
    try:
        return [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    finally:
        if added:
            sys.path.remove(str(DEPS_DIR))
