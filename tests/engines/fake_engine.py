"""A stand-in for one vLLM (or SGLang) engine's outside: per data-parallel rank a ZMQ PUB
socket sending [topic, seq (8 bytes big-endian), msgpack batch] and a ROUTER replay socket
(as vllm/distributed/kv_events.py's ZmqEventPublisher), plus /health and /metrics over HTTP.
Events are msgspec structs declared as the engines declare them (engine_wire.py).

Driven by JSON lines on stdin, each answered by one JSON line on stdout:
  {"store": {"rank": R, "tokens": [...], "parent": H|null}}  -> {"hashes": [...]}
      with "bad": HEX, the batch is [the first half of the blocks, the msgpack value HEX,
      the second half] (the good events around a bad one; needs 2 blocks or more)
  {"raw": {"rank": R, "hex": HEX}}    HEX as a batch's payload, with a sequence number
  {"remove": {"rank": R, "hashes": [...]}}
  {"drop": {"rank": R, "count": N}}   the next N batches of R use sequence numbers but are
                                      not sent (they stay in the replay buffer)
  {"restart": {"rank": R}}            sequence numbers start again at 0, buffer emptied
  {"health": true|false}
  {"load": {"rank": R, "running": x, "waiting": y, "usage": z}}
  {"cache": {"rank": R}}              -> {"hashes": [...]} the blocks R holds
  {"garbage": {"rank": R, "kind": "frames"|"seq"|"payload"}}  one malformed message: two
                                      frames, a 4-byte sequence number, or a payload that is
                                      not msgpack (this one takes a sequence number)
On start it prints {"ready": true}.
"""
import argparse
import collections
import itertools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import zmq

import engine_wire as w

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Rank:
    def __init__(self, ctx, rank, args):
        self.rank = rank
        self.pub = ctx.socket(zmq.PUB)
        # --zmq-connect: as vLLM's publisher does for a non-wildcard TCP endpoint, connect
        # to a subscriber that binds (kvrouter bridge --zmq-bind).
        publish_at = f"tcp://127.0.0.1:{args.zmq_port + rank}"
        replay_at = f"tcp://127.0.0.1:{args.replay_port + rank}"
        # --ipc-dir: socket files, as an engine in the bridge's pod binds them (rank 0 only:
        # the engines do not offset ipc:// endpoints).
        if args.ipc_dir:
            publish_at = f"ipc://{args.ipc_dir}/events"
            replay_at = f"ipc://{args.ipc_dir}/replay"
        if args.zmq_connect:
            self.pub.connect(publish_at)
        else:
            self.pub.bind(publish_at)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.bind(replay_at)
        self.topic = args.topic.encode()
        self.seq = itertools.count()
        self.buffer = collections.deque(maxlen=args.buffer_steps)
        self.drop = 0
        self.blocks = {}  # engine hash -> parent
        self.next_hash = (rank + 1) << 40
        self.lock = threading.Lock()

    def publish(self, events, wire):
        if wire == "array":
            batch = w.EventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        else:
            batch = w.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        payload = w.ENC.encode(batch)
        with self.lock:
            seq = next(self.seq)
            self.buffer.append((seq, payload))
            if self.drop > 0:
                self.drop -= 1
                return
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

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


class State:
    healthy = True
    loads = {}


def http_server(port, state, ranks):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/health":
                code, body = (200, b"") if state.healthy else (503, b"down")
            elif self.path == "/metrics":
                lines = []
                for r in ranks:
                    l = state.loads.get(r.rank, {})
                    lbl = f'{{engine="{r.rank}",model_name="m"}}'
                    lines.append(f"vllm:num_requests_running{lbl} {l.get('running', 0)}")
                    lines.append(f"vllm:num_requests_waiting{lbl} {l.get('waiting', 0)}")
                    lines.append(f"vllm:kv_cache_usage_perc{lbl} {l.get('usage', 0)}")
                code, body = 200, ("\n".join(lines) + "\n").encode()
            else:
                code, body = 404, b""
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zmq-port", type=int, required=True)
    ap.add_argument("--zmq-connect", action="store_true")
    ap.add_argument("--ipc-dir")
    ap.add_argument("--replay-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--topic", default="")
    ap.add_argument("--wire", choices=["map", "array"], default="map")
    ap.add_argument("--buffer-steps", type=int, default=10000)
    args = ap.parse_args()
    ctx = zmq.Context()
    ranks = [Rank(ctx, r, args) for r in range(args.dp_size)]
    for r in ranks:
        threading.Thread(target=r.serve_replay, daemon=True).start()
    state = State()
    http_server(args.http_port, state, ranks)
    stored_cls = w.ArrBlockStored if args.wire == "array" else w.BlockStored
    removed_cls = w.ArrBlockRemoved if args.wire == "array" else w.BlockRemoved
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out = {"ok": True}
        if "store" in cmd:
            c = cmd["store"]
            r = ranks[c["rank"]]
            toks = c["tokens"]
            n = len(toks) // args.block_size
            hashes = []
            for _ in range(n):
                r.next_hash += 1
                hashes.append(r.next_hash)
            parent = c.get("parent")
            for i, h in enumerate(hashes):
                r.blocks[h] = parent if i == 0 else hashes[i - 1]
            bs = args.block_size
            if c.get("bad") is None:
                evs = [stored_cls(hashes, parent, toks[: n * bs], bs, None, "GPU", None)]
            else:
                k = n // 2
                evs = [
                    stored_cls(hashes[:k], parent, toks[: k * bs], bs, None, "GPU", None),
                    msgspec.Raw(bytes.fromhex(c["bad"])),
                    stored_cls(hashes[k:], hashes[k - 1], toks[k * bs : n * bs], bs, None,
                               "GPU", None),
                ]
            r.publish(evs, args.wire)
            out = {"hashes": hashes}
        elif "remove" in cmd:
            c = cmd["remove"]
            r = ranks[c["rank"]]
            for h in c["hashes"]:
                r.blocks.pop(h, None)
            r.publish([removed_cls(c["hashes"], "GPU")], args.wire)
        elif "drop" in cmd:
            c = cmd["drop"]
            with ranks[c["rank"]].lock:
                ranks[c["rank"]].drop += c["count"]
        elif "restart" in cmd:
            r = ranks[cmd["restart"]["rank"]]
            with r.lock:
                r.seq = itertools.count()
                r.buffer.clear()
                r.blocks.clear()
        elif "health" in cmd:
            state.healthy = bool(cmd["health"])
        elif "load" in cmd:
            c = cmd["load"]
            state.loads[c["rank"]] = c
        elif "garbage" in cmd:
            c = cmd["garbage"]
            r = ranks[c["rank"]]
            with r.lock:
                if c["kind"] == "frames":
                    r.pub.send_multipart((r.topic, (0).to_bytes(8, "big")))
                elif c["kind"] == "seq":
                    r.pub.send_multipart((r.topic, b"\x00\x00\x00\x01", b"\x90"))
                else:
                    seq = next(r.seq)
                    bad = b"\xc1 not msgpack"
                    r.buffer.append((seq, bad))
                    r.pub.send_multipart((r.topic, seq.to_bytes(8, "big"), bad))
        elif "raw" in cmd:
            c = cmd["raw"]
            r = ranks[c["rank"]]
            payload = bytes.fromhex(c["hex"])
            with r.lock:
                seq = next(r.seq)
                r.buffer.append((seq, payload))
                r.pub.send_multipart((r.topic, seq.to_bytes(8, "big"), payload))
        elif "cache" in cmd:
            out = {"hashes": sorted(ranks[cmd["cache"]["rank"]].blocks)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
