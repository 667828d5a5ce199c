"""Goodput of 1P1D (prefill on cuda:0, decode on cuda:1, NCCL hand-off) against two unified
workers (cuda:0, cuda:1) behind the same router, under the same mixed load from two
concurrent baton-loadtest runs: long prompts with short outputs, and short prompts with long
outputs. Model: Llama-3.2-1B shape with random weights and the tiny test tokenizer (so the
router and the load generator have a real tokenizer; the vocabulary is the tiny one's).
Writes goodput.json to $OUT and prints a table."""
import json, os, subprocess, sys, time, urllib.request

H = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("OUT", "/tmp/out")
B, LT = os.path.join(H, "baton"), os.path.join(H, "baton-loadtest")
# Overridable: GOODPUT_SLO="tpot:25,ttft:2000", GOODPUT_MODEL=llama-3.1-8b.json,
# GOODPUT_LOADS="2048:8:8:160,128:128:16:320" (input:output:rate:prompts for the long-prompt
# and the short-prompt load).
SLO = os.environ.get("GOODPUT_SLO", "tpot:25,ttft:2000").split(",")
MODEL_CFG = os.environ.get("GOODPUT_MODEL", "llama-3.2-1b.json")
SCALE = float(os.environ.get("GOODPUT_SCALE", "1"))  # fraction of the prompt counts (quick checks)
LOADS = {  # name: (input, output, rate req/s, prompts)
    "long_prompt": (2048, 8, 8, max(8, int(160 * SCALE))),
    "short_prompt": (128, 128, 16, max(16, int(320 * SCALE))),
}
if os.environ.get("GOODPUT_LOADS"):
    parts = [tuple(float(x) for x in l.split(":")) for l in os.environ["GOODPUT_LOADS"].split(",")]
    LOADS = {name: (int(i), int(o), r, int(n)) for name, (i, o, r, n) in zip(("long_prompt", "short_prompt"), parts)}
CONFIGS = os.environ.get("GOODPUT_CONFIGS", "1p1d,2unified").split(",")

def model_dir():
    subprocess.run([os.path.join(H, "write_tiny_models"), "/tmp/m"], check=True, capture_output=True)
    tiny = json.load(open("/tmp/m/llama/config.json"))
    cfg = json.load(open(os.path.join(H, MODEL_CFG)))
    cfg["vocab_size"] = tiny["vocab_size"]
    cfg["bos_token_id"] = tiny.get("bos_token_id")
    cfg["eos_token_id"] = tiny.get("eos_token_id")
    os.makedirs("/tmp/g", exist_ok=True)
    json.dump(cfg, open("/tmp/g/config.json", "w"))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(f"/tmp/m/llama/{f}"):
            subprocess.run(["cp", f"/tmp/m/llama/{f}", "/tmp/g/"], check=True)
    return "/tmp/g"

def wait(url, secs=420):
    t = time.time()
    while time.time() - t < secs:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("not healthy: " + url)

def run_config(name, model, router_flags, workers):
    procs = []
    def spawn(tag, args):
        log = open(os.path.join(OUT, f"{name}-{tag}.log"), "w")
        procs.append(subprocess.Popen([B] + args, stdout=log, stderr=subprocess.STDOUT))
    common = ["--model", model, "--load-format", "dummy", "--served-model-name", "g", "--max-model-len", "4096"]
    engine = ["--max-num-seqs", "128", "--max-num-batched-tokens", "4096"]
    try:
        spawn("router", ["router"] + common + ["--port", "8001", "--grpc-port", "0", "--registry-port", "50100"] + router_flags)
        for i, (role, dev, extra) in enumerate(workers):
            spawn(f"{role}{i}", ["worker", "--role", role, "--router", "127.0.0.1:50100", "--device", dev] + common + engine + extra)
        wait("http://127.0.0.1:8001")
        runs = []
        for k, (lname, (inp, outp, rate, n)) in enumerate(LOADS.items()):
            args = [LT, "--backend", "openai", "--base-url", "http://127.0.0.1:8001", "--model", "g",
                    "--tokenizer", "/tmp/g/tokenizer.json", "--dataset", "random", "--input-len", str(inp),
                    "--output-len", str(outp), "--request-rate", str(rate), "--num-prompts", str(n),
                    "--warmup", "4", "--seed", str(7 + k), "--goodput", *SLO,
                    "--out", os.path.join(OUT, f"{name}-{lname}.json"), "--no-progress"]
            runs.append((lname, subprocess.Popen(args, stdout=open(os.path.join(OUT, f"{name}-{lname}.txt"), "w"), stderr=subprocess.STDOUT)))
        res = {}
        for lname, p in runs:
            p.wait(timeout=150)
            s = json.load(open(os.path.join(OUT, f"{name}-{lname}.json")))["summary"]
            res[lname] = {k: s[k] for k in ("completed", "failed", "request_throughput", "request_goodput", "output_throughput")}
            res[lname]["ttft_p50_ms"] = s["ttft_ms"]["median"] if isinstance(s["ttft_ms"], dict) and "median" in s["ttft_ms"] else s["ttft_ms"]
            res[lname]["tpot_ms"] = s["tpot_ms"]
        return res
    finally:
        for p in procs:
            p.kill()
        time.sleep(2)

model = model_dir()
SETUPS = {
    "1p1d": (["--policy", "least_loaded", "--min-prefill-workers", "1"],
             [("prefill", "cuda:0", ["--kv-transport", "nccl"]), ("decode", "cuda:1", [])]),
    "2unified": (["--disagg-threshold", "1000000", "--min-decode-workers", "2"],
                 [("unified", "cuda:0", []), ("unified", "cuda:1", [])]),
}
results = {name: run_config(name, model, *SETUPS[name]) for name in CONFIGS}
total = {k: sum((v.get("request_goodput") or 0) for v in r.values()) for k, r in results.items()}
ratio = total["1p1d"] / total["2unified"] if total.get("2unified") and "1p1d" in total else None
out = {"slo": SLO, "loads": LOADS, "results": results, "total_goodput_req_per_s": total,
       "ratio_1p1d_vs_2unified": ratio}

def attainment(name, tpot_slos_ms, ttft_slo_ms):
    """Fraction of all requests of both loads (and req/s) meeting TTFT and each TPOT SLO, from
    the per-request records: the SLO can be chosen after the run."""
    recs, dur = [], 0.0
    for lname in LOADS:
        d = json.load(open(os.path.join(OUT, f"{name}-{lname}.json")))
        recs += d["records"]
        dur = max(dur, d["summary"]["duration_s"])
    rows = {}
    for slo in tpot_slos_ms:
        ok = 0
        for r in recs:
            if not r["success"] or r["ttft_s"] is None or r["ttft_s"] * 1000 > ttft_slo_ms:
                continue
            n = r["output_tokens"]
            tpot = (r["latency_s"] - r["ttft_s"]) / (n - 1) * 1000 if n > 1 else 0.0
            ok += tpot <= slo
        rows[str(slo)] = {"attained": ok / len(recs), "goodput_req_per_s": ok / dur}
    return rows

SWEEP = [float(x) for x in os.environ.get("GOODPUT_TPOT_SWEEP", "5,10,15,20,25,30,40,50").split(",")]
TTFT_SLO = float([x for x in SLO if x.startswith("ttft:")][0].split(":")[1])
out["tpot_sweep"] = {name: attainment(name, SWEEP, TTFT_SLO) for name in results}
json.dump(out, open(os.path.join(OUT, "goodput.json"), "w"), indent=1)
print("TPOT SLO sweep (TTFT <=", TTFT_SLO, "ms): attained fraction / goodput req/s")
for slo in SWEEP:
    print(f"  tpot<={slo:>5} ms  " + "  ".join(
        f"{name}: {out['tpot_sweep'][name][str(slo)]['attained']:.3f} / {out['tpot_sweep'][name][str(slo)]['goodput_req_per_s']:.2f}"
        for name in results))
for k, r in results.items():
    for lname, v in r.items():
        print(k, lname, json.dumps(v)[:300])
print("total goodput req/s:", total, "ratio:", ratio)
