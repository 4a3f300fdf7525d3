"""A relay's read task: the messages of a range first stored here, published to the other site on
connections and a consumer kept from the task's last range (:mod:`ferry.brokers.kept`)."""

from __future__ import annotations

from ferry.brokers import kept
from ferry.brokers.base import WriteCounts
from ferry.brokers.nats.reader import Range, ReadConfig, Reader, read_ahead, read_rows
from ferry.brokers.nats.wire import Wire
from ferry.brokers.nats.writer import WriteConfig, write_rows


class _RelayLink:
    """A relay's reader on one source stream and its connection to the destination, kept by the
    Python worker from one micro-batch to the next (:mod:`ferry.brokers.kept`)."""

    def __init__(self, reader: Reader, dest: Wire) -> None:
        self.reader, self.dest = reader, dest

    @classmethod
    async def open(cls, cfg: ReadConfig, to: WriteConfig, stream: str) -> _RelayLink:
        reader = await Reader.open(cfg, stream)
        try:
            return cls(reader, await Wire.open(to.nats(), to.name, timeout=30, prefer=to.leader))
        except BaseException:
            await reader.close()
            raise

    async def close(self) -> None:
        await self.reader.close()
        await self.dest.close()


def relay_range(cfg: ReadConfig, to: WriteConfig, part: Range) -> WriteCounts:
    """Publish to `to` the messages of `part` first stored here (without ``Ferry-Origin-Site``):
    what a relay's read task does, on connections and a consumer kept from its last range."""
    return kept.run(_relay(cfg, to, part))


async def _relay(cfg: ReadConfig, to: WriteConfig, part: Range) -> WriteCounts:
    key = ("relay", cfg, to, part.stream)
    async with kept.using(key, lambda: _RelayLink.open(cfg, to, part.stream)) as link:
        lists = read_ahead(link.reader.lists(part, keep=True))
        return await write_rows(to, read_rows(cfg, part, lists, relayed=False), link.dest)
