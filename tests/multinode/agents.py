"""What the workers of the multi-node tests do: ``async def f(comm, ctl, **kwargs)``.

Each runs in its own process inside an emulated node (see ``agent.py``), written as a
user of rlinf would write it, and reports what it saw through ``ctl.emit``; the tests
judge. Every await has a timeout. Ledgers number every message, so that the test can
tell delivered, lost, duplicated, reordered and raised apart.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

import rlinf

MiB = 1 << 20


def payload(seq: int, nbytes: int) -> np.ndarray:
    """A buffer whose content says which message it belongs to."""
    return np.full(nbytes, seq % 251, dtype=np.uint8)


def intact(seq: int, data: np.ndarray, nbytes: int) -> bool:
    return data.nbytes == nbytes and bool((data == seq % 251).all())


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


async def _roster(comm) -> dict:
    return {w.address: {"node_id": w.node_id, "host": w.host, "endpoints": w.endpoints} for w in await comm.peers()}


# --------------------------------------------------------------------------- healthy paths


async def echo(comm, ctl):
    """Send back whatever arrives, to its sender, until a ``"stop"`` comes."""
    served = 0
    ctl.emit("serving")
    while True:
        obj, src = await comm.recv_any(timeout=120)
        if isinstance(obj, str) and obj == "stop":
            return {"served": served, "roster": await _roster(comm)}
        await comm.send(obj, src, timeout=30)
        served += 1


async def route_probe(comm, ctl, targets: list[str], nbytes: int = 2 * MiB):
    """Round trips with each of ``targets`` (echo agents): a small message, then a large
    one; which transports the large send used (from ``comm.stats()``), which link carries
    the messages to each, and the roster."""
    routes = {}
    for i, dst in enumerate(targets):
        await comm.send({"small": i}, dst, timeout=30)
        assert await comm.recv(dst, timeout=30) == {"small": i}
        before = {k: v.msgs for k, v in comm.stats().transports.items()}
        await comm.send({"big": i, "data": payload(i, nbytes)}, dst, timeout=30)
        after = {k: v.msgs for k, v in comm.stats().transports.items()}
        back = await comm.recv(dst, timeout=30)
        assert back["big"] == i and intact(i, back["data"], nbytes), f"{dst} sent back something else"
        routes[dst] = sorted(k for k in after if after[k] > before.get(k, 0))
    # which link carries the small messages to each: the link class and its endpoint
    link = {dst: (lambda ln: [type(ln).__name__, ln.endpoint])(comm._sessions.get(dst).outbox.link)
            for dst in targets}
    roster = await _roster(comm)
    for dst in targets:
        await comm.send("stop", dst, timeout=30)
    return {"routes": routes, "roster": roster, "links": link}


async def ping_pong(comm, ctl, peer: str, sizes: list[int], rounds: int):
    """``rounds`` numbered round trips with an echo agent, cycling through ``sizes``;
    each reply checked for order and content."""
    started = time.monotonic()
    for seq in range(rounds):
        nbytes = sizes[seq % len(sizes)]
        await comm.send({"seq": seq, "data": payload(seq, nbytes)}, peer, timeout=30)
        back = await comm.recv(peer, timeout=30)
        assert back["seq"] == seq, f"round {seq}: got the reply to {back['seq']}"
        assert intact(seq, back["data"], nbytes), f"round {seq}: the {nbytes}-byte reply is corrupt"
    elapsed = time.monotonic() - started
    await comm.send("stop", peer, timeout=30)
    return {"rounds": rounds, "seconds": elapsed}


async def collective(comm, ctl, members: list[str], root: str, nbytes: int):
    """Every collective once over ``members`` (spanning nodes); each result checked."""
    group = comm.group(members)
    me = members.index(comm.address)
    n = len(members)
    checks = {}
    async with asyncio.timeout(60):
        data = await group.broadcast(payload(7, nbytes) if comm.address == root else None, root=root)
        checks["broadcast"] = intact(7, data, nbytes)
        total = await group.all_reduce(np.full(1000, me + 1, dtype=np.float64), op="sum")
        checks["all_reduce"] = bool((total == n * (n + 1) / 2).all())
        checks["all_gather"] = await group.all_gather(comm.address) == members
        gathered = await group.gather(me * 10, root=root)
        checks["gather"] = gathered == [i * 10 for i in range(n)] if comm.address == root else gathered is None
        part = await group.scatter([f"to-{m}" for m in members] if comm.address == root else None, root=root)
        checks["scatter"] = part == f"to-{comm.address}"
        swapped = await group.all_to_all([(comm.address, m) for m in members])
        checks["all_to_all"] = swapped == [(m, comm.address) for m in members]
        await group.barrier()
    return {"checks": checks}


async def channel_owner(comm, ctl, name: str, serve_for: float = 120.0):
    """Create channel ``name`` (served from a new process on this node, which lives as
    long as we do); close it when told (within ``serve_for`` seconds); exit when told."""
    ch = await comm.create_channel(name, timeout=60)
    ctl.emit("created")
    await ctl.command("close", timeout=serve_for)
    await ch.close(timeout=30)
    await ctl.command("exit")
    return {}


async def produce(comm, ctl, name: str, n: int, nbytes: list[int], wait_to_exit: bool):
    """Put ``n`` numbered items (sizes cycling through ``nbytes``); flush; then wait for
    the test's ``exit`` (or, with ``wait_to_exit`` false, return at once, as a producer
    whose job is done does)."""
    ch = await comm.channel(name, timeout=30)
    for i in range(n):
        size = nbytes[i % len(nbytes)]
        await ch.put({"src": comm.address, "i": i, "data": payload(i, size)}, timeout=30)
    if wait_to_exit:
        await ch.flush(timeout=30)
        ctl.emit("produced", n=n)
        await ctl.command("exit")
    return {"n": n}


async def consume(comm, ctl, name: str, nbytes: list[int]):
    """Get from channel ``name`` until it ends; every item as ``[src, i, intact]``."""
    ch = await comm.channel(name, timeout=30)
    ctl.emit("attached")
    got = []
    async with asyncio.timeout(60):
        async for item in ch:
            size = nbytes[item["i"] % len(nbytes)]
            got.append([item["src"], item["i"], intact(item["i"], item["data"], size)])
    return {"got": got}


# --------------------------------------------------------------------------- faults


async def ledger(comm, ctl, peer: str, period: float = 0.02, big_every: int = 25, big_size: int = 2 * MiB,
                 flowing_after: int = 20, finish_timeout: float = 4.0, send_timeout: float = 10.0):
    """Exchange numbered messages with ``peer`` (running the same) both ways until told
    ``finish``; then send an end marker and wait for the peer's, at most ``finish_timeout``
    seconds. Every ``big_every``-th message carries ``big_size`` bytes (the bulk path),
    the others are small. Emits ``flowing`` once ``flowing_after`` messages came in, and
    again that many messages after each ``mark`` command.

    Reports ``sent`` (``[seq, "ok" | error]`` per send call), ``received`` (seqs in
    arrival order, with a flag when the content was wrong), the errors each side saw
    (with their monotonic time), and whether the end markers went out and came in.
    """
    sent: list[list] = []
    received: list[int] = []
    corrupt: list[int] = []
    send_errors: list[list] = []
    recv_errors: list[list] = []
    state = {"end_sent": False, "end_received": False}
    stop = asyncio.Event()

    async def sender():
        seq = 0
        while not stop.is_set():
            big = seq % big_every == big_every - 1
            try:
                await comm.send({"seq": seq, "data": payload(seq, big_size) if big else None}, peer,
                                timeout=send_timeout)
                sent.append([seq, "ok"])
            except rlinf.RlinfError as exc:
                sent.append([seq, _error(exc)])
                send_errors.append([time.monotonic(), seq, _error(exc)])
                await asyncio.sleep(0.1)         # a lost peer fails each send at once
            seq += 1
            try:
                await asyncio.wait_for(stop.wait(), period)
            except TimeoutError:
                pass
        while True:                              # the end marker, until it goes or we are cancelled
            try:
                await comm.send({"end": seq}, peer, timeout=send_timeout)
                state["end_sent"] = True
                return
            except rlinf.RlinfError as exc:
                send_errors.append([time.monotonic(), "end", _error(exc)])
                await asyncio.sleep(0.2)

    async def receiver():
        while True:
            try:
                obj = await comm.recv(peer, timeout=300)
            except rlinf.CommTimeoutError:
                raise
            except rlinf.RlinfError as exc:
                recv_errors.append([time.monotonic(), _error(exc)])
                await asyncio.sleep(0.1)
                continue
            if "end" in obj:
                state["end_received"] = True
                return
            seq = obj["seq"]
            received.append(seq)
            if obj["data"] is not None and not intact(seq, obj["data"], big_size):
                corrupt.append(seq)
            if len(received) == mark["at"]:
                ctl.emit("flowing", received=len(received))

    mark = {"at": flowing_after}
    tasks = [asyncio.create_task(sender()), asyncio.create_task(receiver())]
    while (cmd := await ctl.next())["command"] != "finish":
        if cmd["command"] == "mark":     # "tell me when flowing_after more have come"
            mark["at"] = len(received) + flowing_after
    stop.set()
    finished = time.monotonic()
    done, pending = await asyncio.wait(tasks, timeout=finish_timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    crashed = [_error(t.exception()) for t in done if t.exception() is not None]
    ctl.emit("ledger", sent=sent, received=received, corrupt=corrupt, send_errors=send_errors,
             recv_errors=recv_errors, crashed=crashed, finished=finished, **state)
    return {}


async def hold(comm, ctl, peer: str):
    """Say hello to ``peer``, then wait to be killed (with the node, or alone)."""
    await comm.send("hello", peer, timeout=30)
    ctl.emit("holding")
    await ctl.command("never", timeout=600)
    return {}


async def watch(comm, ctl, peer: str):
    """Keep a receive from ``peer`` pending and report when and how it ends; then what
    a send to ``peer`` does."""
    assert await comm.recv(peer, timeout=30) == "hello"
    work = comm.async_recv(peer)
    ctl.emit("armed")
    report = {}
    try:
        await asyncio.wait_for(work, 30)
        report["recv"] = "returned a message"
    except (rlinf.RlinfError, TimeoutError) as exc:
        report["recv"] = _error(exc)
        report["recv_is_peer_lost"] = isinstance(exc, rlinf.PeerLostError)
    report["recv_failed_at"] = time.monotonic()
    try:
        await comm.send("anyone?", peer, timeout=5)
        report["send"] = "ok"
    except (rlinf.RlinfError, TimeoutError) as exc:
        report["send"] = _error(exc)
        report["send_is_peer_lost"] = isinstance(exc, rlinf.PeerLostError)
    report["send_failed_at"] = time.monotonic()
    return report


async def big_transfer(comm, ctl, peer: str, role: str, nbytes: int, timeout: float):
    """One ``nbytes`` message from the ``"send"`` side to the ``"recv"`` side, then a
    small one, all within ``timeout`` seconds; each side reports what its operations did
    and how long they took."""
    report = {}
    started = time.monotonic()
    for name, obj in (("big", {"data": payload(3, nbytes)}), ("small", "after")):
        t = time.monotonic()
        left = max(1.0, started + timeout - t)
        try:
            if role == "send":
                await comm.send(obj, peer, timeout=left)
                report[name] = "ok"
            else:
                got = await comm.recv(peer, timeout=left)
                report[name] = ("intact" if name == "small" and got == "after" or
                                name == "big" and intact(3, got["data"], nbytes) else "corrupt")
        except (rlinf.RlinfError, TimeoutError) as exc:
            report[name] = _error(exc)
            report[name + "_timed_out"] = isinstance(exc, TimeoutError)
        report[name + "_seconds"] = time.monotonic() - t
    ctl.emit("report", **report)
    await ctl.command("exit", timeout=120)
    return {}


# --------------------------------------------------------------------------- flow control


async def bulk_and_pings(comm, ctl, peer: str, nbytes: int, period: float = 0.02):
    """One ``nbytes`` message on tag 0, then a small one on tag 0 (which must arrive after
    it), while pinging ``peer`` on tag 1 every ``period`` seconds (echoed) until the
    large send completes. Reports each ping's round trip and whether it completed while
    the large message was still on its way."""
    async def sent(work) -> None:
        await work

    big = asyncio.ensure_future(sent(comm.async_send({"seq": 7, "data": payload(7, nbytes)}, peer, tag=0)))
    after = asyncio.ensure_future(sent(comm.async_send("after", peer, tag=0)))
    rtts, during = [], 0
    while not big.done():
        t = time.monotonic()
        await comm.send(len(rtts), peer, tag=1, timeout=30)
        back = await comm.recv(peer, tag=1, timeout=30)
        assert back == len(rtts), f"ping {len(rtts)}: got the echo of {back}"
        rtts.append(time.monotonic() - t)
        during += not big.done()
        await asyncio.wait([big], timeout=period)
    await asyncio.wait_for(big, 60)
    await asyncio.wait_for(after, 60)
    await comm.send("stop", peer, tag=1, timeout=30)
    await comm.recv(peer, tag=2, timeout=60)               # the receiver checked what it got
    return {"rtts": rtts, "during": during}


async def bulk_sink(comm, ctl, peer: str, nbytes: int):
    """The other end of ``bulk_and_pings``: echoes tag 1 until "stop"; checks that tag 0
    brings the large message intact, then the small one."""
    async def echo() -> int:
        n = 0
        while (got := await comm.recv(peer, tag=1, timeout=120)) != "stop":
            await comm.send(got, peer, tag=1, timeout=30)
            n += 1
        return n

    echoer = asyncio.ensure_future(echo())
    first = await comm.recv(peer, tag=0, timeout=120)
    second = await comm.recv(peer, tag=0, timeout=60)
    pings = await asyncio.wait_for(echoer, 120)
    await comm.send("checked", peer, tag=2, timeout=30)
    return {"big_first": isinstance(first, dict) and first["seq"] == 7 and intact(7, first["data"], nbytes),
            "after_second": second == "after", "echoed": pings}
