"""What a node of a NATS or RabbitMQ cluster holds, and how to move it off: the two backends of
`ferry node evacuate` and `ferry cluster rebalance` (the state machines are in :mod:`ferry.jobs.evacuate.run`).

Both answer the same questions: a node's client connections and its "sessions"
(NATS: JetStream stream and consumer Raft groups; RabbitMQ: quorum and classic
queues), and both move them: close a connection, hand a leader to a preferred peer,
and switch a node's intake off and on again.

- **NATS**: connz and jsz on each server's monitoring port; connections closed with
  the system account's ``$SYS.REQ.SERVER.<id>.KICK``; leaders step down with
  ``placement.preferred``; replicas move with a peer-remove, and a one-replica stream by a
  scale-up to two, a step-down and a scale back to one. The journal is the
  cluster's ``ferry_ops`` KV bucket.
- **RabbitMQ**: connections and queues from the management API; connections closed
  with ``DELETE /api/connections/<name>`` and an ``X-Reason``; quorum queue leaders
  moved with ``rabbit_quorum_queue:transfer_leadership/2`` through ``rabbitmqctl eval``;
  a prohibited node is put in maintenance mode (``rabbitmq-upgrade drain``: listeners
  suspended, so it takes no client at all) and ``revive``d at stop. The Erlang CLI needs
  the topology's ``erlang`` block (cookie and epmd port). A classic queue lives on one
  node, so evacuation *relocates* it (see ``RabbitNodes.relocate``): same name, arguments
  and bindings on another node, its messages moved by the data plane's queue mover
  (Spark). Quorum queue followers, auto-delete and exclusive queues stay (reported as
  kept). The journal is a global parameter on the cluster.

Relocating a classic queue Q, every step idempotent and read back from the broker, and Q
in the evacuation's journal from before step 1 until step 3 is done, so a killed
evacuation resumes at the right step (even once Q has left the node):

1. declare ``ferry.relocate.Q`` on the target node (like Q), bind it as Q is bound, then
   unbind Q: messages routed through exchanges now land in the holding queue;
2. move Q's messages to it, and delete Q once empty (its consumers get a cancel);
3. declare Q on the target node, bind it, unbind the holding queue, move the held
   messages back and delete the holding queue.

Limits: between the two steps Q does not exist for a moment, so a message published
straight to Q (default exchange) in that moment is unroutable (returned to a publisher
that sets ``mandatory``, dropped otherwise); one routed while both queues are bound is
delivered to both (at least once, never lost). Consumers of Q must re-subscribe after
the cancel (most clients do on a consumer-cancel notification).
"""

from ferry.jobs.evacuate.nodes.base import CONTROL, RELOCATE_PREFIX, STALE_AFTER, Asset, NodeView
from ferry.jobs.evacuate.nodes.nats import NatsNodes
from ferry.jobs.evacuate.nodes.rabbitmq import RabbitNodes
from ferry.spark.session import SparkFactory
from ferry.topology import NatsCluster, RabbitCluster

__all__ = ["CONTROL", "RELOCATE_PREFIX", "STALE_AFTER", "Asset", "NatsNodes", "NodeView", "RabbitNodes", "open_nodes"]


def open_nodes(
    name: str, cluster: NatsCluster | RabbitCluster, avoid: list[str], spark: SparkFactory | None = None
) -> NatsNodes | RabbitNodes:
    """The backend for `cluster`; `spark` starts the Spark session a RabbitMQ evacuation relocates
    classic queues with (default: where ``$FERRY_SPARK_MASTER`` / ``$FERRY_SPARK_REMOTE`` say)."""
    return (
        NatsNodes(name, cluster, avoid)
        if isinstance(cluster, NatsCluster)
        else RabbitNodes(name, cluster, avoid, spark)
    )
