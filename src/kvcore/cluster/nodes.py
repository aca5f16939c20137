"""The Ray nodes replicas may run on: each must hold the model directory at the same path.

Checked twice: before deploying, by a zero-CPU task pinned to every live node that has the
resources of one replica (so a node without it is a start-up error naming the node and the path,
instead of a replica Ray Serve retries forever), and by each replica before it loads anything
(a node that joins later: the same message, in Ray Serve's deployment status).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

PROBE_TIMEOUT_S = 120.0  # a node starts a Python worker for the probe


class ModelNotOnNode(FileNotFoundError):
    """The model directory is missing (or not a model directory) on a Ray node."""


def model_dir_problem(model: str) -> str | None:
    """What is wrong with the model directory on this machine, or None."""
    path = Path(model)
    if not path.is_dir():
        return f"the model directory {model} does not exist"
    if not (path / "config.json").is_file():
        return f"the model directory {model} has no config.json"
    return None


def this_node() -> str:
    """This process's Ray node: its address and id (several nodes may share a machine)."""
    context = ray.get_runtime_context()
    return f"Ray node {ray.util.get_node_ip_address()} (node id {context.get_node_id()})"


def check_model_here(model: str) -> None:
    """In a replica, before loading: ModelNotOnNode naming this node and the path."""
    problem = model_dir_problem(model)
    if problem is not None:
        raise ModelNotOnNode(f"{problem} on {this_node()}: every node a replica can run on "
                             "needs the model at the same path")


@ray.remote(num_cpus=0)
def _probe(model: str) -> str | None:
    problem = model_dir_problem(model)
    return None if problem is None else f"{problem} on {this_node()}"


def fits(total: Mapping[str, float], demand: Mapping[str, float]) -> bool:
    """Whether a node with these total resources can hold one replica of this demand."""
    return all(total.get(name, 0.0) >= amount for name, amount in demand.items() if amount > 0)


def check_model_on_nodes(model: str, demand: Mapping[str, float]) -> int:
    """Probe every live node that fits one replica (`demand`: Ray resource -> amount); raise
    ModelNotOnNode listing each node without the model. Returns the number of nodes probed."""
    nodes: list[dict[str, Any]] = [n for n in ray.nodes()
                                   if n["Alive"] and fits(n["Resources"], demand)]
    refs = [_probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(model) for n in nodes]
    problems = [p for p in ray.get(refs, timeout=PROBE_TIMEOUT_S) if p is not None]
    if problems:
        raise ModelNotOnNode("; ".join(problems) + ": every node a replica can run on needs "
                             "the model at the same path (a shared filesystem, or `kvcore pull` "
                             "/ a copy on each node)")
    return len(nodes)
