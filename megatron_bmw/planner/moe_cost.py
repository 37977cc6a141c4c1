"""What an MoE unit's dispatcher and its expert gradients cost (docs/moe.md): the token exchange inside the unit and
the expert parameters' reduction after the pipeline. The experts' GEMMs are kernel_time.py's (grouped, at the tokens
the busiest rank receives), the routing model moe_model.py's. Torch-free.

Groups on one stage: the stage's tp x cp x dp ranks by local index L = tp_rank + tp (cp_rank + cp dp_rank) are also
etp x ep x edp (etp fastest): the ep group of a rank is L = etp_rank + etp j (j < ep), the etp x ep group the etp ep
consecutive L, the edp group L = etp_rank + etp ep_rank + etp ep i (i < edp). Their links are the cluster's between
those ranks (cluster.py): NVLink inside a node, the nodes' NICs across them.

  allgather dispatcher: forward the T tokens (T h e bytes per rank) all-gathered over etp x ep and the experts'
      output reduce-scattered back (ring formulas on the group's slowest link, comm_cost.py), beside the routing
      (T k probabilities and indices, 12 bytes each) gathered; backward the output's gradient gathered and the
      input's reduce-scattered.
  alltoall dispatcher: forward the T k routed copies (T k h e bytes) exchanged over ep and, with etp > 1, the
      R/etp tokens a rank received all-gathered over etp; the same back after the experts; backward the mirror. An
      all-to-all (`all_to_all_seconds`) sends 1/ep of its bytes to every other rank of the group at once: the part to
      peers on the rank's node over NVLink, the part to other nodes over its share of the node's NICs (every rank of
      the node exchanges at the same time), the two in parallel; the busiest rank receives (E/ep - 1 + lambda)/(E/ep)
      of the mean, so its exchange takes that much longer.
  Neither overlaps the experts' compute (Megatron-core's default): the unit's time adds them.
  Expert gradients: summed over edp (the ranks holding the same expert shards) where the dense ones are reduced over
      dp x cp: a ring all-reduce on the edp group's link, or with the distributed optimizer a reduce-scatter; the
      gather after the step likewise.
"""

from __future__ import annotations

from ..config import ModelConfig
from .cluster import Cluster, Link
from .comm_cost import allgather_parts
from .moe_model import Experts, expert_loads, group_local_indices, local_to_coords  # noqa: F401 - re-exported

_ROUTING_BYTES = 12  # per routed copy: its probability (fp32) and expert index (int64)


def all_to_all_seconds(nbytes: float, ranks: list[int], cluster: Cluster) -> float:
    """One all-to-all of `nbytes` per rank among `ranks` (each sends 1/n to every other), timed for the first rank:
    its node-local part over NVLink and its remote part over its share of the node's NICs, in parallel, plus one
    latency per peer."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    me = ranks[0]
    group, node = cluster.locate(me)
    local = sum(1 for r in ranks[1:] if cluster.locate(r)[1] == node)
    remote = n - 1 - local
    inside, outside, latency = 0.0, 0.0, 0.0
    if local:
        link = cluster.link(me, next(r for r in ranks[1:] if cluster.locate(r)[1] == node))
        inside, latency = nbytes * local / n / link.bandwidth, link.latency
    if remote:
        link = cluster.link(me, next(r for r in ranks if cluster.locate(r)[1] != node))
        share = 1.0 if group.nics_per_node is None else min(1.0, group.nics_per_node / group.gpus_per_node)
        outside = nbytes * remote / n / (link.bandwidth * share)
        latency = max(latency, link.latency)
    return max(inside, outside) + (n - 1) * latency


def busiest_share(model: ModelConfig, tokens: int, experts: Experts) -> float:
    """Tokens the busiest rank receives over the mean rank's (1 at even routing)."""
    loads = expert_loads(model, tokens, experts)
    mean = experts.etp * experts.ep * tokens * model.moe.router_topk / model.moe.num_experts
    return sum(loads) / (mean * len(loads)) if mean > 0 else 1.0


def dispatch_seconds(model: ModelConfig, tokens: int, experts: Experts, ranks: dict[str, list[int]],
                     links: dict[str, Link], cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of the dispatcher's exchanges on the busiest rank (module doc); `ranks` and
    `links`: the global ranks and slowest link of the "ep", "etp", "etp_ep" groups."""
    moe, h, e = model.moe, model.hidden_size, model.dtype_bytes
    k = moe.router_topk
    if moe.token_dispatcher_type == "allgather":
        n = experts.etp * experts.ep
        if n <= 1:
            return 0.0, 0.0
        link = links["etp_ep"]
        hidden = sum(allgather_parts(n * tokens * h * e, n, link))
        routing = sum(allgather_parts(n * tokens * k * _ROUTING_BYTES, n, link))
        return 2 * hidden + routing, 2 * hidden
    share = busiest_share(model, tokens, experts)
    one = all_to_all_seconds(tokens * k * h * e * share, ranks["ep"], cluster)
    gathered = 0.0
    if experts.etp > 1:
        received = tokens * k * share
        gathered = sum(allgather_parts(experts.etp * received * h * e, experts.etp, links["etp"]))
    both = 2 * (one + gathered)
    return both, both
