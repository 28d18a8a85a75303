"""Ray Serve's request router for exactspec's replicas under ``--replica-routing prefix``: each request offered to
the replicas in the order :class:`exactspec.server.routing.PrefixAffinity` gives, the holder of its prompt's
longest routed prefix first. It runs in the ingress's process, in the deployment handle that reaches the replicas
(``replicas.py``), and reads a request's prefix keys from the call's ``prefix_keys`` argument.

Its load is what it sent: the requests in flight to each replica from this handle (the one ingress is the only
sender). A replica whose queue is full (``max_ongoing_requests``) turns the request away and Ray offers it to the
next in the order.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from exactspec.server.routing import AFFINITY_CAPACITY, MAX_IMBALANCE, PrefixAffinity


class PrefixRouter(RequestRouter):
    """Routes each request to the replica that most likely holds its prompt's opening, else the least loaded."""

    def initialize_state(self, max_imbalance: int = MAX_IMBALANCE, capacity: int = AFFINITY_CAPACITY) -> None:
        self.affinity = PrefixAffinity(capacity, max_imbalance)
        self.in_flight: dict[ReplicaID, set[str]] = {}  # replica -> its requests' ids, sent and not finished

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Every replica, one to a rank, best first. Ray sends to the first rank's replica that takes the request,
        and backs off before asking again where none does."""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        loads = {replica_id: len(self.in_flight.get(replica_id, ())) for replica_id in by_id}
        return [[by_id[replica_id]] for replica_id in self.affinity.preference(keys_of(pending_request), loads)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.in_flight.setdefault(replica_id, set()).add(pending_request.metadata.internal_request_id)
        self.affinity.routed(keys_of(pending_request), replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.get(replica_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)


def keys_of(pending_request: PendingRequest | None) -> tuple[str, ...]:
    """The prefix keys a request was sent with (none for a call without them: a health check, say)."""
    return tuple(pending_request.kwargs.get("prefix_keys", ())) if pending_request is not None else ()
