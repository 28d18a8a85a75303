"""``exactspec serve``: an OpenAI-compatible server that speculates for a few users and batches for many.

- ``batching.py``: the batch's settings, its pool of KV-cache slots, and the scheduler over them;
- ``scheduler.py``: continuous batching, one target pass per step over every running request;
- ``speculation.py``: the load-aware choice, per step, of each request's draft length (or none);
- ``app.py``: the server's life and its routes; ``protocol.py``: OpenAI's request and response shapes;
- ``framing.py``: HTTP framing and its refusals; ``output.py``: answers on the wire (stop strings, log-probabilities,
  the speculation extension, SSE); ``stops.py``: stop strings; ``page.py``: the live page's files;
- ``settings.py``, ``serving.py``, ``launch.py``: how a server listens, loads and runs (``exactspec serve``);
  ``replicas.py``: Ray Serve replicas, routed by prefix (``routing.py``: the keys and the affinity table;
  ``prefix_router.py``: Ray's request router over them; ``forwarding.py``: a request relayed to a replica's app);
- ``metrics.py``: Prometheus counters and gauges.

This package's own module holds no logic: it names the batch's settings and its scheduler's builder for callers.
"""

from exactspec.server.batching import BatchSettings, build_scheduler, make_pool

__all__ = ["BatchSettings", "build_scheduler", "make_pool"]
