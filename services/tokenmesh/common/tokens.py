"""Token messages that hold several tokens: counting them, merging two, cutting one short."""

from __future__ import annotations

from tokenmesh.v1 import inference_pb2, llm_pb2, openai_pb2, token_pb2

# The trailer marking an answer made without a dependency, and its value for the reranker. On a
# stream Envoy takes straight from a worker, the gateway sets it as a request header and the
# worker returns it as a trailer.
DEGRADED_HEADER = "x-tokenmesh-degraded"
DEGRADED_BY_RERANKER = "reranker"
# Trailer of a gRPC token stream that moved to another worker mid-stream: how many times.
RESUMED_TRAILER = "x-tokenmesh-resumed"
# The trailer a worker ends a finished stream with: its prompt and completion tokens and the
# messages it sent ("12 128 40"). Envoy logs it for the gateway when it streams a worker's
# tokens straight to the caller (gateway/frontends/direct_log.py), where no gateway sees the
# messages.
USAGE_TRAILER = "x-tokenmesh-usage"
# The callers' Generate and the workers': on the direct token path the edge routes the first
# to a gateway to prepare, then the rewritten second to a worker, and logs that one to the
# gateways.
LLM_GENERATE = "/" + llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name + "/Generate"
WORKER_GENERATE = (
    "/" + inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name + "/Generate"
)
# OpenAI's completions as the edge's transcoder turns them into calls (openai.proto), the HTTP
# paths they come from, and the workers' method that answers them on the direct token path.
OPENAI_SERVICE = openai_pb2.DESCRIPTOR.services_by_name["OpenAIService"].full_name
OPENAI_COMPLETIONS = f"/{OPENAI_SERVICE}/Completions"
OPENAI_CHAT_COMPLETIONS = f"/{OPENAI_SERVICE}/ChatCompletions"
OPENAI_HTTP_PATHS = {
    OPENAI_COMPLETIONS: "/v1/completions",
    OPENAI_CHAT_COMPLETIONS: "/v1/chat/completions",
}
WORKER_GENERATE_OPENAI = (
    "/"
    + inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
    + "/GenerateOpenAI"
)
# The OpenAI route a request prepared for a worker came by: set by the gateway on the
# rewritten request, logged by the edge for the gateways' metrics (gateway/frontends/direct_log.py).
ROUTE_HEADER = "x-tokenmesh-route"
# The gateway's prefix-affinity key of a worker request (gateway/core/prefix_key.py), which Envoy's
# hashing policy places it by (worker_routing prefix).
AFFINITY_HEADER = "x-tokenmesh-affinity"
# The workers the gateway's endpoint picker chose for a worker request, best first ("IP:port,
# IP:port"): with worker_routing picker, Envoy's override-host policy sends each attempt to the
# next of them, then falls back to least request.
WORKER_HEADER = "x-tokenmesh-worker"
# Envoy's id of a request (its access log's request_id), passed on upstream: each service's RPC
# log line carries it, so a request's lines join across Envoy and the services.
REQUEST_ID_HEADER = "x-request-id"
# The worker that answered (IP:port), in the answer's headers, set by the workers' Envoy
# cluster: a gateway records its routing decision on its span; the edge keeps it in its
# metadata (EDGE_WORKER) for its access logs and removes it.
UPSTREAM_HEADER = "x-tokenmesh-upstream"
# Why the edge answered itself when the external processor answered a worker's refusal of an
# OpenAI completion (in OpenAI's shape already: the edge's OpenAI reply mappers keep it).
WORKER_REFUSED = "worker_refused"
# Where the edge keeps the caller's own content-type for the external processor (a gRPC-Web
# request's is rewritten to gRPC before it runs).
EDGE_METADATA = "tokenmesh.edge"
CALLER_CONTENT_TYPE = "content-type"
# And the worker a direct stream ended on (UPSTREAM_HEADER of the worker's answer).
EDGE_WORKER = "worker"


def usage_trailer(prompt_tokens: int, completion_tokens: int, messages: int) -> str:
    return f"{prompt_tokens} {completion_tokens} {messages}"


def parse_usage_trailer(value: str) -> tuple[int, int, int] | None:
    """(prompt tokens, completion tokens, messages); None when absent or malformed."""
    parts = value.split()
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    prompt_tokens, completion_tokens, messages = (int(part) for part in parts)
    return prompt_tokens, completion_tokens, messages


def ends_stream(token: token_pb2.Token) -> bool:
    """The stream's last message: it carries the usage of every choice."""
    return bool(token.HasField("usage"))


def token_count(token: token_pb2.Token) -> int:
    """How many generated tokens a message holds (0 for a message that only ends the stream;
    a sender that predates token_ids sends one per message)."""
    return len(token.token_ids) or int(token.token_id >= 0)


def text_lengths(token: token_pb2.Token) -> list[int]:
    """The UTF-8 bytes of text each token of the message adds."""
    if len(token.token_ids) > 1:
        return list(token.text_lengths)
    return [len(token.text.encode())] if token_count(token) else []


def merge(into: token_pb2.Token, later: token_pb2.Token) -> None:
    """Append `later`, the next message of the same choice, to `into` (which keeps its index,
    first token and warnings, and takes the later one's end and usage, if any, and emission
    time)."""
    added = token_count(later)
    if added:
        if token_count(into):
            lengths = text_lengths(into) + text_lengths(later)
            if not into.token_ids:
                into.token_ids.append(into.token_id)
            if later.HasField("logprob"):
                following = into.following_logprobs.add(top_logprobs=later.top_logprobs)
                following.logprob = later.logprob
                into.following_logprobs.extend(later.following_logprobs)
            into.token_ids.extend(later.token_ids or [later.token_id])
            del into.text_lengths[:]
            into.text_lengths.extend(lengths)
        else:
            # `into` held no token (it cannot: an end-only message is the last), so take later.
            into.CopyFrom(later)
            return
        into.text += later.text
    elif later.text:
        into.text += later.text
        if len(into.token_ids) > 1:
            into.text_lengths[-1] += len(later.text.encode())
    into.reasoning += later.reasoning
    for piece in later.tool_calls:
        last = into.tool_calls[-1] if into.tool_calls else None
        if last is not None and last.index == piece.index and not (piece.id or piece.name):
            last.arguments += piece.arguments  # the same call's arguments continue
        else:
            into.tool_calls.append(piece)
    if later.finish_reason:
        into.finish_reason = later.finish_reason
    if later.HasField("usage"):
        into.usage.CopyFrom(later.usage)
    into.emitted_unix_nanos = later.emitted_unix_nanos


def cut(token: token_pb2.Token, keep: int) -> token_pb2.Token:
    """The message's first `keep` tokens (1 <= keep < its token count), with their text."""
    cut_short = token_pb2.Token()
    cut_short.CopyFrom(token)
    lengths = text_lengths(token)
    cut_short.text = token.text.encode()[: sum(lengths[:keep])].decode(errors="ignore")
    del cut_short.token_ids[keep:]
    del cut_short.following_logprobs[keep - 1 :]
    del cut_short.text_lengths[:]
    if keep > 1:
        cut_short.text_lengths.extend(lengths[:keep])
    cut_short.ClearField("finish_reason")
    cut_short.ClearField("usage")
    return cut_short
