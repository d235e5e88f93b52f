"""The inference worker: a gRPC InferenceService over one vLLM AsyncLLM engine."""
