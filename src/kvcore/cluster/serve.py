"""`kvcore serve --replicas N`: the same HTTP service, its engine N replicas on Ray Serve."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Mapping

from aiohttp import web

from kvcore.cluster.app import (
    Cluster,
    ClusterOptions,
    autoscaling_config,
    connect_ray,
    start_cluster,
)
from kvcore.cluster.metrics import RouterCollector
from kvcore.config import EngineConfig
from kvcore.engine import EngineClient
from kvcore.service import STATE_KEY, make_app
from kvcore.service.edge import Edge
from kvcore.service.serve import serve


def options_from_args(args: argparse.Namespace) -> ClusterOptions:
    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        autoscaling = autoscaling_config(args.replicas,
                                         args.min_replicas or 1,
                                         args.max_replicas or args.replicas)
    return ClusterOptions(num_replicas=args.replicas, router=args.router,
                          ray_address=args.ray_address, cpus_per_replica=args.cpus_per_replica,
                          gpus_per_replica=args.gpus_per_replica,
                          replica_resources=_resources(args.replica_resources),
                          load_margin=args.router_load_margin, autoscaling=autoscaling)


def _resources(text: str | None) -> dict[str, float]:
    """--replica-resources: a JSON object of custom Ray resource -> amount per replica."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--replica-resources must be JSON, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--replica-resources must be a JSON object of resource name -> "
                         f"amount, e.g. '{{\"kvcore_replica\": 1}}', got {text!r}")
    return value


def build_app(config: EngineConfig, options: ClusterOptions, clusters: list[Cluster],
              started_ray: bool = False, **app_kwargs: object) -> web.Application:
    """make_app around the cluster, started in make_app's loader thread (so /health answers 503
    while Ray starts and the replicas load); the started Cluster is appended to `clusters`."""
    def factory() -> EngineClient:
        cluster = start_cluster(config, options, started_ray)
        clusters.append(cluster)
        app[STATE_KEY].metrics.registry.register(RouterCollector(cluster.state))
        return cluster.engine

    app = make_app(factory, **app_kwargs)  # type: ignore[arg-type]
    return app


def run(args: argparse.Namespace, config: EngineConfig, app_kwargs: Mapping[str, object],
        edge: Edge, options: ClusterOptions) -> int:
    """Serve until SIGTERM/SIGINT; then drain the ingress (every replica's streams end well
    formed) and delete the application (each replica's engine stops gracefully)."""
    clusters: list[Cluster] = []
    # before serve() installs its SIGTERM handler; ConnectionError when Ray refuses this process
    started_ray = connect_ray(options)
    app = build_app(config, options, clusters, started_ray, **app_kwargs)
    try:
        return asyncio.run(serve(app, args.host, args.port, args.drain_timeout, edge))
    finally:
        for cluster in clusters:
            cluster.shutdown()
