# Raw h2 client that stops reading (no WINDOW_UPDATEs) for a while to exercise downstream flow control.
import socket, struct, sys, time, h2.connection, h2.config, h2.events
port, n, pad, stall = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.create_connection(("127.0.0.1", port))
c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True)); c.initiate_connection()
s.sendall(c.data_to_send())
body = f"n={n};start=0;delay_ms=0;pad={pad}".encode(); msg = b"\0" + struct.pack(">I", len(body)) + body
c.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", "/tokenmesh.v1.InferenceService/Generate"),
                   (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
c.send_data(1, msg, end_stream=True); s.sendall(c.data_to_send())
got = 0; t0 = time.time(); acking = False; done = False
s.settimeout(0.2)
while not done:
    if not acking and time.time() - t0 > stall: acking = True; print(f"[slow] t={stall}s: got {got} bytes while stalled; now reading", flush=True)
    if acking and getattr(c, "_pa", 0): c.acknowledge_received_data(c._pa, 1); c._pa = 0; s.sendall(c.data_to_send())
    try: data = s.recv(65536)
    except socket.timeout: continue
    if not data: break
    for ev in c.receive_data(data):
        if isinstance(ev, h2.events.DataReceived):
            got += len(ev.data)
            if acking: c.acknowledge_received_data(ev.flow_controlled_length, 1)
            else: pending_ack = getattr(c, "_pa", 0); c._pa = pending_ack + ev.flow_controlled_length
        elif isinstance(ev, h2.events.TrailersReceived): print("[slow] trailers", ev.headers, flush=True)
        elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)): done = True
    if acking and getattr(c, "_pa", 0): c.acknowledge_received_data(c._pa, 1); c._pa = 0
    s.sendall(c.data_to_send())
print(f"[slow] total {got} bytes in {time.time()-t0:.1f}s", flush=True)
