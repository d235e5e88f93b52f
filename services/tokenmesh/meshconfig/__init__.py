"""The Envoy configuration of the mesh, rendered from one description for local runs and Helm.

config.MeshSettings describes the mesh; policy.Services turns it once into each service's policy
(data: health check, protocol, retries, hashing, ejection, breakers, internal listener), which
the builders read. bootstrap.render composes them: edge (the callers' listener, with filters,
routes, direct_path, local_replies, access_logs), listeners (connection managers, the internal
listeners), routes and retries, clusters, protocols (HTTP/2 windows), tls (TLS contexts and
SDS files) and admin (the stats listener)."""
