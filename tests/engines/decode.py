"""Reads a KV event stream with a pinned release's own classes (engines.py), as that
release's consumers would: each [topic, seq, payload] message decoded strictly into the
release's KVEventBatch (msgspec validates every field's type). The tests point it at
`kvrouter mocker --emulate` so the emulation cannot drift from the engines.

  python3 decode.py --engine RELEASE --endpoint tcp://127.0.0.1:PORT

Prints {"ready": true} once subscribed, then one JSON line per message: {"seq", "rank",
"events": [{"type", "hashes", "parent", "tokens", "block_size", "medium"}]}, or {"error":
...} for a message the release's classes refuse.
"""
import argparse
import json
import os
import sys
import time

import msgspec
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engines  # noqa: E402


def summary(ev):
    out = {"type": type(ev).__name__}
    for field, key in [("block_hashes", "hashes"), ("parent_block_hash", "parent"),
                       ("block_size", "block_size"), ("medium", "medium")]:
        if hasattr(ev, field):
            v = getattr(ev, field)
            out[key] = [h.hex() if isinstance(h, bytes) else h for h in v] if isinstance(
                v, list) else v
    if hasattr(ev, "token_ids"):
        out["tokens"] = len(ev.token_ids)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--endpoint", required=True)
    args = ap.parse_args()
    kv, _ = engines.load(args.engine)
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(args.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # the subscription reaches the publisher
    print(json.dumps({"ready": True}), flush=True)
    while True:
        frames = sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            print(json.dumps({"error": f"{len(frames)} frames"}), flush=True)
            continue
        try:
            batch = decoder.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            print(json.dumps({"error": str(e), "payload": frames[2].hex()}), flush=True)
            continue
        rank = getattr(batch, "data_parallel_rank", getattr(batch, "attn_dp_rank", None))
        print(json.dumps({"seq": int.from_bytes(frames[1], "big"), "rank": rank,
                          "events": [summary(e) for e in batch.events]}), flush=True)


if __name__ == "__main__":
    main()
