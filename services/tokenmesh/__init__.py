"""tokenmesh: an Envoy-fronted gRPC microservice mesh for LLM inference."""
