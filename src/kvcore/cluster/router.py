"""KVCacheRequestRouter: Ray Serve's RequestRouter API driven by the ingress's RouterState."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvcore.cluster.state import Route, RouterState, lookup_state


class KVCacheRequestRouter(RequestRouter):
    """Ray builds one inside every DeploymentHandle's router, in the caller's process (the
    ingress), and runs it on the handle's routing event loop. It finds the ingress's RouterState
    by the key in `request_router_kwargs` and ranks the chosen replica first, the rest after it
    (Ray tries the next rank when a replica is full or unreachable)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._router_key: str = kwargs["router_key"]

    def _state(self) -> RouterState | None:
        return lookup_state(self._router_key)

    async def choose_replicas(
            self, candidate_replicas: list[RunningReplica],
            pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target_replica")
        if isinstance(target, str):  # a call for one replica (its KV snapshot): that one only
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        state = self._state()
        route = kwargs.get("route")
        if state is None or not isinstance(route, Route) or not candidate_replicas:
            return [candidate_replicas]  # a control call (info): any replica
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        decision = state.route(route, list(by_id))
        chosen = by_id[decision.replica_id]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        state = self._state()
        if state is not None:
            state.sync_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Its streams end with errors; the index forgets its chains at once (a restart comes
        back under a new id with an empty cache)."""
        super().on_replica_actor_died(replica_id)
        state = self._state()
        if state is not None:
            state.sync_replicas(r for r in state.replicas if r != replica_id.unique_id)
