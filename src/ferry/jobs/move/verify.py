"""A move's verification: the stream and its durable consumers before and after compared."""

from __future__ import annotations

from nats.aio.client import Client

from ferry.brokers.nats.jsapi import consumers, stream_info


async def snapshot(nc: Client, stream: str) -> dict:
    """What verification compares: stream state, per-subject counts, durable consumers."""
    info = await stream_info(nc, stream, subjects_filter=">")
    st = info["state"]
    durable = {
        n: {"config": c["config"], "ack_floor": c["ack_floor"]["stream_seq"], "delivered": c["delivered"]["stream_seq"]}
        for n, c in (await consumers(nc, stream)).items()
        if c["config"].get("durable_name")
    }
    # under load, a consumer read after the stream may already be past the last_seq read before it
    last_seq_after = (await stream_info(nc, stream))["state"]["last_seq"] if durable else st["last_seq"]
    return {
        "messages": st["messages"],
        "first_seq": st["first_seq"],
        "last_seq": st["last_seq"],
        "last_seq_after_consumers": last_seq_after,
        "subjects": st.get("subjects") or {},
        "consumers": durable,
    }


_VOLATILE = {"num_replicas"}  # a consumer's replica count follows the stream's placement


def verify(pre: dict, post: dict) -> list[str]:
    """Problems found comparing the snapshot before a move with the one after (empty: verified)."""
    problems = []
    new = post["last_seq"] - pre["last_seq"]
    if new < 0:
        problems.append(f"last sequence went back from {pre['last_seq']} to {post['last_seq']}")
    if post["first_seq"] != pre["first_seq"]:
        problems.append(f"first sequence changed from {pre['first_seq']} to {post['first_seq']}")
    if post["messages"] != pre["messages"] + max(new, 0):
        problems.append(f"{post['messages']} messages, expected {pre['messages']} + {max(new, 0)} new")
    for subj, n in pre["subjects"].items():
        if post["subjects"].get(subj, 0) < n:
            problems.append(f"subject {subj}: {post['subjects'].get(subj, 0)} messages, had {n}")
    for name, c in pre["consumers"].items():
        now = post["consumers"].get(name)
        if now is None:
            problems.append(f"consumer {name} is gone")
            continue
        before = {k: v for k, v in c["config"].items() if k not in _VOLATILE}
        after = {k: v for k, v in now["config"].items() if k not in _VOLATILE}
        if before != after:
            changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
            problems.append(f"consumer {name}: configuration changed ({', '.join(changed)})")
        if now["ack_floor"] < c["ack_floor"]:
            problems.append(f"consumer {name}: ack floor went back from {c['ack_floor']} to {now['ack_floor']}")
    last = post.get("last_seq_after_consumers", post["last_seq"])
    for name, now in post["consumers"].items():
        if max(now["ack_floor"], now["delivered"]) > last:
            problems.append(
                f"consumer {name} points past the stream's last sequence {last} "
                f"(delivered {now['delivered']}); run `ferry repair consumers`"
            )
    return problems
