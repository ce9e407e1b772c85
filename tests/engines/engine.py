"""One engine's outside, for the tests: per data-parallel rank the KV event publisher the
engine itself runs (its own classes, from its wheel: engines.py), and /health and /metrics over
HTTP as its server answers them. `--engine standin` publishes with fake_engine.py's stand-in
instead: only for what the real classes cannot send (malformed frames and payloads).

Driven by JSON lines on stdin, each answered by one JSON line on stdout ({"error": ...} for
what this engine release cannot express):
  {"store": {"rank": R, "tokens": [...], "parent": H|null, "lora": NAME, "salt": S,
             "mm": [[ID, OFFSET]|null, ...], "lookahead": [[...], ...], "medium": M}}
      -> {"hashes": [...]}
      as the engine reports a run of full blocks it cached; vLLM puts the LoRA name in every
      block's extra keys and the salt in the request's first block's, SGLang (0.5.23) names
      both on every run; hashes are ints, or hex strings for vLLM with --hash bytes
  {"remove": {"rank": R, "hashes": [...], "medium": M}}
  {"clear": {"rank": R}}              AllBlocksCleared
  {"offload": {"rank": R, "hashes": [...], "medium": "CPU"|"STORAGE", "removed": bool,
               "self_describing": bool}}
      vLLM's offloading connector reports these blocks stored in (removed from) its tier:
      its own OffloadingEventsTracker turns the manager's event into what it publishes
      (placeholders by default; full payloads when self-describing)
  {"drop": {"rank": R, "count": N}}   the next N batches of R are lost on the wire (they stay
                                      in the publisher's replay buffer)
  {"restart": {"rank": R}}            a new publisher: sequence numbers from 0, buffer empty
  {"health": true|false}
  {"load": {"rank": R, "running": x, "waiting": y, "usage": z}}
  {"cache": {"rank": R}}              -> {"blocks": [[hash, parent], ...]} R's device blocks
  stand-in only: {"raw": {"rank": R, "hex": HEX}}, {"garbage": {"rank": R, "kind": K}} and
  "bad" in "store" (see fake_engine.py)
On start it prints {"ready": true}, or {"ready": false, "error": ...} when the engine refused
its configuration (as vLLM does for an ipc:// endpoint past rank 0).
"""
import argparse
import hashlib
import importlib
import json
import os
import sys
import threading
import time
import types

import zmq
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


class Refused(Exception):
    """What this engine release cannot express."""


class DroppingSocket:
    """The publisher's PUB socket, losing the next `drop` messages (as a full high-water mark
    or a broken connection does). Everything else goes to the real socket."""

    def __init__(self, sock):
        self._sock = sock
        self.drop = 0
        self._lock = threading.Lock()

    def send_multipart(self, frames, *a, **kw):
        with self._lock:
            if self.drop > 0:
                self.drop -= 1
                return None
        return self._sock.send_multipart(frames, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class RealRank:
    """One rank's publisher, as the engine's scheduler creates and feeds it."""

    def __init__(self, engine, kv, off, rank, endpoint, replay, args):
        self.engine, self.kv, self.off, self.rank = engine, kv, off, rank
        self.endpoint, self.replay_endpoint, self.args = endpoint, replay, args
        self.vllm = engine.startswith("vllm")
        self.blocks = {}  # the rank's device blocks: JSON hash -> parent
        self.external = {}  # JSON hash -> (the hash as published, its 32-byte digest)
        self.run_of = {}  # JSON hash -> (parent JSON hash, the block's tokens)
        # vLLM's offloading connector's event translation, by default (placeholders) and
        # with kv_connector_extra_config["self_describing_kv_events"].
        self.trackers = {}
        if self.vllm:
            self.config = importlib.import_module("vllm.config.kv_events")
            self.hash_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        if off is not None:
            base = importlib.import_module("vllm.v1.kv_offload.base")
            self.offload_base = base
            self.request = importlib.import_module("vllm.v1.request")
            self.trackers = {
                sd: off.OffloadingEventsTracker(base.OffloadingKVEventsConfig(True, sd))
                for sd in (False, True)
            }
        self.start()

    def start(self, retry_secs=0.0):
        # After a shutdown the old sockets' ports are freed by ZMQ's I/O thread, a moment
        # later: a restarted engine retries its bind as a new process would be restarted.
        deadline = time.monotonic() + retry_secs
        while True:
            try:
                return self.create()
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def create(self):
        a = self.args
        if self.vllm:
            cfg = self.config.KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint,
                replay_endpoint=self.replay_endpoint, buffer_steps=a.buffer_steps,
                topic=a.topic)
            self.pub = self.kv.EventPublisherFactory.create(cfg, data_parallel_rank=self.rank)
        else:
            cfg = json.dumps({"publisher": "zmq", "endpoint": self.endpoint,
                              "replay_endpoint": self.replay_endpoint,
                              "buffer_steps": a.buffer_steps, "topic": a.topic})
            self.pub = self.kv.EventPublisherFactory.create(cfg, attn_dp_rank=self.rank)
        self.pub._pub = self.sock = DroppingSocket(self.pub._pub)

    def publish(self, events):
        # As the schedulers do: the publisher fills in the rank.
        self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=events))

    def drop(self, n):
        with self.sock._lock:
            self.sock.drop += n

    def restart(self):
        self.pub.shutdown()
        self.blocks.clear()
        for t in self.trackers.values():
            t.reset()
        self.start(retry_secs=5.0)

    def hashes_for(self, parent, tokens, extras, n):
        """The run's block hashes: chained digests (as the engines chain them), published as
        the engine publishes them."""
        prev = self.external[parent][1] if parent is not None else b"root"
        out = []
        bs = self.args.block_size
        for i in range(n):
            prev = hashlib.sha256(
                prev + json.dumps([tokens[i * bs:(i + 1) * bs], extras]).encode()).digest()
            if self.vllm:
                published = self.hash_utils.maybe_convert_block_hash(prev)
            else:
                published = int.from_bytes(prev[:8], "big", signed=True)
            key = published.hex() if isinstance(published, bytes) else published
            self.external[key] = (published, prev)
            out.append(key)
        return out

    def store(self, c):
        kv, bs = self.kv, self.args.block_size
        tokens, parent = c["tokens"], c.get("parent")
        lora, salt, lookahead = c.get("lora"), c.get("salt"), c.get("lookahead")
        mm = c.get("mm")  # per block: [identifier, offset] of the image it overlaps, or None
        medium = c.get("medium", "GPU")
        n = len(tokens) // bs
        fields = kv.BlockStored.__struct_fields__
        if (salt and not self.vllm and "cache_salt" not in fields) or (
                lora and "lora_name" not in fields) or (
                lookahead and "lookahead_token_ids" not in fields) or (mm and not self.vllm):
            raise Refused(f"{self.engine} publishes no such field")
        hashes = self.hashes_for(parent, tokens, [lora, salt, lookahead, mm], n)
        for i, h in enumerate(hashes):
            self.blocks[h] = parent if i == 0 else hashes[i - 1]
            self.run_of[h] = (self.blocks[h], tokens[i * bs:(i + 1) * bs])
        ext = [self.external[h][0] for h in hashes]
        par = self.external[parent][0] if parent is not None else None
        toks = tokens[: n * bs]
        if self.vllm:
            extra = []
            for i in range(n):
                # vLLM's order: the LoRA name, (mm identifier, offset) pairs, the salt.
                keys = ((lora,) if lora else ()) + (
                    tuple(mm[i]) if mm and mm[i] else ()) + (
                    (salt,) if salt and parent is None and i == 0 else ())
                extra.append(keys or None)
            kw = {"extra_keys": extra if any(extra) else None, "group_idx": 0,
                  "kv_cache_spec_kind": "full_attention"}
            if lookahead is not None:
                kw["lookahead_token_ids"] = lookahead
            ev = kv.BlockStored(block_hashes=ext, parent_block_hash=par, token_ids=toks,
                                block_size=bs, lora_id=1 if lora else None, medium=medium,
                                lora_name=lora, **kw)
        elif "medium" in fields:
            ev = kv.BlockStored(block_hashes=ext, parent_block_hash=par, token_ids=toks,
                                block_size=bs, lora_id=None, medium=medium, cache_salt=salt,
                                lora_name=lora)
        else:
            ev = kv.BlockStored(block_hashes=ext, parent_block_hash=par, token_ids=toks,
                                block_size=bs, lora_id=None)
        self.publish([ev])
        return hashes

    def removed(self, hashes, medium):
        ext = [self.external[h][0] for h in hashes]
        if "medium" in self.kv.BlockRemoved.__struct_fields__:
            return self.kv.BlockRemoved(block_hashes=ext, medium=medium)
        return self.kv.BlockRemoved(block_hashes=ext)

    def remove(self, c):
        for h in c["hashes"]:
            self.blocks.pop(h, None)
        self.publish([self.removed(c["hashes"], c.get("medium", "GPU"))])

    def clear(self):
        self.blocks.clear()
        self.publish([self.kv.AllBlocksCleared()])

    def offload(self, c):
        if not self.trackers:
            raise Refused(f"{self.engine} has no offloading connector events")
        base = self.offload_base
        removed, sd = c.get("removed", False), c.get("self_describing", False)
        tracker = self.trackers[sd]
        keys = [base.make_offload_key(self.external[h][1], 0) for h in c["hashes"]]
        if sd and not removed:
            # The connector's scheduler snapshots each chunk (one block a chunk here) while
            # its request is alive: the request's hashes and tokens up to that block.
            for h, key in zip(c["hashes"], keys):
                chain = []
                while h is not None:
                    chain.append(h)
                    h = self.run_of[h][0]
                chain.reverse()
                req = self.request.Request(
                    block_hashes=[self.external[x][1] for x in chain],
                    all_token_ids=[t for x in chain for t in self.run_of[x][1]])
                group = types.SimpleNamespace(
                    group_idx=0, tokens_per_block=self.args.block_size,
                    tokens_per_chunk=self.args.block_size, hashes_per_chunk=1,
                    kv_event_group_spec=self.off.OffloadingEventGroupSpec("full_attention", None),
                    sliding_window_size_in_chunks=None)
                tracker.record_store(req, group, len(chain) - 1, key)
        # 0.33's manager names the tier with its Medium enum, 0.26's with the medium's name.
        medium = c["medium"]
        if hasattr(self.off, "_MEDIUM_TO_EVENT_STR"):
            medium = base.Medium(medium)
        event = base.OffloadingEvent(keys=keys, medium=medium, removed=removed)
        if hasattr(event, "removal_expected"):
            event.removal_expected = not removed
        self.publish(list(tracker.take_events([event])))


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


class State:
    healthy = True
    loads = {}


def endpoints(args):
    """Rank 0's endpoints: the engines offset them per rank themselves."""
    if args.ipc_dir:
        return f"ipc://{args.ipc_dir}/events", f"ipc://{args.ipc_dir}/replay"
    # vLLM and SGLang bind `*` and connect to a named host (what --zmq-connect asks).
    host = "127.0.0.1" if args.zmq_connect else "*"
    return f"tcp://{host}:{args.zmq_port}", f"tcp://*:{args.replay_port}"


def make_ranks(args):
    if args.engine == "standin":
        import fake_engine
        return [fake_engine.Rank(r, args) for r in range(args.dp_size)]
    import engines
    kv, off = engines.load(args.engine)
    endpoint, replay = endpoints(args)
    return [RealRank(args.engine, kv, off, r, endpoint, replay, args)
            for r in range(args.dp_size)]


def serve(ranks, state):
    for line in sys.stdin:
        cmd = json.loads(line)
        (name, c), = cmd.items()
        r = ranks[c["rank"]] if isinstance(c, dict) and "rank" in c else None
        out = {"ok": True}
        try:
            if name == "store":
                out = {"hashes": r.store(c)}
            elif name == "remove":
                r.remove(c)
            elif name == "clear":
                r.clear()
            elif name == "offload":
                r.offload(c)
            elif name == "drop":
                r.drop(c["count"])
            elif name == "restart":
                r.restart()
            elif name == "health":
                state.healthy = bool(c)
            elif name == "load":
                state.loads[c["rank"]] = c
            elif name == "cache":
                out = {"blocks": [[h, p] for h, p in r.blocks.items()]}
            elif name in ("raw", "garbage") and hasattr(r, name):
                getattr(r, name)(c)
            else:
                raise Refused(f"no command {name} for this engine")
        except Refused as e:
            out = {"error": str(e)}
        print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True,
                    help="a pinned release (engines.py: vllm-0.33.0, sglang-0.5.23, ...) "
                         "or standin")
    ap.add_argument("--zmq-port", type=int, required=True)
    ap.add_argument("--zmq-connect", action="store_true")
    ap.add_argument("--ipc-dir")
    ap.add_argument("--replay-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--topic", default="")
    ap.add_argument("--hash", choices=["int", "bytes"], default="int",
                    help="vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    ap.add_argument("--buffer-steps", type=int, default=10000)
    args = ap.parse_args()
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if args.hash == "int" else "0"
    try:
        ranks = make_ranks(args)
    except ValueError as e:
        print(json.dumps({"ready": False, "error": str(e)}), flush=True)
        return
    state = State()
    http_server(args.http_port, state, ranks)
    print(json.dumps({"ready": True}), flush=True)
    serve(ranks, state)


if __name__ == "__main__":
    main()
