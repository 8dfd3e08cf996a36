"""Bounded soak of llama-server with draft-eagle2: client threads send requests in a loop (completions
and chat, streaming or not, some cut off mid-stream) for a fixed time; the server's resident memory
is sampled as it goes. Prints a table and writes JSON.

    .venv/bin/python benchmarks/server_soak.py --seconds 180 -o soak.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from pathlib import Path

from eagle_llamacpp import heads, models
from eagle_llamacpp.llama_server import LlamaServer

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time", "SELECT name FROM users WHERE",
           "import numpy as np\n", "Write a haiku about the sea."]


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def client_loop(server: LlamaServer, stop: threading.Event, stats: dict, worker: int) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    i = worker
    while not stop.is_set():
        prompt = PROMPTS[i % len(PROMPTS)]
        kind = ("completion", "chat", "stream", "cut")[i % 4]
        try:
            if kind == "completion":
                client.completions.create(model="m", prompt=prompt, max_tokens=48, temperature=0)
            elif kind == "chat":
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=48, temperature=0.8, seed=i)
            else:
                stream = client.completions.create(model="m", prompt=prompt, max_tokens=48, temperature=0,
                                                   stream=True)
                for n, _ in enumerate(stream):
                    if kind == "cut" and n == 3:
                        break  # the client goes away mid-stream
                stream.close()
            stats["ok"] += 1
        except Exception as e:  # noqa: BLE001 - a soak counts every failure
            stats["failed"] += 1
            stats["errors"].append(f"{kind}: {e!r}"[:200])
        i += 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("-o", "--out", default="soak.json")
    args = ap.parse_args()

    target = models.fetch(models.SMOLLM2_135M)
    draft = heads.draft_gguf(heads.shipped_head(models.SMOLLM2_135M), target)
    server = LlamaServer(target, ["-md", str(draft), "--spec-type", "draft-eagle2", "--spec-draft-n-max", "6",
                                  "--spec-eagle2-depth", "3", "--spec-eagle2-top-k", "2"],
                         n_ctx=2048, n_parallel=args.clients)
    stats = {"ok": 0, "failed": 0, "errors": []}
    samples = []
    stop = threading.Event()
    threads = [threading.Thread(target=client_loop, args=(server, stop, stats, w)) for w in range(args.clients)]
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        while time.monotonic() - t0 < args.seconds:
            samples.append((round(time.monotonic() - t0, 1), round(rss_mib(server.proc.pid), 1)))
            time.sleep(5)
        stop.set()
        for t in threads:
            t.join()
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            healthy = r.status == 200
    finally:
        server.close()

    first, last = samples[min(2, len(samples) - 1)][1], samples[-1][1]  # after the first 10 s of warm-up
    report = {"seconds": args.seconds, "clients": args.clients, "requests_ok": stats["ok"],
              "requests_failed": stats["failed"], "errors": stats["errors"][:10], "healthy_after": healthy,
              "rss_mib_after_warmup": first, "rss_mib_end": last, "rss_mib_max": max(m for _, m in samples),
              "rss_samples": samples}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("| seconds | clients | requests ok | failed | RSS after warm-up (MiB) | RSS at end | RSS max | healthy |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.seconds:.0f} | {args.clients} | {stats['ok']} | {stats['failed']} | {first} | {last} | "
          f"{report['rss_mib_max']} | {healthy} |")
    return 0 if stats["failed"] == 0 and healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
