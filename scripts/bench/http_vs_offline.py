"""The HTTP/SSE path against the offline engine on the GPU (issue 14's host-path figure).

The same workload twice on one GPU, in one call: 2,000 random prompts of 128 tokens, 256 output
tokens each (`ignore_eos`), 512 sequences at once. First the offline engine alone
(`bench_throughput`: every prompt submitted to one engine in-process), then `baton serve` with
the same engine settings driven by `baton-loadtest` at 512 concurrent streams over loopback,
then the offline engine again (the two offline runs bound the call's own noise). The figure is
served output tok/s over the mean of the offline runs; the target is >= 0.9.

Model: the SmolLM2-135M shape (the default model's config and real tokenizer, exported by
`export_hf`) with random weights (`--load-format dummy`), so the binaries and the model fit the
device carry. A discarded warm-up load run comes first: the server's first full batches pay for
graph capture and allocation.

  python3 http_vs_offline.py BATON LOADTEST BENCH_THROUGHPUT MODEL_DIR OUT_DIR [COMMIT]

MODEL_DIR holds config.json, tokenizer.json and tokenizer_config.json. Writes
OUT_DIR/http-offline-{1,2}.json (bench_throughput), http-served.json and http-warm.json
(baton-loadtest) and OUT_DIR/http-vs-offline.json (the summary), and prints a table.
"""
import json, os, subprocess, sys, time, urllib.request

baton, loadtest, bench, model, out = sys.argv[1:6]
commit = sys.argv[6] if len(sys.argv) > 6 else "unknown"
PROMPTS = int(os.environ.get("HTTP_PROMPTS", "2000"))
CONCURRENCY = int(os.environ.get("HTTP_CONCURRENCY", "512"))
ISL, OSL = 128, 256
config = os.path.join(model, "config.json")


def offline(i):
    path = os.path.join(out, f"http-offline-{i}.json")
    r = subprocess.run([bench, "--config", config, "--out", path, "--device", "cuda:0", "--prompts", str(PROMPTS),
                        "--isl", str(ISL), "--osl", str(OSL), "--max-num-seqs", str(CONCURRENCY),
                        "--max-num-batched-tokens", "8192", "--commit", commit],
                       capture_output=True, text=True)
    print(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-1000:])
    if r.returncode != 0:
        sys.exit(f"bench_throughput failed: {r.stderr[-2000:]}")
    return json.load(open(path))


def served():
    port = 18124
    log = open(os.path.join(out, "http-serve.log"), "w")
    server = subprocess.Popen(
        [baton, "serve", "--model", model, "--load-format", "dummy", "--device", "cuda", "--port", str(port),
         "--grpc-port", "0", "--max-model-len", str(ISL + OSL + 16), "--max-num-seqs", str(CONCURRENCY),
         "--max-num-batched-tokens", "8192", "--served-model-name", "m"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(180):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except Exception:
                time.sleep(1)
        else:
            sys.exit("server did not become healthy")

        def run(name, prompts):
            path = os.path.join(out, f"http-{name}.json")
            cmd = [loadtest, "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--input-len", str(ISL),
                   "--output-len", str(OSL), "--num-prompts", str(prompts), "--max-concurrency", str(CONCURRENCY),
                   "--tokenizer", os.path.join(model, "tokenizer.json"), "--no-progress", "--out", path]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-2000:])
                sys.exit(f"loadtest {name} failed")
            return json.load(open(path))

        run("warm", CONCURRENCY)
        return run("served", PROMPTS)
    finally:
        server.terminate()
        server.wait(timeout=60)


def summary_of(res):
    return res.get("summary", res)


first = offline(1)
load = served()
second = offline(2)
s = summary_of(load)
offline_tok_s = [first["output_tok_s"], second["output_tok_s"]]
mean_offline = sum(offline_tok_s) / 2
served_tok_s = s["output_throughput"]
result = {
    "benchmark": "http_vs_offline",
    "commit": commit,
    "model": "SmolLM2-135M shape, dummy weights",
    "prompts": PROMPTS,
    "isl": ISL,
    "osl": OSL,
    "concurrency": CONCURRENCY,
    "offline_output_tok_s": offline_tok_s,
    "served_output_tok_s": served_tok_s,
    "served_completed": s.get("completed"),
    "served_failed": s.get("failed"),
    "served_median_ttft_ms": s["ttft_ms"]["median"],
    "served_median_tpot_ms": s["tpot_ms"]["median"],
    "served_peak_concurrency": s.get("peak_concurrency"),
    "ratio": served_tok_s / mean_offline,
    "target": 0.9,
}
json.dump(result, open(os.path.join(out, "http-vs-offline.json"), "w"), indent=1)
print(f"| offline run 1 | {offline_tok_s[0]:,.0f} out tok/s |")
print(f"| served (HTTP/SSE, {CONCURRENCY} streams) | {served_tok_s:,.0f} out tok/s |")
print(f"| offline run 2 | {offline_tok_s[1]:,.0f} out tok/s |")
print(f"| served / offline | {result['ratio']:.3f} (target 0.9) |")
