"""The reranker: a gRPC RerankService that scores documents against a query with a small model."""
