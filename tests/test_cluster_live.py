"""Two kvcore replicas on a local Ray Serve (CPU, the default model) behind the ingress: the
prefix router's cached-token share against round-robin's, and a replica killed mid-stream."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve")

import requests  # noqa: E402  (a dependency of ray[serve])

from kvcore.cluster.app import Cluster, ClusterOptions, connect_ray  # noqa: E402
from kvcore.cluster.policy import RoutingPolicy  # noqa: E402
from kvcore.cluster.serve import build_app  # noqa: E402
from kvcore.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from service_live import LiveServer  # noqa: E402

BS = 16
PREFIX_BLOCKS = 5
# per replica: three groups' prefixes (15 blocks) plus one running request (6) fit, five do not,
# so a router that spreads every group over both replicas thrashes the LRU cache
NUM_BLOCKS = 24
NUM_GROUPS = 5
NUM_ROUNDS = 4
MAX_NUM_SEQS = 8  # per replica
MAX_WAITING = 4  # the ingress's --max-waiting (the other tests never have more than 2 in flight)


@pytest.fixture(scope="module")
def cluster(default_model_dir: Path) -> Iterator[tuple[LiveServer, Cluster]]:
    options = ClusterOptions(num_replicas=2, router="prefix", cpus_per_replica=1.0,
                             local_num_cpus=2)
    started = connect_ray(options)
    config = EngineConfig(model=str(default_model_dir), device="cpu",
                          cache=CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256,
                                                    max_num_seqs=MAX_NUM_SEQS))
    clusters: list[Cluster] = []
    server = LiveServer(lambda: build_app(config, options, clusters, started,
                                          served_model_name="smol",
                                          max_waiting=MAX_WAITING)).start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # Ray starts the replicas; they load the model
            if requests.get(f"{server.url}/health", timeout=10).status_code == 200:
                break
            time.sleep(1)
        else:
            raise RuntimeError("the cluster did not become ready")
        yield server, clusters[0]
    finally:
        server.stop()
        for c in clusters:
            c.shutdown()


def _complete(url: str, prompt: list[int], **body: Any) -> dict[str, Any]:
    response = requests.post(f"{url}/v1/completions", timeout=120,
                             json={"prompt": prompt, "max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _cached_share(url: str, rng: random.Random) -> float:
    """Groups of requests sharing a 5-block prefix, interleaved (g0 g1 .. g4 g0 g1 ..), one at
    a time so the measurement is deterministic; fresh prefixes each call."""
    prefixes = [[rng.randrange(100, 10000) for _ in range(PREFIX_BLOCKS * BS)]
                for _ in range(NUM_GROUPS)]
    prompt_tokens = cached_tokens = 0
    for _ in range(NUM_ROUNDS):
        for prefix in prefixes:
            usage = _complete(url, prefix + [rng.randrange(100, 10000) for _ in range(8)])["usage"]
            prompt_tokens += usage["prompt_tokens"]
            cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    return cached_tokens / prompt_tokens


def test_prefix_router_keeps_shared_prefixes_cached(cluster: tuple[LiveServer, Cluster]) -> None:
    server, c = cluster
    rng = random.Random(0)
    c.state.policy = RoutingPolicy("round-robin")
    round_robin = _cached_share(server.url, rng)
    c.state.policy = RoutingPolicy("prefix", rng=random.Random(0))
    prefix = _cached_share(server.url, rng)
    print(f"cached-token share: prefix {prefix:.3f}, round-robin {round_robin:.3f}")
    # every round after the first hits its whole prefix on the replica that holds it
    assert prefix >= 0.6
    assert prefix >= 1.8 * round_robin, (prefix, round_robin)
    # the index's predictions were right: what it predicted is what the replicas served
    snapshot = c.state.snapshot()
    assert len(snapshot) == 2  # neither replica was dropped from the router's view
    assert sum(r.cached_tokens for r in snapshot.values()) > 0
    metrics = requests.get(f"{server.url}/metrics", timeout=10).text
    assert 'kvcore:cluster_routing_decisions_total{reason="prefix"}' in metrics


def test_a_burst_under_replicas_never_admits_more_than_the_limit_plus_what_can_run(
        cluster: tuple[LiveServer, Cluster]) -> None:
    """N1 under --replicas 2: 40 calls at once; the ingress counts what it admitted and routed,
    not only what the replicas last reported (which omits requests on their way)."""
    server, c = cluster
    rng = random.Random(3)
    body = {"max_tokens": 32, "ignore_eos": True}  # 3 blocks each: 8 fit a replica
    statuses: list[int] = []
    barrier = threading.Barrier(40)

    def call() -> None:
        prompt = [rng.randrange(100, 10000) for _ in range(8)]
        barrier.wait()
        response = requests.post(f"{server.url}/v1/completions", timeout=300,
                                 json={"prompt": prompt, **body})
        statuses.append(response.status_code)

    threads = [threading.Thread(target=call) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(set(statuses)) == [200, 429], statuses
    # no admitted call ends during the burst (32 tokens each), so each holds its sequence
    assert statuses.count(200) <= MAX_WAITING + 2 * MAX_NUM_SEQS, statuses
    assert all(r.num_seqs == 0 for r in c.state.snapshot().values())


def test_debug_kv_under_replicas_answers_per_replica(cluster: tuple[LiveServer,
                                                                    Cluster]) -> None:
    """N2: /debug/kv answers one replica's pool (the first by default, ?replica=ID for another)
    and names the parameter for an unknown id: never a 500."""
    server, c = cluster
    first = requests.get(f"{server.url}/debug/kv", timeout=60)
    assert first.status_code == 200, first.text
    data = first.json()
    assert len(data["replicas"]) == 2 and data["replica"] == data["replicas"][0]
    assert data["num_blocks"] == NUM_BLOCKS and sum(data["counts"].values()) == NUM_BLOCKS
    other = requests.get(f"{server.url}/debug/kv", params={"replica": data["replicas"][1]},
                         timeout=60).json()
    assert other["replica"] == data["replicas"][1] and other["num_blocks"] == NUM_BLOCKS
    wrong = requests.get(f"{server.url}/debug/kv", params={"replica": "nope"}, timeout=60)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "replica"
    page = requests.get(f"{server.url}/inspector", timeout=60)
    assert page.status_code == 200 and 'id="replica"' in page.text


def _stream(url: str, prompt: list[int], out: dict[str, Any]) -> None:
    body = {"prompt": prompt, "max_tokens": 150, "ignore_eos": True, "stream": True}
    events = []
    with requests.post(f"{url}/v1/completions", json=body, timeout=120,
                       stream=True) as response:
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(line[6:])
    out["events"] = events


def test_a_killed_replica_fails_only_its_own_streams(cluster: tuple[LiveServer,
                                                                    Cluster]) -> None:
    import ray

    from kvcore.cluster.app import APP_NAME, DEPLOYMENT_NAME

    server, c = cluster
    c.state.policy = RoutingPolicy("prefix", rng=random.Random(1))
    rng = random.Random(2)
    outs: list[dict[str, Any]] = [{}, {}]
    threads = [threading.Thread(target=_stream, args=(
        server.url, [rng.randrange(100, 10000) for _ in range(40)], out)) for out in outs]
    for t in threads:
        t.start()
        time.sleep(0.5)  # the second stream sees the first one outstanding: the other replica
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = [r for r, s in c.state.snapshot().items() if s.num_outstanding > 0]
        if len(busy) == 2:
            break
        time.sleep(0.2)
    assert len(busy) == 2, c.state.snapshot()
    victim = sorted(busy)[0]
    time.sleep(1.0)  # both streams are producing tokens
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{victim}",
                          namespace="serve")
    ray.kill(actor, no_restart=True)  # Ray Serve's controller starts a replacement
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a stream hung after its replica died"
    endings = sorted(json.loads(o["events"][-2]).get("error") is not None for o in outs)
    assert endings == [False, True]  # one stream failed, the other finished
    for out in outs:
        assert out["events"][-1] == "[DONE]"
        last = json.loads(out["events"][-2])
        if "error" in last:
            assert last["error"]["code"] == 500 and "replica" in last["error"]["message"]
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    for _ in range(4):  # new requests go to the survivor at once
        _complete(server.url, [rng.randrange(100, 10000) for _ in range(20)])
    assert victim not in c.state.replicas
    assert victim not in c.state.index.replicas()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Ray restarts it under a new id, with an empty cache
        _complete(server.url, [rng.randrange(100, 10000) for _ in range(20)])
        if len(c.state.replicas) == 2:
            break
        time.sleep(1)
    assert len(c.state.replicas) == 2 and victim not in c.state.replicas

