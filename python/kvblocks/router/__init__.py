"""Routing across a fleet of vLLM replicas on kvblocks' exact prefix-hit index.

- :mod:`kvblocks.router.index`: :class:`RoutingIndex`, the cluster-wide block table fed by
  vLLM's KV events, which predicts each replica's prefix hit exactly (hybrids included);
- :mod:`kvblocks.router.feeds`: :class:`ReplicaFeed`, one replica's ZMQ event stream applied
  in sequence order, gaps repaired through vLLM's replay endpoint;
- :mod:`kvblocks.router.fleet`: the fleet file (:func:`~kvblocks.router.fleet.load_fleet`);
- :mod:`kvblocks.router.scorer`: ``kvblocks route``, the HTTP scorer (``POST /score``).

docs/router.md is the deployer's guide.
"""

from kvblocks.router.feeds import ReplicaFeed
from kvblocks.router.index import GPU, ReplicaLayout, Route, RoutingIndex

__all__ = ["GPU", "ReplicaFeed", "ReplicaLayout", "Route", "RoutingIndex"]
