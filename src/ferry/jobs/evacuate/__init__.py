"""`ferry node evacuate` and `ferry cluster rebalance`: move clients and leaders off
NATS servers at a controlled rate, the way EMQX's ``emqx_node_rebalance`` does.

**Evacuation** of one node runs through EMQX's states:

1. ``waiting_health_check`` — ``ferry serve``'s ``/availability_check`` answers
   503 for the node, so the load balancer stops sending it new clients, but the
   node still serves the ones it has (``--wait-health-check`` seconds);
2. ``evicting_conns`` — client connections (NATS and MQTT) are closed with the
   system account's ``$SYS.REQ.SERVER.<id>.KICK`` at ``--conn-evict-rate`` per
   second until the node holds none; clients reconnect through the balancer;
3. ``waiting_takeover`` — ``--wait-takeover`` seconds for them to resume
   their sessions elsewhere;
4. ``evicting_sessions`` — at ``--sess-evict-rate`` per second: JetStream
   stream and consumer leaders on the node step down (towards ``--migrate-to``
   when given), and stream replicas move off it with a peer-remove where the
   cluster has a spare server. MQTT persistent sessions live in JetStream
   (``$MQTT_*`` streams and their consumers), so they follow. RabbitMQ: quorum
   queue leaders move, classic queues are relocated with the data plane (:mod:`.nodes.rabbitmq`);
5. ``prohibiting`` — until ``ferry node stop``: new connections are kicked and
   leaders that return are stepped down again.

**Rebalance** of a cluster: donors are the nodes above the average connection
count, recipients the rest. Donors answer 503 while it runs; after the health
check wait each donor loses what it holds above the cluster's average, at most
``--conn-evict-rate`` connections per second, until ``avg(donor) < avg(recipient) + abs`` or
``avg(donor) < avg(recipient) * rel``; then JetStream leaders are balanced the
same way (donors and recipients by leader count). It is a dry run (a proposal)
unless ``--execute``. If a participating node stops answering, it aborts.

State lives in the cluster's own KV bucket ``ferry_ops`` (``evacuation.<cluster>.<node>``,
``rebalance.<cluster>``), so a restarted ferry — or ``ferry serve`` on another
machine — resumes in the same state with the same rates. ferry's control
connections are named ``ferry-ctl-*``, connect to the nodes being emptied last,
and are never evicted.

Limits: NATS has no server redirection (MQTT 3.1.1, NATS protocol), so where
clients reconnect is the balancer's choice; ``--migrate-to`` steers JetStream
leaders only (a replica or an R1 stream moved off the node goes where the cluster
places it). Leaders in accounts the topology has no credentials for are reported as
kept, as are replicas with no spare server (an R3 stream on 3 servers). An R1 stream
moves with a scale-up and back, see ``NatsNodes.move_single``.
"""

from ferry.jobs.evacuate.plan import STATES, EvacuateRequest, RebalanceRequest, propose, unavailable, within
from ferry.jobs.evacuate.run import evacuate, rebalance
from ferry.jobs.evacuate.status import node_status, rebalance_status, stop

__all__ = [
    "STATES",
    "EvacuateRequest",
    "RebalanceRequest",
    "evacuate",
    "node_status",
    "propose",
    "rebalance",
    "rebalance_status",
    "stop",
    "unavailable",
    "within",
]
