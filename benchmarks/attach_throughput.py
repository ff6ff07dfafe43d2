"""Can the attach mirror keep up with a busy vLLM server? Block events per second, loopback.

A publisher process sends vLLM-format batches (map encoding, uint64 hashes; each batch stores a
chain of 16 blocks with 16-token ids and removes 16 older ones) as fast as it can on a PUB
socket; kvscope's Attachment receives, decodes and applies them to its Mirror. Reported, as
medians over repeats, in block events (one stored or removed hash) per second:
  - recv only: the same messages received on a bare SUB socket (the transport's ceiling);
  - decode + apply: the same payloads decoded and applied in memory, no sockets;
  - attach: the whole path, loopback. Target: at least 50,000 block events/s.

Run: .venv/bin/python benchmarks/attach_throughput.py [--batches 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import msgspec
import zmq

from kvscope.sessions.kv_events import Attachment, Mirror, decode_batch

CHAIN, BLOCK = 16, 16
TARGET = 50_000


def payloads(n: int) -> list[bytes]:
    out, parent, seq_hash = [], None, 1 << 63  # hashes above 2**63, as vLLM's uint64 ones
    for i in range(n):
        hashes = [seq_hash + i * CHAIN + j for j in range(CHAIN)]
        events = [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                   "token_ids": list(range(CHAIN * BLOCK)), "block_size": BLOCK,
                   "lora_id": None, "medium": "GPU", "lora_name": None}]
        if i >= 4:  # evict the chain stored four batches ago
            events.append({"type": "BlockRemoved", "block_hashes":
                           [seq_hash + (i - 4) * CHAIN + j for j in range(CHAIN)],
                           "medium": "GPU"})
        parent = hashes[-1]
        out.append(msgspec.msgpack.encode({"ts": time.time(), "events": events,
                                           "data_parallel_rank": 0}))
    return out


def block_events(n: int) -> int:
    return n * CHAIN + max(0, n - 4) * CHAIN


def publish(endpoint: str, n: int, ready) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(endpoint)
    msgs = payloads(n)
    ready.set()
    pub.recv()  # the subscriber joined
    for seq, payload in enumerate(msgs):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    time.sleep(1.0)
    pub.close(linger=2000)
    ctx.term()


def over_loopback(n: int, port: int, bare: bool) -> float:
    endpoint = f"tcp://127.0.0.1:{port}"
    ready = mp.Event()
    proc = mp.Process(target=publish, args=(f"tcp://127.0.0.1:{port}", n, ready))
    proc.start()
    ready.wait(30)
    if bare:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        start = time.perf_counter()
        for _ in range(n):
            sub.recv_multipart()
        elapsed = time.perf_counter() - start
        sub.close()
        ctx.term()
    else:
        att = Attachment(endpoint)
        deadline = time.monotonic() + 120
        start = time.perf_counter()
        while att.last < n - 1 and time.monotonic() < deadline:
            att.poll(10)
        elapsed = time.perf_counter() - start
        h = att.health
        assert att.last == n - 1 and h.gaps == 0 and h.bad_messages == 0, h
        assert att.mirror.num_resident == 4 * CHAIN, att.mirror.num_resident
        att.close()
    proc.join(30)
    return block_events(n) / elapsed  # from subscribing (a millisecond) to the last message


def in_memory(n: int) -> float:
    msgs, mirror = payloads(n), Mirror()
    start = time.perf_counter()
    for p in msgs:
        mirror.apply(decode_batch(p))
    return block_events(n) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n, port = args.batches, 47_557
    rows = {"recv only (transport ceiling)": [], "decode + apply (no sockets)": [],
            "attach over loopback": []}
    for r in range(args.repeats):
        rows["recv only (transport ceiling)"].append(over_loopback(n, port + 2 * r, True))
        rows["decode + apply (no sockets)"].append(in_memory(n))
        rows["attach over loopback"].append(over_loopback(n, port + 2 * r + 1, False))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{n} batches, {block_events(n)} block events, medians of {args.repeats} runs")
    base = med["recv only (transport ceiling)"]
    for k, v in med.items():
        print(f"  {k:32s} {v:12,.0f} block events/s  ({v / base:.2f} x recv only)")
    attach = med["attach over loopback"]
    print(f"attach keeps up with {attach:,.0f} block events/s: "
          f"{'meets' if attach >= TARGET else 'BELOW'} the {TARGET:,} target "
          f"({attach / TARGET:.1f} x)")


if __name__ == "__main__":
    main()
