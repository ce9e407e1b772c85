"""A stand-in publisher for what the engines' own classes cannot send: malformed frames and
payloads (engine.py --engine standin drives it). Per rank a ZMQ PUB socket sending [topic,
seq (8 bytes big-endian), msgpack batch] and a ROUTER replay socket, with events in vLLM's
array_like form (v0.11-v0.23, declared in engine_wire.py: no pinned release sends it).
Everything an engine can send is tested with the engine's own publisher instead.

Its commands beyond engine.py's:
  "bad": HEX in "store"               the batch is [the first half of the blocks, the msgpack
                                      value HEX, the second half] (needs 2 blocks or more)
  {"raw": {"rank": R, "hex": HEX}}    HEX as a batch's payload, with a sequence number
  {"garbage": {"rank": R, "kind": "frames"|"seq"|"payload"}}  one malformed message: two
                                      frames, a 4-byte sequence number, or a payload that is
                                      not msgpack (this one takes a sequence number)
"""
import collections
import itertools
import threading
import time

import msgspec
import zmq

import engine_wire as w

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Rank:
    def __init__(self, rank, args):
        ctx = zmq.Context.instance()
        self.rank = rank
        self.args = args
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{args.zmq_port + rank}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.bind(f"tcp://127.0.0.1:{args.replay_port + rank}")
        self.topic = args.topic.encode()
        self.seq = itertools.count()
        self.buffer = collections.deque(maxlen=args.buffer_steps)
        self.dropping = 0
        self.blocks = {}  # engine hash -> parent
        self.next_hash = (rank + 1) << 40
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_replay, daemon=True).start()

    def send(self, payload):
        with self.lock:
            seq = next(self.seq)
            self.buffer.append((seq, payload))
            if self.dropping > 0:
                self.dropping -= 1
                return
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def publish(self, events):
        batch = w.EventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        self.send(w.ENC.encode(batch))

    def serve_replay(self):
        while True:
            try:
                frame = self.replay.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frame) != 3:
                continue
            client_id, _, start = frame
            start = int.from_bytes(start, "big")
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in items:
                self.replay.send_multipart((client_id, b"", s.to_bytes(8, "big"), p))
            self.replay.send_multipart((client_id, b"", END_SEQ, b""))

    def store(self, c):
        stored = w.ArrBlockStored
        bs = self.args.block_size
        toks = c["tokens"]
        n = len(toks) // bs
        hashes = []
        for _ in range(n):
            self.next_hash += 1
            hashes.append(self.next_hash)
        parent = c.get("parent")
        for i, h in enumerate(hashes):
            self.blocks[h] = parent if i == 0 else hashes[i - 1]
        if c.get("bad") is None:
            evs = [stored(hashes, parent, toks[: n * bs], bs, None, "GPU", None)]
        else:
            k = n // 2
            evs = [
                stored(hashes[:k], parent, toks[: k * bs], bs, None, "GPU", None),
                msgspec.Raw(bytes.fromhex(c["bad"])),
                stored(hashes[k:], hashes[k - 1], toks[k * bs : n * bs], bs, None, "GPU", None),
            ]
        self.publish(evs)
        return hashes

    def remove(self, c):
        removed = w.ArrBlockRemoved
        for h in c["hashes"]:
            self.blocks.pop(h, None)
        self.publish([removed(c["hashes"], "GPU")])

    def clear(self):
        self.blocks.clear()
        self.publish([w.ArrAllBlocksCleared()])

    def drop(self, n):
        with self.lock:
            self.dropping += n

    def restart(self):
        with self.lock:
            self.seq = itertools.count()
            self.buffer.clear()
            self.blocks.clear()

    def raw(self, c):
        self.send(bytes.fromhex(c["hex"]))

    def garbage(self, c):
        with self.lock:
            if c["kind"] == "frames":
                self.pub.send_multipart((self.topic, (0).to_bytes(8, "big")))
            elif c["kind"] == "seq":
                self.pub.send_multipart((self.topic, b"\x00\x00\x00\x01", b"\x90"))
            else:
                seq = next(self.seq)
                bad = b"\xc1 not msgpack"
                self.buffer.append((seq, bad))
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), bad))
