"""cProfile of micro.py's servicer path: call counts and own time per token, by function."""
import cProfile, pstats, sys, asyncio
sys.argv = ["micro.py", "200", "32"]
sys.path.insert(0, "/tmp/prof")
import micro, uvloop
uvloop.install()
profile = cProfile.Profile()
profile.enable()
asyncio.run(micro.main(200, 32))
profile.disable()
tokens = 2 * 200 * micro.OUTPUT
stats = pstats.Stats(profile)
rows = []
for (file, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():
    rows.append((nc / tokens, tt * 1e6 / tokens, ct * 1e6 / tokens, f"{file.split('site-packages/')[-1].replace('/tmp/wt-after/services/','').replace('/tmp/wt-before/services/','')}:{line}({name})"))
print("calls/token total", round(sum(r[0] for r in rows), 1))
print("calls/tok  own us/tok  cum us/tok  function")
for r in sorted(rows, key=lambda r: -r[0])[:45]:
    print(f"{r[0]:8.2f} {r[1]:10.2f} {r[2]:10.2f}  {r[3]}")
