"""Memory of data preparation as the training file grows: flat, or the tokens in memory?

    python bench/data_memory.py                              # 8, 16, 32 and 64 MB of alpaca rows (a few minutes)
    python bench/data_memory.py --sizes-mb 2048              # the 2 GB file (tokenizing it takes about two hours
                                                             # on one CPU core: rows are rendered one by one)
    python bench/data_memory.py --streaming --sizes-mb 8,64,2048 --stream-rows 100000
                                                             # data.streaming: the first 100,000 rows of each file

Each size is a generated JSONL file of alpaca rows (seeded, short instructions and answers), read in a process
of its own with a fresh cache. Map-style (the default), the file is prepared as training prepares it
(`workbench.data.prepared.prepare_data`: read, check, tokenize into the cache, pack). With --streaming it is read as a
streamed run reads it (`workbench.data.streaming.StreamedExamples`: shuffled in a buffer, tokenized and packed as the
rows are asked for), all of it or its first --stream-rows rows; "first row s" is how long the first packed row
took, what a streamed run waits before its first step. Reported per size: the wall time, the peak of the process's
anonymous memory (RssAnon: what the process itself holds, sampled every 20 ms) and of its whole resident set (RSS:
with the pages of the memory-mapped Arrow files it read, which the kernel can drop at will), each as growth over
the process before preparing, and that growth per MB of file. Flat means the anonymous growth per MB falls as the
file grows: what stays in memory is per row (lengths, packing bins), not per token; a stream holds its buffers only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is that it for on was with as be by at this from or have an are not but what which "
         "their will would there can all if about one more when some time so could them other than then").split()

WORKER = r"""
import json, os, sys, threading, time

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

from workbench import Recipe
from workbench.data.prepared import prepare_data
from workbench.model.loading import load_tokenizer
from workbench.data.streaming import StreamedExamples

streamed, stream_rows = sys.argv[3] == "stream", int(sys.argv[4])
recipe = Recipe.load(sys.argv[1], [f"data.train={sys.argv[2]}", "data.format=alpaca", "data.eval=null",
                                   "data.packing=true", "data.max_seq_len=512", "training.max_steps=1",
                                   f"data.streaming={str(streamed).lower()}",
                                   *([f"data.limit={stream_rows}"] if streamed and stream_rows else [])])
tokenizer = load_tokenizer(recipe.model)
before = {"anon": anon_kb(), "rss": rss_kb()}
peak = dict(before)
done = threading.Event()

def sample():
    while not done.wait(0.02):
        peak["anon"], peak["rss"] = max(peak["anon"], anon_kb()), max(peak["rss"], rss_kb())

threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
if streamed:
    stream, first, packed, tokens = StreamedExamples(recipe.data, tokenizer, seed=0), None, 0, 0
    for row in stream.examples(0):
        first = first or time.perf_counter() - started
        packed, tokens = packed + 1, tokens + len(row["input_ids"])
    figures = {"rows": stream.read["samples"], "tokens": tokens, "packed_rows": packed, "first_row_s": first}
else:
    data = prepare_data(recipe.data, tokenizer)
    figures = {"rows": data.stats["train_samples"], "tokens": data.stats["train_tokens"],
               "packed_rows": len(data.train), "first_row_s": None}
wall = time.perf_counter() - started
done.set()
print(json.dumps({"wall_s": wall, **figures, "anon_growth_mb": (peak["anon"] - before["anon"]) / 1024,
                  "rss_growth_mb": (peak["rss"] - before["rss"]) / 1024}))
"""


def write_rows(path: Path, megabytes: float, seed: int = 0) -> int:
    rng = random.Random(seed)
    target, written, rows = megabytes * 2 ** 20, 0, 0
    with path.open("w") as f:
        while written < target:
            line = json.dumps({"instruction": " ".join(rng.choices(WORDS, k=rng.randint(5, 30))),
                               "output": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))}) + "\n"
            f.write(line)
            written += len(line)
            rows += 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="8,16,32,64", help="file sizes, comma-separated")
    parser.add_argument("--recipe", default=str(ROOT / "recipes/tiny.yaml"), help="whose model's tokenizer to use")
    parser.add_argument("--streaming", action="store_true", help="read each file as data.streaming reads it")
    parser.add_argument("--stream-rows", type=int, default=0, help="with --streaming: read the first N rows of "
                                                                   "each file (0: all of it)")
    args = parser.parse_args()
    try:
        sizes = [float(s) for s in args.sizes_mb.split(",")]
    except ValueError:
        parser.error(f"--sizes-mb: comma-separated numbers of MB, got {args.sizes_mb!r}")
    if args.stream_rows < 0 or (args.stream_rows and not args.streaming):
        parser.error("--stream-rows: a number of rows >= 0, with --streaming")
    print(f"{'file MB':>8} {'rows':>10} {'tokens':>12} {'wall s':>8} {'first row s':>11} {'anon +MB':>9} "
          f"{'per MB':>7} {'RSS +MB':>8} {'per MB':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            path = Path(tmp) / f"rows-{size:g}mb.jsonl"
            write_rows(path, size)
            env = {**os.environ, "LORA_WORKBENCH_CACHE": str(Path(tmp) / f"cache-{size:g}"),
                   "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            done = subprocess.run([sys.executable, "-c", WORKER, args.recipe, str(path),
                                   "stream" if args.streaming else "map", str(args.stream_rows)],
                                  capture_output=True, text=True, env=env, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"{size:g} MB: the preparation failed:\n{done.stderr[-2000:]}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            real_mb = path.stat().st_size / 2 ** 20
            first = "-" if r["first_row_s"] is None else f"{r['first_row_s']:.1f}"
            print(f"{real_mb:>8.1f} {r['rows']:>10,} {r['tokens']:>12,} {r['wall_s']:>8.1f} {first:>11} "
                  f"{r['anon_growth_mb']:>9.1f} {r['anon_growth_mb'] / real_mb:>7.2f} "
                  f"{r['rss_growth_mb']:>8.1f} {r['rss_growth_mb'] / real_mb:>7.2f}", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
