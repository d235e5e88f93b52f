# Calls Generate through Envoy, checks the stream is unbroken (tok-0..tok-n-1, in order, no dups).
import sys, time, grpc
target, n, delay = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "0"
streams = int(sys.argv[4]) if len(sys.argv) > 4 else 1
ch = grpc.insecure_channel(target)
call = ch.unary_stream("/tokenmesh.v1.InferenceService/Generate", request_serializer=None, response_deserializer=None)
t0 = time.time(); total = 0
for s in range(streams):
    it = call(f"n={n};start=0;delay_ms={delay}".encode(), timeout=60)
    got = [m.split(b"|")[0].decode() for m in it]
    total += len(got)
    ok = got == [f"tok-{i}" for i in range(n)]
    tr = dict(it.trailing_metadata() or ())
    if streams == 1 or not ok:
        print(f"stream {s}: received {len(got)} msgs, unbroken_in_order={ok}, status={it.code()}, trailers={tr}, first={got[:2]}, last={got[-2:]}")
print(f"total msgs {total} in {time.time()-t0:.2f}s")
