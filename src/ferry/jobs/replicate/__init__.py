"""Cross-site replication (`ferry replicate`) and site failover / fail-back (`ferry site`).

The design is JGroups' RELAY on JetStream:

- A **replication** FROM -> TO relays, for every stream of site FROM matching a glob, the
  messages first stored at FROM (those without a ``Ferry-Origin-Site`` header) to the stream
  of the same name at TO (or a mapped name, with an optional subject prefix). Each relayed
  message gets ``Ferry-Origin-Site``, ``-Stream``, ``-Seq`` and ``-Msg-Id`` and is published
  with a deterministic ``Nats-Msg-Id`` (its own, else ``<site>/<stream>:<seq>``). A message
  that already carries an origin is never relayed again, so FROM <-> TO both ways has no cycle.
- The relay is a Spark Structured Streaming query (jetstream source -> jetstream sink).
- Its definition, lease and progress live **at the destination**, key ``relay.FROM.TO`` of
  the ``ferry_ops`` KV bucket. ``ferry replicate run`` may run on several machines: the one
  holding the lease relays, the others stand by and take over once its heartbeat is older
  than the lease (sooner on the same host, where a dead pid is seen at once).
- **Resume point**: a relay that takes over asks the destination which origin sequences it
  holds near its end (the last ``SCAN`` relayed messages at least), starts after the highest,
  and first re-relays the few below it that are missing (a dead relay's unacked publishes).
  Relaying waits until that replay is done. No Spark checkpoint survives a run, so there is
  none to lose or mix up: the destination is the only truth.
- A graceful ``ferry replicate stop`` makes the relay stop its query and write a stop
  **marker** (the exact position per stream); its successor starts there without the scan.
- **Site failover** (``ferry site failover --to sfo``) fences and stops nyc -> sfo, records
  the last nyc sequence sfo holds per stream, and makes sfo the primary. **Fail-back**
  (``ferry site failback --to nyc``) reconciles both sides by origin sequence (Spark
  anti-joins): what nyc acked but never relayed before it failed (the RPO) goes to sfo, what
  was written at sfo meanwhile goes to nyc, each exactly once; then nyc -> sfo is defined again.
- **Accounts**: every function here works on the topology it is given; on
  ``topo.in_account("SALES")`` (``--account SALES``) a replication relays that account's
  streams and keeps its definition, lease and progress in that account's ``ferry_ops`` at the
  destination, beside (and apart from) the default account's.
"""

from ferry.jobs.replicate.control import start, status, stop
from ferry.jobs.replicate.plan import Replication, relay_command
from ferry.jobs.replicate.relay import Metrics, Relay
from ferry.jobs.replicate.site import failback, failover
from ferry.jobs.replicate.site import status as site_status

__all__ = [
    "Metrics",
    "Relay",
    "Replication",
    "failback",
    "failover",
    "relay_command",
    "site_status",
    "start",
    "status",
    "stop",
]
