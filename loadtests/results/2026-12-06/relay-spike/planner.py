# One-shot "resume planner": body = original gRPC-framed request + delivered gRPC frames; returns new framed request.
import struct, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer as HTTPServer
def frames(b):
    out, off = [], 0
    while off + 5 <= len(b):
        (l,) = struct.unpack(">I", b[off+1:off+5]); out.append(b[off+5:off+5+l]); off += 5 + l
    return out
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"])); ol = int(self.headers["x-orig-len"])
        req = frames(body[:ol])[0].decode(); got = frames(body[ol:])
        d = dict(kv.split("=") for kv in req.split(";") if kv); d["start"] = str(int(d.get("start", 0)) + len(got))
        new = ";".join(f"{k}={v}" for k, v in d.items()).encode()
        out = b"\x00" + struct.pack(">I", len(new)) + new
        print(f"[planner] len={len(body)} ol={ol} delivered={len(got)} frames -> new request {new!r}", flush=True)
        self.send_response(200); self.send_header("content-length", str(len(out))); self.end_headers(); self.wfile.write(out)
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
