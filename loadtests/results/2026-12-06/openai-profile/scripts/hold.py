"""Bring up a private mesh (1 gateway, 1 worker) from the tree in cwd, write its pids and
ports to argv[1], hold it until argv[1]+'.stop' exists or 100 min pass, then bring it down."""
import json, os, signal, sys, time
from pathlib import Path
from loadtests.scenarios import private_mesh
from tokenmesh.worker.placement import descendants

state = Path(sys.argv[1])
stop = Path(str(state) + ".stop")
signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
with private_mesh() as m:
    worker = m.pid("worker-0")
    info = {
        "worker": [worker], "engine": descendants(worker),
        "gateway": [m.pid("gateway-0")], "envoy": [m.pid("envoy")],
        "edge": f"127.0.0.1:{m.settings.edge_port}",
        "model": Path(m.settings.model).name,
        "cores": m.mesh_cores(m.settings.worker_count(), os.cpu_count() or 1),
        "run_dir": str(m.run_dir),
    }
    state.write_text(json.dumps(info))
    print("UP", info, flush=True)
    deadline = time.monotonic() + 6000
    try:
        while not stop.exists() and time.monotonic() < deadline:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
print("DOWN", flush=True)
