"""Start the replicas on Ray Serve and build the ingress engine around their handle."""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import structlog
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvcore.cluster.engine_view import IngressModel, ReplicaInfo
from kvcore.cluster.ingress import ClusterEngine
from kvcore.cluster.nodes import check_model_on_nodes
from kvcore.cluster.policy import DEFAULT_KV_MARGIN, DEFAULT_LOAD_MARGIN, RoutingPolicy
from kvcore.cluster.replica import KVCoreReplica
from kvcore.cluster.state import RouterState, register_state
from kvcore.config import EngineConfig

log = structlog.get_logger("kvcore.cluster")

APP_NAME = "kvcore"
DEPLOYMENT_NAME = "kvcore-replica"
# one replica's requests at once, past which Ray's router tries another: high, because the
# engine queues (and admits, and refuses) requests itself
MAX_ONGOING_REQUESTS = 1024
LOCAL_OBJECT_STORE_BYTES = 128 << 20  # a local Ray's object store: streams carry small items
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    num_replicas: int = 2
    router: str = "prefix"
    ray_address: str | None = None  # None: start a local Ray instance
    cpus_per_replica: float = 1.0  # Ray's CPU reservation (and the replica's BLAS threads)
    gpus_per_replica: float = 0.0  # 1 on a GPU cluster: one replica per GPU
    # custom Ray resources per replica ({"kvcore_replica": 1}: one replica per node that
    # declares one with `ray start --resources`)
    replica_resources: dict[str, float] = field(default_factory=dict)
    load_margin: int = DEFAULT_LOAD_MARGIN
    kv_margin: float = DEFAULT_KV_MARGIN
    local_num_cpus: int | None = None  # a local Ray's CPUs (None: the machine's)
    # a Ray Serve autoscaling_config; replaces num_replicas
    autoscaling: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra env vars of the replicas

    def __post_init__(self) -> None:
        if not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {self.num_replicas!r}")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica!r}")
        if self.gpus_per_replica < 0:
            raise ValueError(f"gpus_per_replica must be >= 0, got {self.gpus_per_replica!r}")
        for name, amount in self.replica_resources.items():
            if name in ("CPU", "GPU") or not isinstance(name, str) or not name:
                raise ValueError(f"replica_resources: {name!r} is not a custom resource name "
                                 "(CPUs and GPUs have their own options)")
            if isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
                raise ValueError(f"replica_resources: {name!r} must be a number > 0, "
                                 f"got {amount!r}")
        RoutingPolicy(self.router, self.load_margin, self.kv_margin)  # validates the three

    @property
    def demand(self) -> dict[str, float]:
        """The Ray resources one replica reserves."""
        return {"CPU": self.cpus_per_replica, "GPU": self.gpus_per_replica} | self.replica_resources


def autoscaling_config(initial: int, min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """Ray Serve's autoscaling_config driven by kvcore.cluster.autoscale (the replicas record
    KV usage, waiting sequences and preemptions; the policy scales on them)."""
    if not 1 <= min_replicas <= initial <= max_replicas:
        raise ValueError(f"need 1 <= min_replicas <= replicas <= max_replicas, got "
                         f"{min_replicas}, {initial}, {max_replicas}")
    return {"min_replicas": min_replicas, "max_replicas": max_replicas,
            "initial_replicas": initial, "look_back_period_s": 30.0,
            # the signals are already averaged over the look-back window: act on them soon
            "upscale_delay_s": 10.0, "downscale_delay_s": 120.0,
            "policy": {"policy_function": "kvcore.cluster.autoscale:kvcore_autoscaling_policy"}}


@dataclass(slots=True)
class Cluster:
    engine: ClusterEngine
    state: RouterState
    started_ray: bool

    def shutdown(self) -> None:
        """Delete the application (Ray Serve stops each replica gracefully: its engine aborts
        what is left) and stop the local Ray instance if this process started it."""
        serve.delete(APP_NAME)
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()


def connect_ray(options: ClusterOptions) -> bool:
    """Join the Ray cluster at options.ray_address, or start a small local one; True when this
    call started or joined it. Call it on the main thread before installing signal handlers: Ray
    installs its own SIGTERM handlers there, which must not pre-empt the service's drain."""
    if ray.is_initialized():
        return False
    if options.ray_address is None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a private local instance
        ray.init(num_cpus=options.local_num_cpus, include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False,
                 configure_logging=False)
    else:
        from ray.exceptions import AuthenticationError

        try:
            ray.init(address=options.ray_address, log_to_driver=False, configure_logging=False)
        except (AuthenticationError, ConnectionError) as e:
            reason = str(e).split(". ", 1)[0]
            raise ConnectionError(
                f"could not join the Ray cluster at {options.ray_address} ({reason}); a cluster "
                "with token authentication on refuses a process without its token: run kvcore "
                "with RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN_PATH=FILE, "
                "RAY_AUTH_TOKEN or ~/.ray/auth_token), as on every node") from None
    return True


def start_cluster(config: EngineConfig, options: ClusterOptions,
                  started_ray: bool = False) -> Cluster:
    """Deploy the replicas (blocking: they load the model; a worker thread may run it) and build
    the ingress engine. `started_ray`: shutdown() also stops Ray (connect_ray's answer)."""
    if not ray.is_initialized():
        started_ray = connect_ray(options)
    # replicas may run on other nodes: they get the path as the ingress sees it, absolute
    config = dataclasses.replace(config, model=str(Path(config.model).absolute()))
    probed = check_model_on_nodes(config.model, options.demand)
    # no Ray HTTP proxy: kvcore's own aiohttp app is the ingress, in this process
    serve.start(proxy_location="Disabled")
    state = RouterState(RoutingPolicy(options.router, options.load_margin, options.kv_margin))
    key = uuid.uuid4().hex
    register_state(key, state)
    threads = str(max(1, int(options.cpus_per_replica)))
    env = {name: threads for name in THREAD_ENV} | options.env
    scaling: dict[str, Any] = ({"autoscaling_config": options.autoscaling}
                               if options.autoscaling is not None
                               else {"num_replicas": options.num_replicas})
    deployment = serve.deployment(KVCoreReplica).options(  # type: ignore[attr-defined]
        name=DEPLOYMENT_NAME, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": options.cpus_per_replica,
                           "num_gpus": options.gpus_per_replica,
                           "resources": dict(options.replica_resources),
                           "runtime_env": {"env_vars": env}},
        request_router_config=RequestRouterConfig(  # pydantic: mypy misreads its fields
            request_router_class="kvcore.cluster.router:KVCacheRequestRouter",  # type: ignore[arg-type]
            request_router_kwargs={"router_key": key}),
        health_check_period_s=2.0, graceful_shutdown_timeout_s=10.0, **scaling)
    handle = serve.run(deployment.bind(config), name=APP_NAME, route_prefix=None)
    replica_id, info = handle.info.remote().result()
    assert isinstance(info, ReplicaInfo)
    log.info("cluster ready", replicas=options.num_replicas, router=options.router,
             nodes_with_model=probed,
             first_replica=replica_id, block_size=info.block_size, pid=os.getpid())
    holder: list[ClusterEngine] = []
    model = IngressModel(config, info, lambda: holder[0].stats() if holder else None)
    engine = ClusterEngine(handle, state, model)
    holder.append(engine)
    return Cluster(engine, state, started_ray)
