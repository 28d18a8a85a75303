"""``exactspec serve --replicas N``: the same OpenAI app on Ray Serve, one engine (model, scheduler, KV caches) per
replica, Ray's HTTP proxy in front.

Every replica is the single-machine server's app (:func:`exactspec.server.app.build_app`) built inside the replica
process: the same routes, streaming, refusals and metrics (``/metrics`` is the answering replica's own; the
``X-Exactspec-Instance`` header names it). Ray restarts a replica that dies or whose scheduler stops serving
(its health check is ``/health``'s).

Which replica answers (``routing``): with ``prefix`` (the default), the proxy hands each request to one ingress,
which reads its body and sends it through a deployment handle whose request router (``prefix_router.py``) picks
the replica that most likely holds the prompt's opening (the conversation's earlier turns, a shared system prompt)
in its prefix cache, else the least loaded (``routing.py``, ``forwarding.py``); with ``ray``, Ray's own router
spreads requests over the replicas (two chosen at random, the shorter queue taken), and each replica's prefix cache
and suffix index learn alone.

On one machine ``exactspec serve --replicas 2`` starts a local Ray instance. On a cluster, start Ray on each node
(``ray start --head`` on one, ``ray start --address HEAD:6379`` on the others) and pass ``--ray-address auto`` (or
the head's address): replicas are then spread over the nodes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from exactspec.choices import REPLICA_ROUTINGS
from exactspec.errors import UsageError
from exactspec.server.forwarding import Forwarder, asgi_messages
from exactspec.server.serving import ServerOptions, load_server, wait_for_signal

APP_NAME = "exactspec"


def serve_app(options: ServerOptions | None = None, replicas: int = 1, shutdown_timeout: float = 30.0,
              routing: str = "prefix"):
    """The Ray Serve application: ``replicas`` copies of exactspec's OpenAI app, behind an ingress that routes by
    the prompt's prefix (``routing="prefix"``) or behind Ray's proxy alone (``"ray"``); for ``serve.run`` (or Ray's
    own ``serve run exactspec.server.replicas:app_builder replicas=2 model=PATH``)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from exactspec.server.prefix_router import PrefixRouter

    if replicas < 1:
        raise UsageError(f"replicas must be >= 1, got {replicas}")
    if routing not in REPLICA_ROUTINGS:
        raise UsageError(f"replica routing is one of {', '.join(REPLICA_ROUTINGS)}, got {routing!r}")
    options = options or ServerOptions()

    class ExactspecReplica:
        def __init__(self) -> None:
            self.server = load_server(options, listen=False)
            self.server.start()  # its scheduler: Ray Serve's HTTP, or the ingress's requests, run the app

        def __serve_build_asgi_app__(self):  # under Ray's router, the app answers Ray's proxy itself
            return self.server.app

        def check_health(self) -> None:
            _, body = self.server.health()
            if body.get("status") == "stalled":  # not a replica that is shutting down
                raise RuntimeError(body.get("reason", "unhealthy"))

        async def forward(self, scope: dict, body: bytes, prefix_keys: tuple[str, ...] = ()):
            """An HTTP request the ingress read, answered by this replica's app: the messages it sends, as it sends
            them. ``prefix_keys`` are the request router's, not the app's."""
            async for message in asgi_messages(self.server.app, scope, body):
                yield message

    max_ongoing = options.batch.max_batch_size + options.batch.max_waiting
    deployment = serve.deployment(
        serve.ingress()(ExactspecReplica) if routing == "ray" else ExactspecReplica,  # one ingress an application
        name="ExactspecReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": 0},  # a replica's threads are its own (--threads); Ray need not count them
        max_ongoing_requests=max_ongoing,
        health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=shutdown_timeout)
    if routing == "ray":
        return deployment.bind()
    return prefix_ingress(options, replicas * max_ongoing, shutdown_timeout).bind(
        deployment.options(request_router_config=RequestRouterConfig(request_router_class=PrefixRouter)).bind())


def prefix_ingress(options: ServerOptions, max_ongoing: int, shutdown_timeout: float):
    """The deployment in front of the replicas under prefix routing: one process that reads each request's body and
    sends the request on through the replicas' handle, whose router reads its prefix keys (``prefix_router.py``)."""
    from ray import serve

    @serve.ingress()
    class ExactspecIngress:
        def __init__(self, replicas) -> None:
            self.replicas = replicas.options(stream=True)

        def __serve_build_asgi_app__(self):
            return Forwarder(self.open_stream, options.settings)

        async def open_stream(self, scope: dict, body: bytes, keys: tuple[str, ...]):
            """The messages of a replica's answer; a caller that stops reading them (its client left) cancels the
            replica's run."""
            stream = self.replicas.forward.remote(scope, body, prefix_keys=keys)
            finished = False
            try:
                async for message in stream:
                    yield message
                finished = True
            finally:
                if not finished:
                    stream.cancel()

    return serve.deployment(ExactspecIngress, name="ExactspecIngress", num_replicas=1,
                            ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max_ongoing,
                            graceful_shutdown_timeout_s=shutdown_timeout)


def app_builder(args: dict):
    """For ``serve run exactspec.server.replicas:app_builder KEY=VALUE ...``: replicas, model, backend, threads,
    routing (prefix or ray)."""
    known = {"replicas", "model", "backend", "threads", "routing"}
    if set(args) - known:
        raise UsageError(f"unknown arguments {sorted(set(args) - known)}; known: {sorted(known)}")
    options = ServerOptions(model=args.get("model"), backend=args.get("backend", "auto"),
                             threads=int(args["threads"]) if "threads" in args else None)
    return serve_app(options, int(args.get("replicas", 1)), routing=args.get("routing", "prefix"))


def proxy_options(host: str, port: int, request_timeout: float) -> dict:
    """Ray's HTTP proxy: where it listens, and how long it lets a request go unanswered (0: no limit). The limit
    is end to end, at the proxy: it bounds a request whatever holds it, Ray's routing included (Ray Serve 2.60
    was seen holding a request it rerouted from a killed replica for over a minute)."""
    return {"host": host, "port": port, "request_timeout_s": request_timeout or None}


def start_ray(address: str | None, replicas: int, proxy: dict) -> None:
    """Join the Ray cluster at ``address``, or start a local one with a CPU for each replica at least; then Ray
    Serve with its HTTP proxy (:func:`proxy_options`)."""
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False, logging_level="warning",
             **({} if address else {"num_cpus": max(os.cpu_count() or 1, replicas)}))
    serve.start(http_options=proxy)


def run_replicas(args, options: ServerOptions) -> int:
    """Start (or join) Ray, deploy the replicas behind Ray's proxy at --host:--port, serve until a signal."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UsageError("--replicas needs Ray Serve: pip install 'ray[serve]'") from None
    threads = options.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    options = replace(options, threads=threads)
    start_ray(args.ray_address, args.replicas, proxy_options(args.host, args.port, args.request_timeout))
    serve.run(serve_app(options, args.replicas, args.shutdown_timeout, args.replica_routing), name=APP_NAME,
              route_prefix="/")
    print(f"exactspec: serving at http://{args.host}:{args.port} on Ray Serve, {args.replicas} replicas of "
          f"{threads} threads, routed by {args.replica_routing}; the live page at http://{args.host}:{args.port}/; "
          "Ctrl-C to stop", file=sys.stderr, flush=True)
    wait_for_signal()
    print("exactspec: shutting down the replicas", file=sys.stderr, flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0
