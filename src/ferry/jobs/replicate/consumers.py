"""Durable consumers across sites (issue 52): the relay keeps, at the destination, a paused copy
of each durable consumer of the streams it relays, positioned at the first destination message
the source's consumer had not acknowledged; a failover resumes them, so an application that
reconnects to the other site with the same durable name goes on where it was.

Positions are translated through the origin headers the relay stamps: the source consumer's ack
floor F (a source sequence) becomes the destination sequence of the first message relayed from
the source with ``Ferry-Origin-Seq`` above F (the destination's end when none is there yet), and
the copy is reset there (ADR-60 consumer reset, nats-server 2.14+). What the source's consumer
acknowledged above its floor (out of order) and what it acknowledged after the last checkpoint
is delivered again at the destination: the first is counted at each checkpoint, the second is at
most one checkpoint interval of the application's acks.

A copy carries its origin in its metadata (``ferry.origin`` ...): a relay never copies such a
consumer on (so nyc -> sfo and sfo -> nyc together make no cycle), and the copy of a consumer
deleted at the source is deleted with it. Ephemeral consumers are not copied.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError

from ferry.brokers.nats.reader import Range, ReadConfig, read_range
from ferry.headers import ORIGIN_SEQ_HDR, ORIGIN_SITE_HDR, ORIGIN_STREAM_HDR
from ferry.subjects import overlaps
from ferry.topology import NatsCluster

ORIGIN = "ferry.origin"  # metadata of a copy: the site and stream whose consumer it copies
ORIGIN_STREAM = "ferry.origin-stream"
PAUSED_UNTIL = "2999-01-01T00:00:00Z"  # a copy delivers nothing until a failover resumes it
GETS = 8  # messages got one by one in a translation before reading a window of them
WINDOW = 2_000  # destination messages read per window


@dataclass
class Position:
    """One source consumer at one checkpoint."""

    stream: str  # the source stream
    name: str
    config: dict[str, Any]
    ack_floor: int  # source stream sequence
    acked_above_floor: int  # acknowledged out of order above the floor: delivered again at the destination
    at: float = 0.0  # when it was asked for

    @classmethod
    def of(cls, stream: str, info: Any, at: float = 0.0) -> Position:
        floor, delivered = info.ack_floor, info.delivered
        # deliveries above the floor not pending any more were acknowledged (a redelivery counts twice:
        # an upper bound)
        above = max(0, (delivered.consumer_seq or 0) - (floor.consumer_seq or 0) - (info.num_ack_pending or 0))
        return cls(
            stream,
            info.name,
            info.config.as_dict(),
            floor.stream_seq or 0,
            above,
            at,
        )


def unmatched(p: Position, subjects: list[str]) -> str | None:
    """Why `p` gets no new message (its filter matches none of its stream's subjects, which the
    relay carries), or None."""
    filters = p.config.get("filter_subjects") or [f for f in [p.config.get("filter_subject")] if f]
    if not filters or any(overlaps(f, s) for f in filters for s in subjects):
        return None
    return f"its filter {', '.join(filters)} matches none of {p.stream}'s subjects ({', '.join(subjects) or 'none'})"


def copied(config: ConsumerConfig) -> bool:
    """A consumer ferry made as the copy of another site's."""
    return bool((config.metadata or {}).get(ORIGIN))


async def positions(nc: Any, streams: list[str]) -> list[Position]:
    """Every durable consumer of `streams` at the source, but ferry's copies of another site's."""
    jsm, out = nc.jsm(), []
    for stream in streams:
        asked = time.time()  # the state read is at least this recent: acks before it are in it
        for info in await jsm.consumers_info(stream):
            if info.config.durable_name and not copied(info.config):
                out.append(Position.of(stream, info, asked))
    return out


@dataclass
class Translator:
    """Source ack floors to destination sequences for one destination stream, by binary search
    over the origin sequences the relay stamped (it stores each source stream's messages in their
    order, so they rise with the destination's sequence): a few message gets per consumer, however
    far it moved since the last checkpoint."""

    cluster: NatsCluster
    site: str  # the destination's
    origin: str  # the source site

    async def seq_after(
        self,
        nc: Any,
        dest_stream: str,
        origin_stream: str,
        floor: int,
        hint: tuple[int, int] | None = None,
        ends: tuple[int, int] | None = None,
    ) -> int:
        """The destination sequence of the first message relayed from (origin, origin_stream) whose
        origin sequence is above `floor`; the destination's last sequence + 1 when there is none.
        `hint`: an earlier answer (floor, sequence), from which a relay that stored nothing else
        in between puts the answer `floor` - that floor further: two gets when it does. `ends`: the
        destination stream's first and last sequence, when the caller read them already."""
        first, last = ends or await stream_ends(nc, dest_stream)
        lo, top = max(1, first), last + 1
        best = top
        if hint and lo < (guess := hint[1] + floor - hint[0]) <= top:
            below = await self._next_origin(nc, dest_stream, origin_stream, guess - 1, top)
            if below and below[1] <= floor:  # the answer is the next of its messages, if above the floor
                lo = below[0] + 1
                above = await self._next_origin(nc, dest_stream, origin_stream, lo, top)
                if above is None or above[1] > floor:
                    return above[0] if above else top
                lo = above[0] + 1
        # the answer is the smaller of `best` and the first such message in [lo, top)
        while lo < top:
            mid = (lo + top) // 2
            found = await self._next_origin(nc, dest_stream, origin_stream, mid, top)
            if found is None:  # none of this origin's messages in [mid, top)
                top = mid
            elif found[1] > floor:
                best = top = found[0]
            else:  # every one of its messages up to found[0] is at or below the floor
                lo = found[0] + 1
        return best

    async def _next_origin(
        self, nc: Any, stream: str, origin_stream: str, seq: int, top: int
    ) -> tuple[int, int] | None:
        """(destination seq, origin seq) of the first message from (origin, origin_stream) in
        [seq, top): a get per message while they come from elsewhere, windows after a few."""
        jsm = nc.jsm()
        for _ in range(GETS):
            try:
                msg = await jsm.get_msg(stream, seq, subject=">", next=True)
            except NotFoundError:
                return None
            if msg.seq >= top:
                return None
            h = msg.headers or {}
            if h.get(ORIGIN_SITE_HDR) == self.origin and h.get(ORIGIN_STREAM_HDR) == origin_stream:
                return msg.seq, int(h[ORIGIN_SEQ_HDR])
            seq = msg.seq + 1
        cfg = ReadConfig(cluster=self.cluster.model_dump_json(), name=self.site, streams=(stream,))
        while seq < top:  # this site's own messages, or another origin's, between the relayed ones
            hi = min(top - 1, seq + WINDOW - 1)
            if found := await _origins(cfg, stream, seq, hi, self.origin, origin_stream):
                return min(found)
            seq = hi + 1
        return None


async def stream_ends(nc: Any, stream: str) -> tuple[int, int]:
    """`stream`'s first and last sequence."""
    state = (await nc.jsm().stream_info(stream)).state
    return state.first_seq, state.last_seq


async def _origins(
    cfg: ReadConfig, stream: str, lo: int, hi: int, origin: str, origin_stream: str
) -> list[tuple[int, int]]:
    """(destination seq, origin seq) of the messages relayed from (origin, origin_stream) in [lo, hi]."""
    out = []
    async for batch in read_range(cfg, Range(stream, lo, hi, WINDOW)):
        seqs, headers = batch.column("source_seq").to_pylist(), batch.column("headers").to_pylist()
        for seq, hs in zip(seqs, headers, strict=True):
            h = dict(hs or ())
            if h.get(ORIGIN_SITE_HDR) == origin and h.get(ORIGIN_STREAM_HDR) == origin_stream:
                out.append((seq, int(h[ORIGIN_SEQ_HDR])))
    return out


def copy_config(p: Position, origin: str, subject_prefix: str = "") -> ConsumerConfig:
    """The destination's copy of `p`: its configuration, delivering from the stream's start (a
    reset then positions it), paused, and marked with where it comes from and stood."""
    cfg = ConsumerConfig.from_response(dict(p.config))
    cfg.deliver_policy, cfg.opt_start_seq, cfg.opt_start_time = DeliverPolicy.ALL, None, None
    if subject_prefix:
        cfg.filter_subject = subject_prefix + cfg.filter_subject if cfg.filter_subject else None
        cfg.filter_subjects = [subject_prefix + s for s in cfg.filter_subjects] if cfg.filter_subjects else None
    cfg.pause_until = PAUSED_UNTIL
    cfg.metadata = {**(cfg.metadata or {}), ORIGIN: origin, ORIGIN_STREAM: p.stream}
    return cfg


async def place(
    jsm: Any, dest_stream: str, p: Position, seq: int, origin: str, subject_prefix: str = "", configure: bool = True
) -> str | None:
    """Create the copy of `p` in `dest_stream` (or update it: `configure`), positioned so that it
    delivers from destination sequence `seq` on. Where it leaves the consumer of that name alone,
    changing nothing, it says why: an application's own consumer, or a copy a failover resumed
    (the applications' now: a relay frozen through the failover wakes up still checkpointing, and
    would move it back to where they stood before)."""
    try:
        have = await jsm.consumer_info(dest_stream, p.name)
    except NotFoundError:
        have = None
    if have and not copied(have.config):
        return f"{dest_stream} has a consumer {p.name} of its own"
    if have and not have.paused:
        return f"its copy in {dest_stream} delivers (a failover resumed it)"
    if configure or have is None:
        await jsm.add_consumer(dest_stream, copy_config(p, origin, subject_prefix))
    await jsm.reset_consumer(dest_stream, p.name, seq)
    return None


async def prune(jsm: Any, dest_stream: str, origin: str, origin_stream: str, keep: set[str]) -> list[str]:
    """Delete the copies in `dest_stream` of (origin, origin_stream)'s consumers not in `keep`."""
    gone = []
    for info in await jsm.consumers_info(dest_stream):
        meta = info.config.metadata or {}
        if meta.get(ORIGIN) == origin and meta.get(ORIGIN_STREAM) == origin_stream and info.name not in keep:
            await jsm.delete_consumer(dest_stream, info.name)
            gone.append(info.name)
    return gone


@dataclass
class Checkpointer:
    """The relay's consumer checkpoints: each one reads the source's durable consumers and moves
    their copies at the destination to match; rows for the relay's journal."""

    source: str
    dest_cluster: NatsCluster
    dest: str
    dest_stream: Any  # Callable[[str], str]: the destination stream of a source stream
    subject_prefix: str = ""
    placed: dict[tuple[str, str], tuple[int, int, str]] = field(default_factory=dict)  # -> (floor, seq, config)

    def __post_init__(self) -> None:
        self.translator = Translator(self.dest_cluster, self.dest, self.source)

    async def __call__(self, src_nc: Any, dest_nc: Any, streams: list[str]) -> list[dict[str, Any]]:
        jsm, rows, ends = dest_nc.jsm(), [], {}
        found = await positions(src_nc, streams)
        subjects = {s: (await src_nc.jsm().stream_info(s)).config.subjects or [] for s in {p.stream for p in found}}
        for p in found:
            key, target = (p.stream, p.name), self.dest_stream(p.stream)
            before = self.placed.get(key)
            if target not in ends:  # once per checkpoint (an older end only puts a copy earlier: delivered again)
                ends[target] = await stream_ends(dest_nc, target)
            seq = await self.translator.seq_after(
                dest_nc, target, p.stream, p.ack_floor, before and before[:2], ends[target]
            )
            shape = repr(sorted(p.config.items()))
            row = {"stream": p.stream, "consumer": p.name, "ack_floor": p.ack_floor, "position": seq}
            row |= {"acked_above_floor": p.acked_above_floor, "at": round(p.at, 3)}
            if why := unmatched(p, subjects[p.stream]):
                row["unmatched"] = why  # copied all the same: what it had not acknowledged may still be there
            if before != (p.ack_floor, seq, shape):
                configure = not before or before[2] != shape  # else only its position changes
                try:
                    if why := await place(jsm, target, p, seq, self.source, self.subject_prefix, configure):
                        row["refused"] = why
                    else:
                        self.placed[key] = (p.ack_floor, seq, shape)
                except APIError as exc:  # this consumer only: the others' checkpoints go on
                    row["refused"] = f"{target} refused the copy: {exc.description}"
            rows.append(row)
        for stream in streams:
            keep = {p.name for p in found if p.stream == stream}
            for name in await prune(jsm, self.dest_stream(stream), self.source, stream, keep):
                self.placed.pop((stream, name), None)
        return rows


def rpo(state: dict[str, Any], now: float) -> list[dict[str, Any]]:
    """Per consumer of the last checkpoint on record (a relay's journal): where its copy delivers
    from, and what it may deliver again: what it acknowledged above its floor then, and what it
    acknowledged since (at most `age_s` of the application's acknowledgements); a consumer not
    copied says why (``refused``), one that gets no new message says so (``unmatched``)."""
    return [
        {
            **{k: row[k] for k in ("stream", "consumer", "ack_floor", "position")},
            "redelivered_at_least": row["acked_above_floor"],
            "checkpoint_at": row["at"],
            "checkpoint_age_s": round(now - row["at"], 1),
            **{k: row[k] for k in ("refused", "unmatched") if k in row},
        }
        for row in state.get("consumers") or []
    ]


async def resume(nc: Any, rows: list[dict[str, Any]], translator: Translator, dest_stream: Any) -> None:
    """Let the copies in `rows` deliver (a failover: the applications come to this site), each
    positioned again from its last checkpoint against all the relay stored (it may have relayed
    the messages up to a consumer's floor only after that checkpoint); `rows` get the positions."""
    jsm = nc.jsm()
    for row in rows:
        if "refused" in row:  # not copied: nothing to resume
            continue
        target = dest_stream(row["stream"])
        row["position"] = await translator.seq_after(nc, target, row["stream"], row["ack_floor"])
        await jsm.reset_consumer(target, row["consumer"], row["position"])
        await jsm.resume_consumer(target, row["consumer"])


async def home(
    here: NatsCluster,
    site: str,
    there: NatsCluster,
    primary: str,
    stream: str,
    here_nc: Any,
    there_nc: Any,
    checkpoint: dict[str, int],
) -> list[dict[str, Any]]:
    """A fail-back to `site` (once `stream` is reconciled both ways): each consumer copied from
    `site` to `primary` is moved back to where the application stood at `primary`, its own
    consumer at `site` reset to the first message there that it had acknowledged at neither
    site, and the copy is paused again. At `site` that first message is the smallest of:
    `site`'s own messages above its consumer's ack floor there (what it had acknowledged before
    the failover) and still unacknowledged at `primary` (read from the origin headers there after
    the copy's ack floor, which includes those `site` stored but never relayed, sent to `primary`
    by the fail-back), and the messages brought from `primary` above the copy's floor.
    `checkpoint`: each consumer's ack floor at `site` in the last checkpoint before the failover."""
    there_js, here_js, rows = there_nc.jsm(), here_nc.jsm(), []
    cfg = ReadConfig(cluster=there.model_dump_json(), name=primary, streams=(stream,))
    last = (await there_js.stream_info(stream)).state.last_seq
    brought = Translator(here, site, primary)
    for info in await there_js.consumers_info(stream):
        meta = info.config.metadata or {}
        if meta.get(ORIGIN) != site or meta.get(ORIGIN_STREAM) != stream:
            continue
        p = Position.of(stream, info)
        try:
            before = Position.of(stream, await here_js.consumer_info(stream, p.name))
        except NotFoundError:
            before = None
        # what it had acknowledged at `site`: its floor there, or where the last checkpoint saw it if
        # higher (a server SIGKILLed may come back with acks it confirmed but had not written yet)
        done = max(before.ack_floor if before else 0, checkpoint.get(p.name, 0))
        own = [o for _, o in await _origins(cfg, stream, p.ack_floor + 1, last, site, stream) if o > done]
        seq = min(min(own, default=2**63), await brought.seq_after(here_nc, stream, stream, p.ack_floor))
        await _reset_or_recreate(here_js, stream, p, seq)
        await there_js.pause_consumer(stream, p.name, PAUSED_UNTIL)
        again = p.acked_above_floor + (before.acked_above_floor if before else 0)
        rows.append(
            {"consumer": p.name, "ack_floor_at_primary": p.ack_floor, "ack_floor_here": done, "position": seq}
            | {"redelivered_at_least": again}
        )
    return rows


async def _reset_or_recreate(jsm: Any, stream: str, p: Position, seq: int) -> None:
    """`p`'s consumer in `stream` delivering from `seq` on: reset there when it exists and its
    deliver policy allows (all, by start sequence or time), else made again from `p`'s
    configuration delivering from `seq`, without ferry's marks."""
    from nats.js.errors import ConsumerInvalidResetError

    with contextlib.suppress(NotFoundError, ConsumerInvalidResetError):
        await jsm.reset_consumer(stream, p.name, seq)
        return
    with contextlib.suppress(NotFoundError):
        await jsm.delete_consumer(stream, p.name)
    cfg = ConsumerConfig.from_response(dict(p.config))
    cfg.deliver_policy, cfg.opt_start_seq, cfg.opt_start_time = DeliverPolicy.BY_START_SEQUENCE, seq, None
    cfg.pause_until = None
    cfg.metadata = {k: v for k, v in (cfg.metadata or {}).items() if not k.startswith("ferry.")} or None
    await jsm.add_consumer(stream, cfg)
