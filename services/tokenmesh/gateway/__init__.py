"""The gateway: the public LLMService, reranking documents and streaming tokens from workers."""
