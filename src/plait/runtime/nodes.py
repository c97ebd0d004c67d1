"""A training job over several machines: which node this launcher is, where the job meets, and the
torchrun arguments that say so.

Every node runs one launcher (`plait train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`) with the
same `--nproc` ranks. torchrun's static rendezvous keeps the node ranks as given: node 0 serves the
rendezvous store at HOST:PORT, and the rank of local rank L on node R is R * nproc + L, the way ranks are
numbered on one node. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plait.errors import PlaitError
from plait.plan import Plan

MAX_PORT = 65535
"""Largest TCP port number."""
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
"""Endpoint hosts that put every node on this machine (tests; their files are shared)."""


@dataclass(frozen=True)
class Nodes:
    """This launcher's place in a job of `count` nodes: it is node `rank`; `endpoint` is HOST:PORT of
    node 0's rendezvous store (None on one node)."""

    count: int = 1
    rank: int = 0
    endpoint: str | None = None

    @property
    def several(self) -> bool:
        return self.count > 1

    @property
    def local(self) -> bool:
        """Whether every node is this machine (the endpoint is a loopback address)."""
        return self.endpoint is not None and self.endpoint.rpartition(":")[0] in LOOPBACK_HOSTS


def parse_nodes(count: int, rank: int, endpoint: str | None) -> Nodes:
    """The checked `--nnodes`, `--node-rank` and `--rdzv-endpoint` (PlaitError naming the one to fix)."""
    if count < 1:
        raise PlaitError(f"--nnodes must be a positive number of machines, got {count}")
    if not 0 <= rank < count:
        raise PlaitError(f"--node-rank must be in 0..{count - 1} for --nnodes {count}, got {rank}")
    if count == 1:
        if endpoint is not None or rank:
            raise PlaitError("--rdzv-endpoint and --node-rank are for --nnodes 2 or more; drop them to train on "
                             "this machine")
        return Nodes()
    if endpoint is None:
        raise PlaitError(f"--nnodes {count} needs --rdzv-endpoint HOST:PORT, the address of node 0 (the same on "
                         "every node)")
    host, colon, port = endpoint.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) <= MAX_PORT:
        raise PlaitError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; give e.g. 10.0.0.1:29500 (node 0's "
                         "address and a free port)")
    return Nodes(count, rank, endpoint)


def torchrun_args(nodes: Nodes, nproc: int, timeout_s: float, max_restarts: int) -> list[str]:
    """torchrun's arguments for `nproc` ranks on this node; nodes that have not all met within `timeout_s`
    seconds end the job."""
    common = [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if not nodes.several:
        return ["--standalone", *common]
    return [f"--nnodes={nodes.count}", f"--node-rank={nodes.rank}", "--rdzv-backend=static",
            f"--rdzv-endpoint={nodes.endpoint}", f"--rdzv-conf=timeout={max(1, round(timeout_s))}", *common]


def check_world(plan: Plan, nodes: Nodes, world: int) -> int:
    """Ranks per node of a job of `world` ranks; PlaitError when they do not split evenly over the nodes or
    the plan's devices are not the job's ranks."""
    devices = len(plan.ranks)
    if world % nodes.count:
        raise PlaitError(f"{world} ranks do not split evenly over --nnodes {nodes.count}; give --nproc, the ranks "
                         "of each node")
    nproc = world // nodes.count
    if devices != world or plan.ranks[-1] != world - 1:
        hint = f"--nproc {devices // nodes.count}" if devices % nodes.count == 0 else "a plan"
        raise PlaitError(f"the plan uses {devices} devices (ranks {plan.ranks[0]}..{plan.ranks[-1]}) but --nnodes "
                         f"{nodes.count} x --nproc {nproc} launches {world} ranks; give {hint} for "
                         f"{nodes.count} x --nproc ranks")
    return nproc


def node_notes(plan: Plan, nodes: Nodes, nproc: int, checkpoint_dir: Path | None) -> list[str]:
    """What to know about a job over several nodes: tensor-parallel groups wider than a node (their
    all-reduces cross the network), and checkpoints every node must be able to read."""
    if not nodes.several:
        return []
    found = []
    tp = max(s.tp for p in plan.pipelines for stage in p.stages for s in stage.strategies)
    if tp > nproc:
        found.append(f"the plan's tp={tp} is wider than a node's {nproc} ranks: its all-reduces cross nodes")
    if checkpoint_dir is not None and not nodes.local:
        found.append(f"--checkpoint-dir {str(checkpoint_dir)!r} must be one shared directory (e.g. NFS) that "
                     "every node sees at this path: each node's ranks write their own shards into it")
    return found
