"""The data plane's NATS connection across a server's death, on a nats-server of the test's own."""

from __future__ import annotations

import asyncio
import subprocess

import httpx

from ferry.brokers.nats.wire import Wire
from ferry.lab.nats import nats_server_binary
from ferry.lab.procs import free_ports
from ferry.topology import NatsBroker, NatsCluster


def test_a_publisher_whose_server_dies_sends_what_it_held_once_back() -> None:
    """A publish-only connection holds what is published while its server is down and sends it
    once connected again, before what follows. It used to keep it queued for ever (a send was
    scheduled only when its queue had been empty), and with it every publish and flush after."""
    port, monitor = free_ports(2)
    argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)]
    quiet = {"stderr": subprocess.DEVNULL}
    url = f"nats://127.0.0.1:{port}"
    cluster = NatsCluster(kind="nats", brokers=[NatsBroker(name="n1", url=url)])

    async def go() -> int:
        server = subprocess.Popen(argv, **quiet)
        try:
            pub = await Wire.open(cluster, timeout=10)
            server.kill()
            server.wait(timeout=10)
            async with asyncio.timeout(10):
                while pub.is_connected:
                    await asyncio.sleep(0.01)
            for i in range(1000):  # while it is down: held
                await pub.publish(f"held.{i}", str(i).encode())
            server = subprocess.Popen(argv, **quiet)
            await pub.flush(timeout=10)  # answered once the server has read what came before
            assert pub.deaf_s > 0
            await pub.close()
            async with httpx.AsyncClient() as http:
                return (await http.get(f"http://127.0.0.1:{monitor}/varz")).json()["in_msgs"]
        finally:
            server.kill()
            server.wait(timeout=10)

    assert asyncio.run(go()) == 1000
