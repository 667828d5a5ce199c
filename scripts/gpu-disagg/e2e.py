"""Disaggregated serving on 2 GPUs through the real processes: router + prefill worker
(cuda:0, --kv-transport nccl) + decode worker (cuda:1) must give the same completions as
`baton serve` on cuda:0, streaming and not; every worker ends with zero KV blocks used."""
import json, os, subprocess, sys, time, urllib.request

H = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("OUT", "/tmp/out")
B = os.path.join(H, "baton")
MODEL = "/tmp/m/llama"
COMMON = ["--model", MODEL, "--served-model-name", "tiny", "--max-model-len", "512"]
ENGINE = ["--num-kv-blocks", "256"]
procs = []

def spawn(name, args):
    log = open(os.path.join(OUT, name + ".log"), "w")
    p = subprocess.Popen([B] + args, stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p

def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()

def wait_health(url, secs=120):
    t = time.time()
    while time.time() - t < secs:
        try:
            if get(url + "/health")[0] == 200:
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise SystemExit("not healthy: " + url)

def complete(base, prompt, stream):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": stream}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    if not stream:
        c = json.loads(text)["choices"][0]
        return c["text"], c["logprobs"]["token_logprobs"]
    out, lps = "", []
    for ev in text.split("\n\n"):
        ev = ev.strip()
        if not ev.startswith("data: ") or ev == "data: [DONE]":
            continue
        c = json.loads(ev[6:])["choices"][0]
        out += c.get("text", "")
        lps += (c.get("logprobs") or {}).get("token_logprobs", [])
    return out, lps

def metric(base, name):
    for line in get(base + "/metrics")[1].splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None

prompts = [[(i * 7919 + j * 104729 + 11) % 256 for j in range(n)] for i, n in enumerate([1, 15, 16, 17, 63, 200])]
try:
    serve = spawn("serve", ["serve"] + COMMON + ENGINE + ["--device", "cuda:0", "--port", "8000", "--grpc-port", "0"])
    wait_health("http://127.0.0.1:8000")
    want = [complete("http://127.0.0.1:8000", p, s) for p in prompts for s in (False, True)]
    serve.terminate(); serve.wait()
    spawn("router", ["router"] + COMMON + ["--port", "8001", "--grpc-port", "0", "--registry-port", "50100",
                                           "--min-prefill-workers", "1"])
    spawn("prefill", ["worker", "--role", "prefill", "--router", "127.0.0.1:50100", "--device", "cuda:0",
                      "--kv-transport", "nccl", "--port", "8101"] + COMMON + ENGINE)
    spawn("decode", ["worker", "--role", "decode", "--router", "127.0.0.1:50100", "--device", "cuda:1",
                     "--port", "8102"] + COMMON + ENGINE)
    wait_health("http://127.0.0.1:8001")
    got = [complete("http://127.0.0.1:8001", p, s) for p in prompts for s in (False, True)]
    # The same requests all at once: the prefill worker computes several in one step and their
    # layer sends interleave on the one NCCL link (ordered by send number on the decode side).
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(want)) as pool:
        got += list(pool.map(lambda ps: complete("http://127.0.0.1:8001", *ps), [(p, s) for p in prompts for s in (False, True)]))
    want = want + want
    same_text = sum(a[0] == b[0] for a, b in zip(got, want))
    max_lp = max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a[1], b[1]))
    time.sleep(1.0)
    used = [metric(f"http://127.0.0.1:{p}", 'baton_kv_blocks_used') for p in (8101, 8102)]
    moved = [metric(f"http://127.0.0.1:{p}", 'baton_kv_transfer_bytes_total') for p in (8101, 8102)]
    nccl = "NCCL link ready" in open(os.path.join(OUT, "prefill.log")).read()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.split("\n")
    commit = open(os.path.join(H, "COMMIT")).read().strip() if os.path.exists(os.path.join(H, "COMMIT")) else "unknown"
    res = {"name": "disagg-e2e-nccl", "device": f"{len([g for g in gpu if g])}x {gpu[0]}", "commit": commit,
           "anchor": "baton serve on cuda:0 (same prompts, greedy)", "completions": len(want), "concurrent_round": True, "identical_text": same_text, "max_logprob_diff": max_lp,
           "kv_blocks_used_after": used, "kv_bytes_moved": moved, "nccl_link_used": nccl}
    json.dump(res, open(os.path.join(OUT, "e2e.json"), "w"), indent=1)
    print(json.dumps(res))
    ok = same_text == len(want) and max_lp < 1e-3 and used == [0.0, 0.0] and nccl and all(m and m > 0 for m in moved)
    print("E2E", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)
finally:
    for p in procs:
        p.kill()
