"""`ferry repair consumers`: recreate durable consumers left past a stream's last sequence."""

from __future__ import annotations

from ferry.brokers import nats as bnats
from ferry.brokers.nats.jsapi import api, consumers, stream_info
from ferry.jobs.shared.models import Model
from ferry.topology import NatsCluster


class ConsumerFix(Model):
    """A durable consumer left pointing past its stream's last sequence, and where it restarts."""

    consumer: str
    delivered: int
    ack_floor: int
    last_seq: int
    restart_at: int
    recreated: bool = False


async def repair_consumers(cluster: NatsCluster, stream: str, dry_run: bool = False) -> list[ConsumerFix]:
    """Recreate each durable consumer left pointing past the stream's last sequence (a sequence reset).

    Every message the stream holds now was stored after the reset and none of
    them was delivered to the stuck consumer, so it restarts at the stream's first
    sequence, keeping its name and the rest of its configuration.
    """
    async with bnats.session(cluster) as nc:
        info = await stream_info(nc, stream)
        st = info["state"]
        fixes = []
        for name, c in (await consumers(nc, stream)).items():
            delivered, floor = c["delivered"]["stream_seq"], c["ack_floor"]["stream_seq"]
            if max(delivered, floor) <= st["last_seq"] or not c["config"].get("durable_name"):
                continue
            if (
                c["config"].get("deliver_policy") == "by_start_sequence"
                and delivered == c["config"]["opt_start_seq"] - 1
            ):
                continue  # configured to wait for a sequence still to come: not stuck
            cfg = dict(c["config"])
            start = st["first_seq"] if st["messages"] else st["last_seq"] + 1
            for k in ("opt_start_time", "opt_start_seq"):
                cfg.pop(k, None)
            cfg.update(deliver_policy="by_start_sequence", opt_start_seq=max(1, start))
            fix = ConsumerFix(
                consumer=name, delivered=delivered, ack_floor=floor, last_seq=st["last_seq"], restart_at=start
            )
            if not dry_run:
                await api(nc, f"$JS.API.CONSUMER.DELETE.{stream}.{name}")
                await api(nc, f"$JS.API.CONSUMER.CREATE.{stream}.{name}", {"stream_name": stream, "config": cfg})
                fix.recreated = True
            fixes.append(fix)
        return fixes
