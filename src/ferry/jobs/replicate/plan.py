"""What a replication is and where its destination stands: the definition, its checks, the streams
it picks, the destination streams made like their sources, and the origin sequences the destination
holds (the resume point), read from the destination itself."""

from __future__ import annotations

import contextlib
import fnmatch
import shlex
import time
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ferry.brokers import nats as bnats
from ferry.brokers.nats.jsapi import paged
from ferry.brokers.nats.reader import Range, ReadConfig, read_range
from ferry.errors import FerryError, NotFound, UsageError, redact
from ferry.headers import ORIGIN_SEQ_HDR, ORIGIN_SITE_HDR, ORIGIN_STREAM_HDR
from ferry.jobs.shared.states import Machine
from ferry.journal import KvJournal
from ferry.subjects import problem, stream_name_problem
from ferry.topology import NatsCluster, Topology

CONTROL = "ferry-relay"
SCAN = 20_000  # relayed messages read back from the destination's end when resuming

RelayState = Literal["defined", "resuming", "relaying", "stopped", "failed"]
RELAY = Machine[RelayState](
    "relay",
    {
        None: {"defined", "resuming"},  # a definition on record without a state is as defined
        "defined": {"resuming", "stopped"},
        "resuming": {"resuming", "relaying", "failed", "stopped"},  # a standby may take over a relay resuming
        "relaying": {"resuming", "failed", "stopped"},
        "failed": {"resuming", "stopped"},
        "stopped": {"resuming", "stopped"},
    },
)


@dataclass
class Replication:
    """What relays where; stored at the destination with the lease and progress."""

    source: str  # site names
    dest: str
    streams: str = "*"  # glob over the source's stream names
    subject_prefix: str = ""
    stream_name: str = "{stream}"  # destination name template

    @property
    def key(self) -> str:
        return f"relay.{self.source}.{self.dest}"

    def dest_stream(self, stream: str) -> str:
        return self.stream_name.format(stream=stream)

    @property
    def mapped(self) -> bool:
        return bool(self.subject_prefix) or self.stream_name != "{stream}"

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Replication:
        return cls(**{k: state[k] for k in ("source", "dest", "streams", "subject_prefix", "stream_name")})

    def start_command(self, account: str | None = None) -> str:
        """The ``ferry replicate start`` that defines this replication (its options other than the
        defaults; `account`: the NATS account it is kept in)."""
        words = ["ferry", "replicate", "start", "--from", self.source, "--to", self.dest]
        for f in fields(self)[2:]:  # streams, subject_prefix, stream_name: options of the same names
            if getattr(self, f.name) != f.default:
                words += ["--" + f.name.replace("_", "-"), getattr(self, f.name)]
        return shlex.join(words) + account_flag(account)


def account_flag(account: str | None) -> str:
    """The ``--account`` a hint's command needs (a replication of another account than the default)."""
    return f" --account {shlex.quote(account)}" if account else ""


def relay_command(source: str, dest: str, account: str | None = None) -> str:
    """The ``ferry replicate run`` that relays SOURCE -> DEST (in `account`)."""
    return f"ferry replicate run --from {source} --to {dest}{account_flag(account)}"


def in_account(topo: Topology) -> str:
    """``" in account SALES"`` for a view of another account than the default (in messages)."""
    return f" in account {topo.account}" if topo.account else ""


def site_cluster(topo: Topology, site: str) -> NatsCluster:
    try:
        return topo.nats(site)
    except Exception as exc:
        raise UsageError(f"site {site!r}: {exc}") from None


def site_session(topo: Topology, site: str, timeout: float = 5.0) -> contextlib.AbstractAsyncContextManager[Any]:
    """A connection to `site`, whose errors name it."""
    return bnats.session(site_cluster(topo, site), name=site, client_name=CONTROL, timeout=timeout)


def check(topo: Topology, rep: Replication) -> None:
    if rep.source == rep.dest:
        raise UsageError("--from and --to must be different sites")
    for site in (rep.source, rep.dest):
        site_cluster(topo, site)
    try:
        ok = "{stream}" in rep.stream_name and bool(rep.stream_name.format(stream="S"))
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise UsageError("--stream-name must contain {stream} and no other {...}")
    if why := stream_name_problem(rep.stream_name.format(stream="S")):
        raise UsageError(f"--stream-name {rep.stream_name!r}: {why}")
    if rep.subject_prefix and (why := problem(rep.subject_prefix + "x", literal=True)):
        raise UsageError(f"--subject-prefix {rep.subject_prefix!r} makes no valid subject: {why}")


def replicable(names: list[str], glob: str) -> list[str]:
    """The streams of `names` that `glob` picks: not KV buckets (ferry's journals among them) nor the
    server's own streams ($MQTT_sess, ...), which each site has for itself."""
    return sorted(n for n in names if fnmatch.fnmatchcase(n, glob) and not n.startswith(("KV_", "$")))


async def streams_at(cluster: NatsCluster, glob: str, site: str) -> list[str]:
    async with bnats.session(cluster, name=site, client_name=CONTROL) as nc:
        names = [n async for n in paged(nc, "$JS.API.STREAM.NAMES", "streams")]
    found = replicable(names, glob)
    if not found:
        raise NotFound(f"no stream at {site} matches {glob!r}")
    return found


async def source_configs(snc: Any, rep: Replication, streams: list[str]) -> dict[str, Any]:
    """The configurations of the source's `streams`; a work-queue stream is refused (a relay reads
    a stream without consuming it, which a work-queue stream allows no one)."""
    from nats.js.api import RetentionPolicy

    sources = {stream: (await snc.jsm().stream_info(stream)).config for stream in streams}
    for stream, config in sources.items():
        if config.retention == RetentionPolicy.WORK_QUEUE:
            raise UsageError(
                f"{stream} at {rep.source} is a work-queue stream: a relay reads a stream without consuming "
                "it, which a work-queue stream allows no one; leave it out with --streams"
            )
    return sources


async def ensure_streams(
    topo: Topology, rep: Replication, streams: list[str]
) -> tuple[list[str], bool, dict[str, str]]:
    """Create the destination streams that are missing, like their sources (allowing fast batch
    publishing): the names created, whether every destination stream allows batches, and the
    server that leads each one (by source stream), for the relay's connections."""
    from nats.js.api import RetentionPolicy
    from nats.js.errors import APIError, NotFoundError

    created, batched, leaders = [], True, {}
    async with (
        site_session(topo, rep.source) as snc,
        site_session(topo, rep.dest) as dnc,
    ):
        sources = await source_configs(snc, rep, streams)
        for stream in streams:
            name = rep.dest_stream(stream)
            try:
                info = await dnc.jsm().stream_info(name)
            except NotFoundError:
                config = sources[stream]
                config.name = name
                config.subjects = [rep.subject_prefix + s for s in config.subjects or []]
                config.placement, config.mirror, config.sources = None, None, None
                config.retention = RetentionPolicy.LIMITS
                config.allow_batched = True  # so that the relay can publish in fast batches
                try:
                    info = await dnc.jsm().add_stream(config)
                except APIError as exc:
                    raise FerryError(f"cannot create {name} at {rep.dest}: {exc.description}") from None
                created.append(name)
            config, leaders[stream] = info.config, bnats.leader_of(info)
            batched = batched and bool(config.allow_batched)  # servers before 2.14 drop the setting
            if config.retention != RetentionPolicy.LIMITS:
                # the resume point is read from what the destination holds: it must not delete on its own
                raise UsageError(f"{name} at {rep.dest} must have limits retention (it has {config.retention})")
    return created, batched, leaders


# -- where the destination is ----------------------------------------------------------------


@dataclass
class Held:
    """Origin sequences of one source stream that the destination holds near its end."""

    seqs: set[int] = field(default_factory=set)
    whole: bool = False  # the scan read the whole destination stream
    floor: int = 0  # relayed for sure (a finished micro-batch's end): no hole at or below it

    @property
    def last(self) -> int:
        return max(self.floor, max(self.seqs, default=0))

    def holes(self) -> tuple[int, int] | None:
        """(lo, hi), the origin range to re-check for holes below `last`; None when there is none."""
        lo = max(self.floor + 1, 1 if self.whole or not self.seqs else min(self.seqs))
        wanted = self.last - lo + 1
        return (lo, self.last) if wanted > 0 and len([x for x in self.seqs if x >= lo]) < wanted else None


async def held(cluster: NatsCluster, site: str, stream: str, origin: str, origin_stream: str) -> Held:
    """Read the destination stream backwards until SCAN messages from (origin, origin_stream) are seen."""
    out = Held()
    async with bnats.session(cluster, name=site, client_name=CONTROL) as nc:
        st = (await nc.jsm().stream_info(stream)).state
    cfg = ReadConfig(cluster=cluster.model_dump_json(), name=site, streams=(stream,))
    hi, window = st.last_seq, 5_000
    while hi >= max(st.first_seq, 1) and len(out.seqs) < SCAN:
        lo = max(st.first_seq, 1, hi - window + 1)
        async for batch in read_range(cfg, Range(stream, lo, hi, 2_000)):
            for headers in batch.column("headers").to_pylist():
                h = dict(headers or ())
                if h.get(ORIGIN_SITE_HDR) == origin and h.get(ORIGIN_STREAM_HDR) == origin_stream:
                    out.seqs.add(int(h[ORIGIN_SEQ_HDR]))
        hi, window = lo - 1, window * 2
    out.whole = hi < max(st.first_seq, 1)
    return out


async def positions(
    topo: Topology, rep: Replication, streams: list[str], floors: dict[str, int] | None = None
) -> dict[str, Held]:
    cluster = site_cluster(topo, rep.dest)
    out = {s: await held(cluster, rep.dest, rep.dest_stream(s), rep.source, s) for s in streams}
    for s, h in out.items():
        h.floor = (floors or {}).get(s, 0)
    return out


# -- the journal at the destination -----------------------------------------------------------


@contextlib.asynccontextmanager
async def site_journal(topo: Topology, site: str, key: str, stale_after: float = 10.0) -> Any:
    async with site_session(topo, site) as nc:
        j = KvJournal(nc, key, stale_after=stale_after)
        await j.open()
        yield j


async def lags(nc: Any, relayed: dict[str, int], foreign: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Per source stream: the last relayed sequence, the stream's last, and the backlog between
    them in messages and in seconds (the age of the oldest message not relayed yet). `foreign`:
    how many messages after the relayed sequence the relay will not relay (the other site's, a
    site fail-back wrote there): not backlog. With some left, the age may be a foreign one's."""
    jsm, out = nc.jsm(timeout=2), {}
    for s, r in relayed.items():
        last = (await jsm.stream_info(s)).state.last_seq
        lag = max(0, last - r - (foreign or {}).get(s, 0))
        lag_s = 0.0
        if lag:  # the oldest message not relayed yet (r + 1 itself may be deleted or expired)
            with contextlib.suppress(Exception):
                oldest = await jsm.get_msg(s, r + 1, subject=">", next=True)
                lag_s = max(0.0, time.time() - oldest.time.timestamp())
        out[s] = {"relayed": r, "source_last": last, "lag": lag, "lag_s": round(lag_s, 3)}
    return out


def backlog_from(state: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """Where a replication no relay runs stands, per stream: (relayed, foreign) for :func:`lags`.
    A graceful stop's marker is the exact position; else the last progress on record (a site
    fail-back writes it: everything up to ``relayed`` is at the destination, and ``foreign``
    messages after it are the other site's)."""
    marker, progress = state.get("marker") or {}, state.get("progress") or {}
    relayed = {s: int(marker.get(s) or (p or {}).get("relayed") or 0) for s, p in progress.items()}
    foreign = {s: int((p or {}).get("foreign") or 0) for s, p in progress.items() if not marker.get(s)}
    return relayed, foreign


def first_line(exc: Any) -> str:
    text = str(exc or "").strip()
    return redact(text.splitlines()[0])[:300] if text else type(exc).__name__ if exc else "stopped"


async def site_record(topo: Topology, site: str) -> dict[str, Any] | None:
    async with site_journal(topo, site, "site") as j:
        return await j.get("site")


def took_over(record: dict[str, Any] | None, site: str, source: str) -> bool:
    """Whether `site`'s own record says it is primary after a failover from `source`."""
    return bool(record) and record.get("primary") == site and (record.get("failover") or {}).get("from") == source
