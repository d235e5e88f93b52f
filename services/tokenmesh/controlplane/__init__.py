"""The xDS control plane: Envoy's cluster endpoints (EDS over ADS) from Consul or a static file."""
