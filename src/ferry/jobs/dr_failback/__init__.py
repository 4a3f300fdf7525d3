"""`ferry failback --from DR --to MAIN`: bring the messages left on a DR RabbitMQ
cluster back to the main one without pulling new ones from the upstream.

A federated queue pulls from its upstream while it has a consumer, so its
messages cannot simply be consumed: the consumer would pull more. The protocol
is the bash gist's (../shared/seeds/003), made safe and exact:

1. **plan** — the queues with a federation policy and ready messages (live
   counts), the upstreams their policies use, each queue's target queue;
2. **journal** — one global parameter on the source broker, ``ferry-failback``,
   holds the plan, every upstream's full definition, the counts before and the
   phase. It is written *before* any upstream is deleted, so a definition is
   never lost, and any machine can resume from it;
3. **disable** — delete those upstreams, then wait until the management API
   lists no federation link for them;
4. **transfer** — ``shovel`` (one dynamic shovel per queue: ``ack-mode
   on-confirm``, ``src-delete-after queue-length``, ``dest-queue``; at most
   ``max_active`` at once) or ``spark`` (the data plane's queue mover, which
   marks each message with ``x-ferry-transfer``; a rerun acks, without
   delivering it again, what a killed run delivered, by message id). A queue is
   done the moment it is drained: counts are polled every 0.2 s by passive declares;
5. **restore** — put each upstream back exactly as saved and compare, delete
   every shovel ferry created, then the journal (messages that came back to a
   drained queue send a rerun back to step 3);
6. **verify** — each target queue counted against what it held plus what moved;
   where it holds more, the ids it holds twice, read without consuming.

One failback runs per source broker at a time: ferry holds an exclusive queue,
``ferry-failback-lock``, while it works, and the broker drops it if ferry dies.
Killing ferry at any step and running the same command again (anywhere)
finishes the job; with nothing to do it says so and changes nothing.

Accounting: per queue, ready before (from the journal), moved (before - left:
exact, since nothing else feeds a queue whose upstream is gone), left; the
target's count before and after (exact while nothing consumes there); the
upstream queues' counts before and after, which show that nothing was pulled.
"""

from ferry.jobs.dr_failback.plan import JOURNAL, FailbackRequest, public
from ferry.jobs.dr_failback.run import failback, status

__all__ = ["JOURNAL", "FailbackRequest", "failback", "public", "status"]
