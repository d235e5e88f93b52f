# Tiny gRPC server-streaming upstream (raw bytes, no protoc). Request payload: b"n=<N>;start=<S>;delay_ms=<D>".
# Replies with messages b"tok-<i>" for i in [start, n). If DIE_AFTER=k, the process exits hard after k messages.
import os, sys, time, grpc
from concurrent import futures
port = int(sys.argv[1]); die_after = int(os.environ.get("DIE_AFTER", "0"))
def parse(b):
    d = dict(kv.split("=") for kv in b.decode().split(";") if kv)
    return int(d.get("n", 10)), int(d.get("start", 0)), float(d.get("delay_ms", 0)), int(d.get("pad", 0))
sent_total = [0]
def generate(req, ctx):
    n, start, delay, pad = parse(req)
    for i in range(start, n):
        if delay: time.sleep(delay / 1000)
        yield (b"tok-%d" % i) + ((b"|" + b"x" * pad) if pad else b"")
        sent_total[0] += 1
        if die_after and sent_total[0] >= die_after:
            time.sleep(0.05); print(f"[upstream {port}] dying after {sent_total[0]} msgs", flush=True); os._exit(1)
h = grpc.method_handlers_generic_handler("tokenmesh.v1.InferenceService",
        {"Generate": grpc.unary_stream_rpc_method_handler(generate)})
s = grpc.server(futures.ThreadPoolExecutor(4)); s.add_generic_rpc_handlers((h,))
s.add_insecure_port(f"127.0.0.1:{port}"); s.start(); print(f"[upstream {port}] up", flush=True); s.wait_for_termination()
