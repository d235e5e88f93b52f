"""The Envoy configuration of the mesh, rendered from one description for local runs and Helm."""
