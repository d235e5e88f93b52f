"""py-spy raw profiles of the worker: each function's share of samples (inclusive and self),
scaled to CPU µs per token by the round's measured worker CPU per token (/proc).

    analyze.py ROUNDS.json PROFILE_DIR [NAME ...] [--top N] [--match STR]
"""
import json, re, sys
from collections import Counter, defaultdict
from pathlib import Path

args = [a for a in sys.argv[1:] if not a.startswith("--")]
top = 40
match = None
for i, a in enumerate(sys.argv):
    if a == "--top": top = int(sys.argv[i + 1])
    if a == "--match": match = sys.argv[i + 1]
args = [a for a in args if not (a.isdigit() or a == match)]
rounds = json.loads(Path(args[0]).read_text())
directory = Path(args[1])
names = args[2:] or sorted({r["target"] for r in rounds})

def frame_name(frame):
    # "func (file:line)" -> "func (file)"
    return re.sub(r":\d+\)$", ")", frame)

def load(name):
    incl, self_, threads = Counter(), Counter(), Counter()
    total = 0
    us_per_token = []
    for row in rounds:
        if row["target"] != name: continue
        path = directory / f"{name}-r{row['round']}.txt"
        if not path.exists(): continue
        samples = Counter()
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            samples[stack] += int(count)
        n = sum(samples.values())
        scale = row["cpu_us_per_token"]["worker"] / n  # µs/token per sample this round
        for stack, count in samples.items():
            frames = stack.split(";")
            thread = re.sub(r"thread \(\d+\): ", "", frames[0])
            thread = re.sub(r"-\d+", "-N", thread)
            w = count * scale
            threads[thread] += w
            seen = set()
            for f in frames[1:]:
                f = frame_name(f)
                if f not in seen:
                    seen.add(f); incl[f] += w
            self_[frame_name(frames[-1])] += w
            total += w
        us_per_token.append(row["cpu_us_per_token"]["worker"])
    k = len(us_per_token)
    return ({f: v / k for f, v in incl.items()}, {f: v / k for f, v in self_.items()},
            {t: v / k for t, v in threads.items()}, total / k)

data = {n: load(n) for n in names}
print("worker CPU µs/token (mean of rounds):", {n: round(d[3], 1) for n, d in data.items()})
print("\n## threads, µs/token")
allt = sorted(set().union(*(d[2] for d in data.values())), key=lambda t: -max(d[2].get(t, 0) for d in data.values()))
for t in allt[:10]:
    print(f"{t[:60]:60s}", "  ".join(f"{data[n][2].get(t, 0):7.1f}" for n in names))
for label, idx in (("inclusive", 0), ("self", 1)):
    print(f"\n## {label}, µs/token", "  ".join(names))
    keys = set().union(*(d[idx] for d in data.values()))
    if match: keys = {k for k in keys if match in k}
    keys = sorted(keys, key=lambda f: -max(d[idx].get(f, 0) for d in data.values()))
    for f in keys[:top]:
        print("  ".join(f"{data[n][idx].get(f, 0):7.1f}" for n in names), f[:150])
