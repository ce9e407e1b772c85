#!/usr/bin/env python3
"""The official `openai` SDK against `kvrouter frontend`, for the end-to-end tests.

  openai_client.py SCENARIO BASE_URL MODEL [ARGS...]

Each scenario prints one JSON object on stdout; the Rust test asserts on it. Token-id prompts
make the cached blocks predictable (the emulated engine has no vocabulary).
"""
import json
import sys
import threading
import time
import urllib.request

import openai


def client(base_url, retries=0, api_key="none"):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=retries,
                         timeout=30)


def routed(headers):
    return {
        "worker": headers.get("x-kvrouter-worker"),
        "overlap": int(headers.get("x-kvrouter-overlap-blocks", "-1")),
        "replica": headers.get("x-kvrouter-replica"),
        "request_id": headers.get("x-request-id"),
    }


def tokens(seed, n):
    return [seed * 100000 + i for i in range(n)]


def basic(c, model):
    out = {}
    raw = c.completions.with_raw_response.create(model=model, prompt=tokens(1, 64), max_tokens=4)
    r = raw.parse()
    out["completion"] = {"text": r.choices[0].text, "finish": r.choices[0].finish_reason,
                         "usage": r.usage.total_tokens if r.usage else None, **routed(raw.headers)}
    raw = c.completions.with_raw_response.create(model=model, prompt=tokens(2, 64), max_tokens=4,
                                                 stream=True)
    text, chunks = "", 0
    for ch in raw.parse():
        chunks += 1
        if ch.choices:
            text += ch.choices[0].text
    out["completion_stream"] = {"text": text, "chunks": chunks, **routed(raw.headers)}
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Say hello to the router."}],
        max_tokens=3)
    r = raw.parse()
    out["chat"] = {"role": r.choices[0].message.role, "content": r.choices[0].message.content,
                   "object": r.object, **routed(raw.headers)}
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Stream a greeting."}], max_tokens=3,
        stream=True, stream_options={"include_usage": True})
    content, roles, usage = "", [], None
    for ch in raw.parse():
        if ch.usage:
            usage = ch.usage.total_tokens
        for choice in ch.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            content += choice.delta.content or ""
    out["chat_stream"] = {"content": content, "roles": roles, "usage": usage, **routed(raw.headers)}
    try:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        out["unknown_model"] = None
    except openai.NotFoundError as e:
        out["unknown_model"] = e.status_code
    try:
        c.completions.create(model=model, prompt=tokens(3, 100000), max_tokens=1)
        out["too_long"] = None
    except openai.BadRequestError as e:
        out["too_long"] = {"status": e.status_code, "code": e.code, "param": e.param}
    return out


def prefix(c, model, rounds):
    """The same conversation growing: each prompt extends the previous one by 4 blocks."""
    base = tokens(7, 16 * 4 * (rounds + 1))
    out = []
    for i in range(rounds):
        raw = c.completions.with_raw_response.create(model=model, prompt=base[: 16 * 4 * (i + 1)],
                                                     max_tokens=2)
        raw.parse()
        out.append(routed(raw.headers))
        time.sleep(0.2)  # the engine's KV events reach the replicas
    return {"rounds": out}


def prefix_cached(c, model, rounds):
    """`prefix`, reading what the engine had cached of each prompt (for callers that get no
    x-kvrouter-* headers, as behind a gateway)."""
    base = tokens(7, 16 * 4 * (rounds + 1))
    out = []
    for i in range(rounds):
        r = c.completions.create(model=model, prompt=base[: 16 * 4 * (i + 1)], max_tokens=2)
        out.append({"cached": cached(r)})
        time.sleep(0.2)  # the engine's KV events reach the replicas
    return {"rounds": out}


def subset(c, model, endpoints, n):
    """n requests (4 blocks each, distinct) with the gateway's subset hint set to endpoints
    (the test's Envoy turns the x-test-subset header into it)."""
    out = {"ok": 0, "statuses": []}
    for i in range(n):
        try:
            c.completions.create(model=model, prompt=tokens(40 + i, 64), max_tokens=1,
                                 extra_headers={"x-test-subset": endpoints})
            out["ok"] += 1
        except openai.APIStatusError as e:
            out["statuses"].append(e.status_code)
    return out


def conversation(c, model, endpoints, rounds, hold_secs):
    """A conversation of rounds growing by 4 blocks each (its own tokens), with the gateway's
    subset hint set to endpoints ("-": none); the last round streams a long answer, read
    for hold_secs seconds, when hold_secs > 0."""
    base = tokens(11, 16 * 4 * (rounds + 1))
    headers = {} if endpoints == "-" else {"x-test-subset": endpoints}
    out = {"ok": 0, "errors": [], "cached": []}
    for i in range(rounds):
        prompt = base[: 16 * 4 * (i + 1)]
        try:
            if i + 1 == rounds and hold_secs > 0:
                stream = c.completions.create(model=model, prompt=prompt, max_tokens=7000,
                                              stream=True, extra_headers=headers)
                got, end = 0, time.time() + hold_secs
                for _ in stream:
                    got += 1
                    if time.time() > end:
                        break
                out["held_chunks"] = got
            else:
                r = c.completions.create(model=model, prompt=prompt, max_tokens=2,
                                         extra_headers=headers)
                out["cached"].append(cached(r))
            out["ok"] += 1
        except openai.APIError as e:
            out["errors"].append(str(e))
        time.sleep(0.2)  # the engine's KV events reach the replicas
    return out


def status(c, model, n=64):
    """One completion of an n-token prompt: its HTTP status (200, or the error's)."""
    try:
        c.completions.create(model=model, prompt=tokens(12, n), max_tokens=1)
        return {"status": 200}
    except openai.APIStatusError as e:
        return {"status": e.status_code, "error": str(e)}
    except openai.APIConnectionError as e:
        return {"status": 0, "error": str(e)}


def hold(c, model, secs):
    """Reads a long answer for up to secs seconds (or until the stream ends or breaks)."""
    stream = c.completions.create(model=model, prompt=tokens(9, 64), max_tokens=7000,
                                  stream=True)
    got, end = 0, time.time() + secs
    try:
        for _ in stream:
            got += 1
            if time.time() > end:
                break
    except openai.APIError as e:
        return {"chunks": got, "error": str(e)}
    return {"chunks": got}


def disconnect(c, model):
    """Reads a few chunks of a long answer, then hangs up."""
    raw = c.completions.with_raw_response.create(model=model, prompt=tokens(9, 64),
                                                 max_tokens=7000, stream=True)
    stream = raw.parse()
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    return {"chunks": got, **routed(raw.headers)}


def many(c, model, n, seed):
    """n requests sharing a cached prefix (seed), one after another; failures are counted."""
    out = {"ok": 0, "failed": [], "workers": []}
    for i in range(n):
        try:
            raw = c.completions.with_raw_response.create(
                model=model, prompt=tokens(seed, 64) + [i], max_tokens=2)
            raw.parse()
            out["ok"] += 1
            out["workers"].append(raw.headers.get("x-kvrouter-worker"))
        except openai.APIError as e:
            out["failed"].append(str(e))
    return out


def overload(c, model, held):
    """Holds `held` long streams open, then asks once more."""
    ready = threading.Barrier(held + 1)
    stop = threading.Event()
    streams = []

    def hold(i):
        s = c.completions.create(model=model, prompt=tokens(20 + i, 32), max_tokens=7000,
                                 stream=True)
        streams.append(s)
        it = iter(s)
        next(it)
        ready.wait()
        stop.wait(30)
        s.close()

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(held)]
    for t in threads:
        t.start()
    ready.wait(30)
    out = {}
    try:
        c.completions.create(model=model, prompt=tokens(40, 32), max_tokens=1)
        out["status"] = 200
    except openai.APIStatusError as e:
        out["status"] = e.status_code
        out["retry_after"] = e.response.headers.get("retry-after")
        out["type"] = e.body.get("type") if isinstance(e.body, dict) else None
    stop.set()
    for t in threads:
        t.join()
    return out


def refused(call):
    """The status, code and param of a call the frontend should refuse, or 200."""
    try:
        call()
        return {"status": 200}
    except openai.APIStatusError as e:
        return {"status": e.status_code, "code": e.code, "param": e.param,
                "type": e.body.get("type") if isinstance(e.body, dict) else None,
                "message": e.message}


def cached(r):
    """usage.prompt_tokens_details.cached_tokens, or None when the answer has none."""
    details = r.usage.prompt_tokens_details if r.usage else None
    return details.cached_tokens if details else None


def auth(base_url, model, operator_key, tenant_key, pin):
    """What a caller may do with each key: none, a wrong one, a tenant's (no grants) and the
    operator's (routing-extension and overlap-header granted)."""
    out = {}
    wrong = client(base_url, api_key="sk-wrong-0123456789abcdef")
    out["wrong_key"] = refused(lambda: wrong.completions.create(model=model, prompt=tokens(50, 32),
                                                                 max_tokens=1))
    out["wrong_key_models"] = refused(lambda: wrong.models.list())
    operator = client(base_url, api_key=operator_key)
    raw = operator.completions.with_raw_response.create(
        model=model, prompt=tokens(51, 64), max_tokens=2,
        extra_body={"kvrouter": {"pin": f"{pin}:0", "priority_jump": 1}})
    out["operator_pinned"] = {**routed(raw.headers), "cached": cached(raw.parse()),
                              "x_kvrouter": sorted(k for k in raw.headers.keys()
                                                   if k.lower().startswith("x-kvrouter-"))}
    tenant = client(base_url, api_key=tenant_key)
    out["tenant_extension"] = refused(lambda: tenant.completions.create(
        model=model, prompt=tokens(52, 64), max_tokens=2,
        extra_body={"kvrouter": {"pin": f"{pin}:0"}}))
    raw = tenant.completions.with_raw_response.create(model=model, prompt=tokens(51, 64),
                                                      max_tokens=2)
    out["tenant_plain"] = {**routed(raw.headers), "cached": cached(raw.parse()),
                           "x_kvrouter": sorted(k for k in raw.headers.keys()
                                                if k.lower().startswith("x-kvrouter-"))}
    raw = tenant.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True)
    for _ in raw.parse():
        pass
    out["tenant_chat_stream"] = {"x_kvrouter": sorted(
        k for k in raw.headers.keys() if k.lower().startswith("x-kvrouter-"))}
    out["tenant_models"] = [m.id for m in tenant.models.list()]
    return out


def inflight(base_url):
    """The frontend's kvrouter_frontend_inflight_requests."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvrouter_frontend_inflight_requests "):
                return int(float(line.split()[1]))
    return None


def same_id(base_url, c, model, request_id, max_tokens):
    """Two streams with one x-request-id, both in flight at once, each read to its end."""
    streams, out = [], []
    for i in range(2):
        raw = c.completions.with_raw_response.create(
            model=model, prompt=tokens(60 + i, 64), max_tokens=max_tokens, stream=True,
            extra_headers={"x-request-id": request_id})
        it = iter(raw.parse())
        first = next(it)  # this one is being answered: its route is booked
        streams.append((raw, it, first.choices[0].text if first.choices else ""))
    both = inflight(base_url)
    for raw, it, text in streams:
        for ch in it:
            if ch.choices:
                text += ch.choices[0].text
        out.append({"text": text, "request_id": raw.headers.get("x-request-id")})
    return {"answers": out, "inflight_together": both}


def main(argv):
    scenario, base_url, model = argv[1], argv[2], argv[3]
    if scenario == "auth":
        print(json.dumps(auth(base_url, model, argv[4], argv[5], int(argv[6]))))
        return
    if scenario == "same_id":
        c = client(base_url, api_key=argv[4])
        print(json.dumps(same_id(base_url, c, model, argv[5], int(argv[6]))))
        return
    c = client(base_url)
    if scenario == "basic":
        out = basic(c, model)
    elif scenario == "prefix":
        out = prefix(c, model, int(argv[4]))
    elif scenario == "hold":
        out = hold(c, model, float(argv[4]))
    elif scenario == "subset":
        out = subset(c, model, argv[4], int(argv[5]))
    elif scenario == "status":
        out = status(c, model, *(int(a) for a in argv[4:5]))
    elif scenario == "conversation":
        out = conversation(c, model, argv[4], int(argv[5]), float(argv[6]))
    elif scenario == "prefix_cached":
        out = prefix_cached(c, model, int(argv[4]))
    elif scenario == "disconnect":
        out = disconnect(c, model)
    elif scenario == "many":
        out = many(c, model, int(argv[4]), int(argv[5]))
    elif scenario == "overload":
        out = overload(c, model, int(argv[4]))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
