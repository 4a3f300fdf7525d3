"""A copy's plan, made on the driver and changing nothing: names resolved, sources counted, the
destination checked (created with ``--create``), the engine, the mode and the resume point decided."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fnmatch
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from ferry import brokers
from ferry.brokers import nats as bnats
from ferry.brokers.nats.reader import stream_states
from ferry.brokers.rabbitmq import Management, amqp_connect, q, queue_path
from ferry.brokers.rabbitmq.wire import QueueCounts
from ferry.errors import ConfigError, NotFound, UsageError
from ferry.headers import SOURCE_HDR, SOURCE_SEQ_HDR
from ferry.jobs.shared.paths import check_writable
from ferry.schema import BACKUP_RECORD
from ferry.topology import RabbitCluster, Topology
from ferry.uris import Endpoint, parse_uri


@dataclass
class CopyOptions:
    mode: str = "ordered"  # ordered | parallel (JetStream -> JetStream)
    partitions: int | None = None
    rate: float | None = None  # messages per second, all tasks together
    create: bool = False  # create a missing destination stream or queue
    dry_run: bool = False  # plan only: say what would be created
    subject_prefix: str = ""
    window: int = 512
    drain: bool = False  # queues: move their messages out (consume), instead of read and requeue


@dataclass
class CopyPlan:
    source: Endpoint
    destination: Endpoint
    options: CopyOptions
    # "stream" (rows through Spark), "snapshot" (a task per queue reads it and requeues every
    # message) or "mover" (--drain: a task per queue consumes it, each message acked once stored)
    engine: str
    messages: int = 0
    bytes: int = 0  # payload bytes, as in the report (estimated for a stream source)
    queues: list[dict[str, Any]] = field(default_factory=list)  # vhost, queue, ready, target
    resume_from: int | None = None  # ordered: first source seq still to copy
    anti_join: bool = False  # parallel: destination already holds part of this source
    batched: bool = False  # into a stream that allows fast batch publishing
    leader: str = ""  # the destination stream's leader, when planned
    subjects: list[str] | None = None  # the destination stream's subjects, when planned
    transfer_id: str = ""
    notes: list[str] = field(default_factory=list)
    stream_config: dict[str, Any] | None = None  # a stream source's, kept with its backup for --create

    def backup_record(self) -> dict[str, Any]:
        """What a backup into Parquet keeps beside its files (see _create_stream)."""
        return {"source": str(self.source), "stream": self.stream_config}

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "destination": str(self.destination),
            "engine": self.engine,
            "mode": self.options.mode,
            "partitions": self.options.partitions,
            "messages": self.messages,
            "bytes": self.bytes,
            "queues": self.queues,
            "resume_from": self.resume_from,
            "anti_join": self.anti_join,
            "batched": self.batched,
            "leader": self.leader,
            "transfer_id": self.transfer_id,
            "notes": self.notes,
        }


# -- planning ------------------------------------------------------------------------------------


def _into_itself(source: Endpoint, destination: Endpoint) -> bool:
    """Whether a copy would write what it reads back where it reads it (a stream, a queue: a
    destination queue left out or ``*`` means the same names; an exchange may route anywhere)."""
    if source.kind != destination.kind:
        return False
    if source.kind == "jetstream":
        where = ("cluster", "account", "stream")
        return all(getattr(source, k) == getattr(destination, k) for k in where)
    if source.kind == "rabbitmq":
        same_queue = destination.queue in (None, "*", source.queue) and not destination.exchange
        return same_queue and (source.cluster, source.vhost) == (destination.cluster, destination.vhost)
    return Path(source.path or "").resolve() == Path(destination.path or "").resolve()


def plan_copy(topology: Topology, src: str, dst: str, options: CopyOptions) -> CopyPlan:
    source, destination = parse_uri(src), parse_uri(dst)
    if _into_itself(source, destination):
        raise UsageError(f"{src!r} and {dst!r} are the same place: copying it into itself would store it twice")
    if options.mode not in ("ordered", "parallel"):
        raise UsageError(f"--mode must be ordered or parallel, got {options.mode!r}")
    if options.partitions and options.partitions > 1:
        options.mode = "parallel"
    # a source that reading consumes is read by one task per queue (and requeued, unless drained);
    # a replayable one is read as rows
    destructive = source.kind != "parquet" and "destructive-read" in brokers.kind(source.kind).capabilities
    if options.drain and not destructive:
        raise UsageError(f"--drain empties the queues it reads; {src!r} is not a rabbitmq:// queue source")
    engine = ("mover" if options.drain else "snapshot") if destructive else "stream"
    plan = CopyPlan(source, destination, options, engine, transfer_id=uuid.uuid4().hex[:12])
    if source.kind == "rabbitmq" and (source.queue is None):
        raise ConfigError(f"{src!r}: name a queue, or * for every queue of the vhost")
    if (
        destination.kind == "rabbitmq"
        and engine == "stream"
        and destination.queue in (None, "*")
        and not destination.exchange
    ):
        raise ConfigError(f"{dst!r}: name the destination queue, or ?exchange=NAME")
    if destination.kind == "jetstream" and destination.subject:
        raise ConfigError(f"{dst!r}: ?subject= is a read filter; use --subject-prefix to map subjects")
    if source.kind == "parquet" and not Path(source.path or "").exists():
        raise NotFound(f"{src!r}: directory {source.path} does not exist")
    if (
        destination.kind == "parquet"
        and Path(destination.path or "").exists()
        and any(Path(destination.path).iterdir())
    ):
        raise ConfigError(f"{dst!r}: directory {destination.path} is not empty")
    if destination.kind == "parquet":
        check_writable(repr(dst), Path(destination.path or ""))
    asyncio.run(_plan_async(topology, plan))
    return plan


async def _plan_async(topology: Topology, plan: CopyPlan) -> None:
    src, dst = plan.source, plan.destination
    st: dict[str, int] = {}
    if src.kind == "jetstream":
        cluster = topology.nats(src.cluster or "", src.account)
        async with bnats.session(cluster, name=src.cluster or "") as nc:
            states = await stream_states(cluster, [src.stream or ""], src.subject, src.cluster or "", nc)
            st = states[src.stream or ""]
            plan.messages = st["messages"]
            plan.bytes = await _stream_payload(nc, src.stream or "", st)
            if plan.destination.kind == "parquet":
                plan.stream_config = (await nc.jsm().stream_info(src.stream or "")).config.as_dict()
        plan.notes.append("bytes are payload bytes, estimated from the stream's stored size")
    elif src.kind == "parquet":
        try:
            plan.messages, plan.bytes = _parquet_size(src.path or "")
        except (pa.ArrowInvalid, OSError) as exc:
            raise ConfigError(f"{src}: not a Parquet backup ({str(exc).splitlines()[0]})") from None
    elif src.kind == "rabbitmq":
        plan.queues = await _source_queues(topology, src, plan.options)
        await live_counts(topology.rabbitmq(src.cluster or ""), plan.queues)
        plan.messages = sum(x["ready"] for x in plan.queues)
        plan.bytes = sum(x["bytes"] for x in plan.queues)
        plan.notes.append(
            "drains the source queues: they will be empty afterwards"
            if plan.options.drain
            else "reads the source queues without consuming them: each message is held unacked while it is "
            "copied, then requeued, so the queues keep every message (now with the redelivered flag); "
            "a rerun copies every message again (--drain moves them out instead)"
        )
    if dst.kind == "jetstream":
        await _plan_stream_destination(topology, plan)
    elif dst.kind == "rabbitmq":
        await _plan_queue_destination(topology, plan)
        await _check_access(topology, dst.cluster or "", {x["target_vhost"] for x in plan.queues} or {dst.vhost or "/"})
    if st and (src.start_seq or src.end_seq or plan.resume_from):
        _narrow(plan, st)
    several = sum(x["ready"] > 0 for x in plan.queues) > 1
    if plan.engine == "snapshot" and dst.kind == "jetstream" and several and plan.options.mode == "ordered":
        plan.options.mode = "parallel"  # a writer per queue: each expecting its own last would refuse the others'
        plan.notes.append("several queues into one stream: each in its order, apart from publishes sent again")


def _narrow(plan: CopyPlan, st: dict[str, int]) -> None:
    """Count only the sequences the copy reads (a range given, or a resumed copy): exact when
    every sequence of the stream is there and matches, else in proportion to the range."""
    lo = max(filter(None, (plan.source.start_seq, plan.resume_from, st["first_seq"])))
    hi = min(plan.source.end_seq or st["last_seq"], st["last_seq"])
    span = st["last_seq"] - st["first_seq"] + 1
    if not plan.messages or span <= 0:
        return
    inside = max(0, hi - lo + 1)
    messages = inside if plan.messages == span else round(plan.messages * inside / span)
    if plan.messages != span:
        plan.notes.append("the count within the sequence range is estimated (the stream has gaps or a filter)")
    plan.bytes = plan.bytes * messages // plan.messages
    plan.messages = messages


async def _stream_payload(nc: Any, stream: str, st: dict[str, int]) -> int:
    """The payload bytes of the stream's messages (those matching its filter), estimated from its
    stored size: besides its payload a stored message takes its subject, its header block and 30
    bytes (34 with headers; file storage), measured on the last message."""
    if not st["all_messages"] or not st["messages"]:
        return 0
    overhead = 30
    with contextlib.suppress(Exception):  # gone meanwhile (limits): count the fixed overhead only
        last = await nc.jsm().get_msg(stream, st["last_seq"])
        hdrs = base64.b64decode(last.hdrs) if last.hdrs else b""
        overhead += len((last.subject or "").encode()) + (4 + len(hdrs) if hdrs else 0)
    payload = max(0, st["bytes"] - st["all_messages"] * overhead)
    return payload * st["messages"] // st["all_messages"]


def _parquet_size(path: str) -> tuple[int, int]:
    """Rows (from the files' metadata) and payload bytes (from the payload column alone)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    data = ds.dataset(path, format="parquet")  # skips _SUCCESS and hidden files, as Spark does
    if "payload" not in data.schema.names:
        return data.count_rows(), 0
    payload = sum(pc.sum(pc.binary_length(b.column(0))).as_py() or 0 for b in data.to_batches(columns=["payload"]))
    return data.count_rows(), payload


async def _check_access(topology: Topology, cluster_name: str, vhosts: set[str]) -> None:
    """Open (and close) an AMQP connection per vhost: a missing permission fails now, not mid-copy."""
    cluster = topology.rabbitmq(cluster_name)
    for vhost in sorted(vhosts):
        conn = await amqp_connect(cluster, vhost=vhost)
        await conn.close()


async def live_counts(cluster: RabbitCluster, queues: list[dict[str, Any]]) -> None:
    """Set each queue's "ready" from a passive declare (the management API lags by up to 5 s).

    Also proves AMQP access to every vhost involved before anything moves.
    """
    counts = QueueCounts(cluster)
    try:
        for x in sorted(queues, key=lambda x: x["vhost"]):
            x["ready"] = await counts.ready(x["vhost"], x["queue"])
    finally:
        await counts.close()


async def _source_queues(topology: Topology, src: Endpoint, options: CopyOptions) -> list[dict[str, Any]]:
    cluster = topology.rabbitmq(src.cluster or "")
    async with Management(cluster, name=src.cluster or "") as m:
        vhosts = [v["name"] for v in await m.get("/vhosts")] if src.vhost == "*" else [src.vhost or "/"]
        out = []
        for vhost in vhosts:
            if "*" in (src.queue or ""):
                listed = await m.get(f"/queues/{q(vhost)}", ok404=True)
                if listed is None:
                    raise NotFound(f"{src}: vhost {vhost!r} does not exist")
                listed = [i for i in listed if fnmatch.fnmatchcase(i["name"], src.queue or "*")]
            else:
                one = await m.get(f"/queues/{q(vhost)}/{q(src.queue or '')}", ok404=True)
                if one is None:
                    raise NotFound(f"{src}: queue {src.queue!r} not found in vhost {vhost!r}")
                listed = [one]
            for item in listed:
                if item.get("exclusive_consumer_tag") or item.get("exclusive"):
                    continue
                if not options.drain:
                    _check_requeue(item, vhost)
                out.append(
                    {
                        "vhost": vhost,
                        "queue": item["name"],
                        "ready": int(item.get("messages_ready", 0)),
                        "bytes": int(item.get("message_bytes_ready", 0)),
                        "type": item.get("type"),
                        "arguments": item.get("arguments") or {},
                        "durable": item.get("durable", True),
                    }
                )
    return out


def _check_requeue(item: dict[str, Any], vhost: str) -> None:
    """Refuse a queue that reading and requeueing would change: one with a delivery limit (a
    requeue counts as a delivery). A federated queue is read as any other: the readers' negative
    priority keeps its federation link from pulling (see queue_io.snapshot_queue)."""
    where = queue_path(vhost, item["name"])
    limit = (item.get("arguments") or {}).get("x-delivery-limit") or (
        item.get("effective_policy_definition") or {}
    ).get("delivery-limit")
    if limit:
        raise ConfigError(
            f"queue {where} has a delivery limit ({limit}): reading it counts as a delivery and could "
            "dead-letter its messages; refusing (--drain moves them out instead)"
        )


async def _plan_stream_destination(topology: Topology, plan: CopyPlan) -> None:
    dst, opts = plan.destination, plan.options
    cluster = topology.nats(dst.cluster or "", dst.account)
    async with bnats.session(cluster, name=dst.cluster or "") as nc:
        jsm = nc.jsm()
        try:
            info = await jsm.stream_info(dst.stream or "")
        except Exception as exc:
            if "not found" not in str(exc).lower():
                raise
            if not opts.create:
                raise NotFound(f"{dst}: stream {dst.stream!r} does not exist (pass --create to create it)") from None
            if opts.dry_run:
                plan.notes.append(f"would create stream {dst.stream} in {dst.cluster}")
                return
            info = await _create_stream(topology, plan, jsm)
            plan.notes.append(f"created stream {dst.stream} in {dst.cluster}")
        _use_batches(plan, bool(info.config.allow_batched))  # servers before 2.14 drop the setting
        plan.leader = bnats.leader_of(info)
        plan.subjects = list(info.config.subjects or [])
        if plan.source.kind == "rabbitmq" or info.state.messages == 0:
            return
        if plan.source.kind == "jetstream":
            source_name = f"{plan.source.cluster}/{plan.source.stream}"
        else:  # a backup of one stream is restored in its order: a rerun resumes the same way
            source_name = _parquet_source(plan.source.path or "") if opts.mode == "ordered" else None
        if opts.mode == "ordered" and source_name:
            last = await jsm.get_msg(dst.stream or "", info.state.last_seq)
            headers = last.headers or {}
            if headers.get(SOURCE_HDR) == source_name:
                plan.resume_from = int(headers[SOURCE_SEQ_HDR]) + 1
                plan.notes.append(f"resuming after source sequence {plan.resume_from - 1} (the destination's last)")
        elif plan.source.kind == "jetstream":
            plan.anti_join = True
            plan.notes.append("the destination is not empty: copying only what it does not hold yet")


def _parquet_source(path: str) -> str | None:
    """The one source (``cluster/stream``) of a Parquet backup's rows, from its files' column
    statistics (nothing is read); None for several, none, or files without them."""
    import pyarrow.dataset as ds

    found: set[str] = set()
    for fragment in ds.dataset(path, format="parquet").get_fragments():
        meta = fragment.metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            column = next(
                (group.column(c) for c in range(group.num_columns) if group.column(c).path_in_schema == "source"), None
            )
            stats = column.statistics if column else None
            if not stats or not stats.has_min_max or stats.null_count:
                return None
            found |= {stats.min, stats.max}
            if len(found) > 1:
                return None
    return found.pop() if found else None


def _use_batches(plan: CopyPlan, allowed: bool) -> None:
    if allowed:
        plan.batched = True
        plan.notes.append("publishing in fast batches (the destination allows batched publishing)")


async def _create_stream(topology: Topology, plan: CopyPlan, jsm: Any) -> Any:
    from nats.js.api import Placement, StreamConfig
    from nats.js.errors import APIError

    src, dst = plan.source, plan.destination
    if src.kind == "parquet":
        config = StreamConfig.from_response(_backup_stream_config(src))
    elif src.kind == "jetstream":
        async with bnats.session(topology.nats(src.cluster or "", src.account), name=src.cluster or "") as snc:
            config = (await snc.jsm().stream_info(src.stream or "")).config
    else:
        raise UsageError(f"--create for a stream copies a stream's configuration: {src} is no stream nor backup of one")
    config.name = dst.stream
    config.subjects = [plan.options.subject_prefix + s for s in (config.subjects or [])]
    same_system = src.kind == "jetstream" and _same_system(topology, src, dst)
    config.placement = Placement(cluster=dst.cluster) if same_system else None
    config.sealed, config.first_seq = False, None  # a sealed stream takes no copy; sequences start at 1
    config.mirror, config.sources = None, None
    config.allow_batched = True  # so that the copy can publish in fast batches
    try:
        return await jsm.add_stream(config)
    except APIError as exc:
        hint = (
            " (they are copied from the source: --subject-prefix gives the copy its own)"
            if exc.err_code == 10065
            else ""
        )
        raise ConfigError(f"{dst}: cannot create stream {dst.stream!r}: {exc.description}{hint}") from None


def _backup_stream_config(src: Endpoint) -> dict[str, Any]:
    """The configuration of the stream a Parquet backup was taken from, as its record kept it."""
    path = Path(src.path or "") / BACKUP_RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        record = {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{src}: cannot read the backup's record {path}: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("stream"), dict):
        raise UsageError(
            f"--create: {src} records no stream configuration (not a backup of a stream, or one written "
            f"before ferry kept {BACKUP_RECORD}): create the stream first"
        )
    return dict(record["stream"])


def _same_system(topology: Topology, a: Endpoint, b: Endpoint) -> bool:
    return topology.site_of(a.cluster or "") == topology.site_of(b.cluster or "")


async def _plan_queue_destination(topology: Topology, plan: CopyPlan) -> None:
    """Resolve each source queue's target (vhost ``*`` and queue ``*`` keep the source's names)."""
    dst = plan.destination
    cluster = topology.rabbitmq(dst.cluster or "")
    async with Management(cluster, name=dst.cluster or "") as m:
        sources = plan.queues or [{"vhost": dst.vhost, "queue": dst.queue, "arguments": {}, "durable": True}]
        checked: set[str] = set()
        for item in sources:
            vhost = item["vhost"] if dst.vhost == "*" else (dst.vhost or "/")
            item["target_vhost"] = vhost
            if vhost not in checked:
                if await m.get(f"/vhosts/{q(vhost)}", ok404=True) is None:
                    raise NotFound(f"{dst}: vhost {vhost!r} does not exist")
                checked.add(vhost)
            if dst.exchange:
                if await m.get(f"/exchanges/{q(vhost)}/{q(dst.exchange)}", ok404=True) is None:
                    raise NotFound(f"{dst}: exchange {dst.exchange!r} does not exist in vhost {vhost!r}")
                continue
            target = dst.queue if dst.queue not in (None, "*") else item["queue"]
            item["target"] = target
            if await m.get(f"/queues/{q(vhost)}/{q(target or '')}", ok404=True) is None:
                if not plan.options.create:
                    raise NotFound(
                        f"{dst}: queue {target!r} does not exist in vhost {vhost!r} "
                        "(pass --create to create it like the source)"
                    )
                if plan.options.dry_run:
                    plan.notes.append(f"would create queue {target} in {dst.cluster} vhost {vhost}")
                    continue
                await m.put(
                    f"/queues/{q(vhost)}/{q(target or '')}",
                    {"durable": item.get("durable", True), "arguments": item.get("arguments", {})},
                )
                plan.notes.append(f"created queue {target} in {dst.cluster} vhost {vhost}")
