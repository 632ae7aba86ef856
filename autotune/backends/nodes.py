"""Real trials over several nodes: one ``autotune`` agent per node, the same command on every node.

    autotune trial|search|verify --backend local --nodes N --gpus G --rdzv-endpoint HOST:PORT   (on every node)

The agent on the machine named by ``HOST`` that binds ``PORT`` first is the *driver*; the others are *followers*
(``NodeGroup.open``). The driver hosts a ``TCPStore`` at the endpoint for the whole command, decides what runs
(the search, verify's queue, the trial) and, for every trial, publishes its spec under a job number; every agent
then launches the same ``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id <trial's id>`` on its node. torchrun's c10d rendezvous finds the endpoint taken by the driver's store and
joins it as a client (``c10d_rendezvous_backend._create_tcp_store`` falls back to a client when it cannot host),
so every trial rendezvouses in the one store under its own id. Each follower posts its ranks' records, its
torchrun's exit and the tail of its output back; the driver merges the ranks of every node
(``local.merge_rank_records``: an OOM anywhere is ``oom``, the earliest error a rank wrote is the root cause, a
node that never reported is an error naming it), so a failure on any node is classified as on one node. At the
end the driver publishes ``stop`` (with ``trial``'s merged record, which every follower prints too) and waits for
the followers to read it.

Under Slurm, ``srun`` runs the same command on every node with ``HOST`` the first node of the allocation
(the first line of ``scontrol show hostnames``); on one machine, two agents on 127.0.0.1 act as two nodes (the tests).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

from trials.core.errors import ConfigError

PREFIX = "autotune/"
POLL_S = 0.5
STOP_GRACE_S = 60.0  # how long the driver waits for the followers to read ``stop``


def parse_endpoint(text: str, what: str = "--rdzv-endpoint") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); a bad one is a ``ConfigError`` (bad input)."""
    host, sep, port = (text or "").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{what} {text!r} must be HOST:PORT with a port in 1..65535")
    return host, int(port)


def _is_this_machine(host: str) -> bool:
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(host)


@dataclass
class NodeResult:
    """What one follower ran for one job: its ranks' records (as dicts), torchrun's exit, its output's tail."""

    node: int
    ranks: list[dict]
    returncode: int | None
    timed_out: bool
    tail: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeResult:
        return cls(**json.loads(text))


class NodeGroup:
    """The agents of one multi-node command (see the module docstring). ``driver``: this agent decides."""

    def __init__(self, host: str, port: int, nodes: int, store, driver: bool, node: int):
        self.host, self.port, self.nodes = host, port, nodes
        self.store, self.driver, self.node = store, driver, node
        self.jobs_published = 0
        self.token = secrets.token_hex(4)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def open(cls, endpoint: str, nodes: int, connect_timeout_s: float = 600.0) -> NodeGroup:
        """Host the endpoint's store (the driver) when ``HOST`` is this machine and ``PORT`` is free, else connect
        to it as a follower (waiting up to ``connect_timeout_s`` for the driver to start)."""
        from torch.distributed import TCPStore

        host, port = parse_endpoint(endpoint)
        if nodes < 2:
            raise ConfigError("a node group needs --nodes 2 or more")
        if _is_this_machine(host):
            try:
                store = TCPStore(
                    host,
                    port,
                    is_master=True,
                    wait_for_workers=False,
                    multi_tenant=True,
                    timeout=timedelta(seconds=connect_timeout_s),
                )
                return cls(host, port, nodes, store, driver=True, node=0)
            except (RuntimeError, ValueError, TimeoutError):
                pass  # the port is taken: by the driver of this command on this machine (or by something else)
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_timeout_s))
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise ConfigError(
                f"--rdzv-endpoint {endpoint}: cannot reach the driver's store there ({str(exc).splitlines()[0][:200]})"
            ) from None
        node = int(store.add(PREFIX + "followers", 1))
        if node >= nodes:
            raise ConfigError(
                f"--rdzv-endpoint {endpoint}: {node + 1} agents joined a {nodes}-node job "
                f"(is another command using this endpoint?)"
            )
        return cls(host, port, nodes, store, driver=False, node=node)

    # -- the driver --------------------------------------------------------------------------------------------
    def publish(self, job: dict) -> tuple[int, str]:
        """Publish one trial for every node; returns (its job number, its torchrun rendezvous id)."""
        number = self.jobs_published
        self.jobs_published += 1
        rdzv_id = f"autotune-{self.token}-{number}"
        self.store.set(f"{PREFIX}job/{number}", json.dumps(dict(job, rdzv_id=rdzv_id)))
        return number, rdzv_id

    def collect(self, number: int, wait_s: float) -> list[NodeResult]:
        """The followers' results of job ``number``, waiting up to ``wait_s`` for them; a follower that has not
        reported by then is left out (its ranks are then missing from the merge, which says so)."""
        keys = {node: f"{PREFIX}result/{number}/{node}" for node in range(1, self.nodes)}
        results: list[NodeResult] = []
        deadline = time.monotonic() + wait_s
        while keys:
            for node, key in list(keys.items()):
                if self.store.check([key]):
                    results.append(NodeResult.from_json(self.store.get(key)))
                    del keys[node]
            if not keys or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return results

    def finish(self, final: dict | None = None) -> None:
        """Tell every follower to stop (with ``final``, e.g. ``trial``'s merged record) and wait until they read it."""
        if not self.driver:
            return
        self.store.set(f"{PREFIX}job/{self.jobs_published}", json.dumps({"stop": True, "final": final}))
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            try:
                if int(self.store.add(PREFIX + "stopped", 0)) >= int(self.store.add(PREFIX + "followers", 0)):
                    return
            except RuntimeError:
                return
            time.sleep(POLL_S)

    # -- a follower --------------------------------------------------------------------------------------------
    def jobs(self) -> Iterator[tuple[int, dict]]:
        """The driver's jobs in order, until ``stop``; ``self.final`` then holds what came with it. A driver that
        goes away ends the iteration with the store's ``RuntimeError``."""
        number = 0
        self.final = None
        while True:
            key = f"{PREFIX}job/{number}"
            while not self.store.check([key]):
                time.sleep(POLL_S)
            job = json.loads(self.store.get(key))
            if job.get("stop"):
                self.final = job.get("final")
                self.store.add(PREFIX + "stopped", 1)
                return
            yield number, job
            number += 1

    def report(self, number: int, result: NodeResult) -> None:
        self.store.set(f"{PREFIX}result/{number}/{self.node}", result.to_json())
