"""`ferry partition`: subjects partitioned across JetStream streams, with exact ownership.

A **partition map** (YAML) names its partitions; each is one stream, placed in a
cluster, that owns a set of subject patterns::

    name: shop                       # the map's identity in the claims record
    partitions:
      - name: orders-eu
        stream: P_ORDERS_EU
        cluster: east                # optional placement
        replicas: 3
        patterns: [orders.eu.>]

- **check**: invalid patterns (with the reason), every overlapping pair (with a
  subject both would own), names used twice; with a traffic snapshot, the
  subjects seen that no partition owns.
- **route**: the owner of a literal subject, or "no partition owns it" at once.
- **claims**: ownership lives in the KV bucket ``ferry_partitions``, key
  ``claims``: one JSON record for every map, written only by compare-and-set on
  its revision. A claim re-reads the record after every lost race and checks its
  patterns against every other map's (claimed and pending) patterns, so two
  claims of overlapping subjects cannot both succeed, whatever the timing.
- **apply**: refuses, before changing anything, an invalid map, a conflict with
  another map's claim or with a stream outside the map; then claims and creates
  or updates one stream per partition capturing exactly its patterns.
- **repartition** (a map that changes the owner of subjects, ``--execute``):
  the new owner gets a staging subject (``ferry.stage.<STREAM>.>``, transformed
  back to the original subject on store); the data plane copies the moving
  subjects' history into it (a Spark job), an in-process copy catches up, then,
  under the move machinery's capture guard, the old owner drops the patterns
  and the new owner takes them; the tail is forwarded, what the guard heard and
  the new owner lacks is re-published, and only when the counts match are the
  moved subjects purged from the old owner.

  A repartition is journaled (``ferry_ops``, key ``partition.<map>``) phase
  by phase: the same command finishes one that was interrupted, copying only
  what the new owners lack (their copies' ``Ferry-Source-Seq`` say how far it
  got) and purging only once every moved message is counted in its new owner.

Limits, said plainly: per-subject order in the new owner is kept for the
history and for live traffic, but messages stored in the old owner during the
last moments before the switch land after the first ones stored in the new
owner (at most what is published during the switch, tens of milliseconds).
"""

from ferry.jobs.partition.claims import claimed_maps, read_claims
from ferry.jobs.partition.map import PartitionMap, check, load_map, require_valid, route, unowned_traffic
from ferry.jobs.partition.plan import plan
from ferry.jobs.partition.run import apply

__all__ = [
    "PartitionMap",
    "apply",
    "check",
    "claimed_maps",
    "load_map",
    "plan",
    "read_claims",
    "require_valid",
    "route",
    "unowned_traffic",
]
