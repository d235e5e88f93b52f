/* tokenmesh_relay: the edge's relay of a worker's token stream, as an Envoy HTTP filter in a
   dynamic module (envoy/relay/README.md). It replaces the router for a route to the workers: it
   sends the prepared request to the worker cluster as a stream of its own, passes the
   worker's headers, whole gRPC messages and trailers to the caller, and keeps what a move
   needs of each delivered message. When the worker goes away mid-stream (its stream reset, or UNAVAILABLE in
   its trailers) it sends the request again with what was delivered appended to its bytes
   (InferenceRequest.delivered_messages, field 12; resume.attempt, field 11.2), so another
   worker continues from the token where the stream stopped. It decodes no message (a
   serialized message followed by more fields is the message with those fields merged in); it
   walks a message's tags once (walk) to keep only the fields a move needs and to see the
   stream's last message (after it nothing is moved or parked).

   A caller that reads slower than the worker writes: what the caller's connection cannot take
   is to wait here, up to max_held_bytes; past that the worker's stream is cancelled (its
   engine request aborted) and continued the same way once the caller has read ("parked"; not
   counted as a move). What the caller cannot take is held first by Envoy's HTTP/2 codec, up
   to the stream's window (initial_stream_window_size), before Envoy calls the watermark
   hooks.

   Config (the filter's StringValue): "cluster=worker;pool_header=x-tokenmesh-pool;
   max_resumptions=2;max_retries=100;retry_ms=2000;max_held_bytes=4194304;
   send_batch_bytes=16384;max_delivered_bytes=16777216;timeout_ms=600000", each optional. A
   request whose pool_header names a pool goes to the cluster "<cluster>-<pool>"
   (common/pools.py), any other to cluster. A stream whose messages outgrow
   max_delivered_bytes is relayed on but no longer kept: it cannot move. */
#include "abi.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_HEADERS 64
#define GRPC_UNAVAILABLE "14"
/* Why a stream moved, as the metrics label it (common/resumption.py's causes). */
#define CAUSE_RESET "stream_reset"
#define CAUSE_UNAVAILABLE "worker_unavailable"
/* The workers' cluster names the worker that answered in this header (meshconfig's
   names_upstream_host; the edge removes it for callers); the relay's dynamic metadata. */
#define UPSTREAM_HEADER "x-tokenmesh-upstream"
#define METADATA "tokenmesh.relay"

typedef struct {
  char *p;
  size_t n, cap;
} bytes;

/* Grows by doubling while small, then by a quarter: what a buffer allocates stays close to
   what it holds (a stream parked with a window held costs that window, not twice it). */
static void bytes_add(bytes *b, const void *p, size_t n) {
  if (b->n + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n) cap += cap < 16384 ? cap : cap / 4;
    char *grown = realloc(b->p, cap);
    if (!grown) abort(); /* out of memory: nothing sensible is left to do */
    b->p = grown;
    b->cap = cap;
  }
  if (n) memcpy(b->p + b->n, p, n);
  b->n += n;
}

static void bytes_free(bytes *b) {
  free(b->p);
  b->p = NULL;
  b->n = b->cap = 0;
}

/* Drops what b has read (the first used bytes), keeping the rest; its memory goes back once
   it is empty, so an idle or parked stream holds none between the worker's data. */
static void bytes_consume(bytes *b, size_t used) {
  if (used >= b->n) {
    bytes_free(b);
    return;
  }
  memmove(b->p, b->p + used, b->n - used);
  b->n -= used;
}

static uint64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

/* A protobuf varint; returns its length (at most 10 bytes). */
static size_t varint(unsigned char *out, uint64_t value) {
  size_t n = 0;
  while (value >= 0x80) {
    out[n++] = (unsigned char)(value | 0x80);
    value >>= 7;
  }
  out[n++] = (unsigned char)value;
  return n;
}

/* Reads a varint at *p (below end), moving *p past it; 0 when it runs past end. */
static int read_varint(const unsigned char **p, const unsigned char *end, uint64_t *value) {
  *value = 0;
  for (int shift = 0; *p < end && shift < 64; shift += 7) {
    unsigned char b = *(*p)++;
    *value |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) return 1;
  }
  return 0;
}

/* One field of a message at *p (below end): its number and, when it is length-delimited, its
   bytes (*value, *length; *value is NULL for the others); *p moves past it. 0 when malformed. */
static int next_field(const unsigned char **p, const unsigned char *end, uint64_t *number,
                      const unsigned char **value, uint64_t *length) {
  uint64_t key;
  *value = NULL;
  *length = 0;
  if (!read_varint(p, end, &key)) return 0;
  *number = key >> 3;
  switch (key & 7) {
    case 0: return read_varint(p, end, length);
    case 1: if (end - *p < 8) return 0; *p += 8; return 1;
    case 5: if (end - *p < 4) return 0; *p += 4; return 1;
    case 2:
      if (!read_varint(p, end, length) || *length > (uint64_t)(end - *p)) return 0;
      *value = *p;
      *p += *length;
      return 1;
    default: return 0;
  }
}

/* Walks a delivered message's fields once: appends to out (unless NULL) what a move needs
   (common/resumption.Delivered.add) -- of a Token its token_id (3), finish_reason (4), usage
   (7), token_ids (10) and choice (13), as they came; of a GenerateOpenAI part (RelayedPart)
   that of its Token (15) alone -- and sets *last when it is the stream's last message (a
   Token with its usage, which the worker sets on the last message only). The text, logprobs
   and the part's body stay behind: a stream keeps a few bytes a token, not its answer's
   size. 0 for a message that is not one. */
static int walk(bytes *out, const unsigned char *p, size_t n, int part, int *last) {
  const unsigned char *end = p + n, *value;
  uint64_t number, length;
  while (p < end) {
    const unsigned char *field = p;
    if (!next_field(&p, end, &number, &value, &length)) return 0;
    if (part && number == 15 && value) {
      if (!out) {
        if (!walk(NULL, value, (size_t)length, 0, last)) return 0;
        continue;
      }
      bytes token = {0};
      int ok = walk(&token, value, (size_t)length, 0, last);
      unsigned char head[11] = {0x7a}; /* field 15, length-delimited */
      size_t h = 1 + varint(head + 1, token.n);
      if (ok) bytes_add(out, head, h);
      if (ok && token.n) bytes_add(out, token.p, token.n);
      bytes_free(&token);
      if (!ok) return 0;
    } else if (!part &&
               (number == 3 || number == 4 || number == 7 || number == 10 || number == 13)) {
      if (number == 7 && value) *last = 1;
      if (out) bytes_add(out, field, (size_t)(p - field));
    }
  }
  return 1;
}

/* A pool's name as common/pools.py allows it: a DNS label of at most 32 characters. */
#define MAX_POOL 32

typedef struct {
  char cluster[128];
  char pool_header[64]; /* the header naming a request's pool; empty: every request to cluster */
  int max_resumptions;
  int max_retries;
  uint64_t retry_ms;
  size_t max_held_bytes;
  size_t send_batch_bytes; /* the most sent on before the caller's watermark is read again */
  size_t max_delivered_bytes;
  uint64_t timeout_ms;
  int metrics; /* Envoy defined the metrics below */
  size_t resumed, refused, parks, gap_ms;
} config;

typedef struct {
  dm_envoy envoy;
  const config *cfg;
  dm_hdr headers[MAX_HEADERS]; /* the request's headers, pointing into header_bytes */
  size_t header_count;
  bytes header_bytes;
  bytes request;     /* the request's body as it came: one gRPC message */
  int openai;        /* GenerateOpenAI: its parts carry their Token (OpenAIAnswer.relayed) */
  bytes delivered;   /* what a move needs of every message sent to the caller, as the next
                        request's delivered_messages fields (field 12 each) */
  bytes scratch;     /* one message's kept fields, on their way into delivered */
  int unresumable;   /* delivered outgrew max_delivered_bytes: no longer kept */
  size_t messages;   /* how many */
  bytes partial;     /* the current worker's bytes of a message not yet whole */
  bytes held;        /* whole messages the caller's connection cannot take yet */
  uint64_t stream;   /* the worker stream (valid while live) */
  int live, headers_sent, done, above_watermark;
  int parking;       /* the worker's stream is to be cancelled (EVENT_PARK is posted) */
  int parked;        /* it was: the next one starts once the caller has read */
  int moves;         /* times the stream went on at another worker */
  int parks;         /* times its worker's stream was parked */
  int discarded;     /* while parking, the current worker's messages were dropped, not held */
  char worker[64];   /* the address of the worker that answered last (its cluster names it) */
  int retries;       /* worker streams that failed before their worker answered */
  uint64_t first_retry_ms; /* when the first of those failed (a monotonic clock) */
  int answered;      /* the current worker stream's worker answered (headers, not the end) */
  void *scheduler;   /* posts the next worker stream to a later turn of Envoy's event loop */
  uint64_t deadline_ms;    /* the caller's deadline (grpc-timeout), monotonic; 0: none */
  char timeout_value[24];  /* a moved stream's grpc-timeout: what is left of the caller's */
  dm_hdr *timeout_header;  /* the request's grpc-timeout among headers, if it has one */
  int named;               /* the index of x-tokenmesh-worker among headers; -1: none */
  uint64_t last_message_ms; /* when the last message went to the caller */
  int gap_pending;          /* a move is under way: the next message ends its gap */
  int last_seen;            /* the stream's last message came (walk): nothing is left
                               to generate, only the worker's trailers to come */
  char cluster[128 + 1 + MAX_POOL]; /* the cluster of the request's pool */
} filter;

/* What the filter posts to a later turn of Envoy's event loop (the filter scheduler). Never
   from inside one of Envoy's callbacks: Envoy crashed (SIGSEGV) when the filter sent the
   caller data from inside its low-watermark callback. */
enum { EVENT_NEXT_WORKER = 1, EVENT_PARK = 2, EVENT_DRAINED = 3 };

static void post(filter *f, uint64_t event) {
  if (!f->scheduler)
    f->scheduler = envoy_dynamic_module_callback_http_filter_scheduler_new(f->envoy);
  envoy_dynamic_module_callback_http_filter_scheduler_commit(f->scheduler, event);
}

/* ---- configuration ---------------------------------------------------------------------- */

const char *envoy_dynamic_module_on_program_init(void) { return "v0.2.0"; }

static void parse_config(config *c, const char *s, size_t n) {
  char text[1024];
  if (n >= sizeof text) n = sizeof text - 1;
  memcpy(text, s, n);
  text[n] = 0;
  snprintf(c->cluster, sizeof c->cluster, "worker");
  c->pool_header[0] = 0;
  c->max_resumptions = 2;
  c->max_retries = 100;
  c->retry_ms = 2000;
  c->max_held_bytes = 4u << 20;
  c->send_batch_bytes = 16384;
  c->max_delivered_bytes = 16u << 20;
  c->timeout_ms = 600000;
  char *save = NULL;
  for (char *item = strtok_r(text, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
    char *eq = strchr(item, '=');
    if (!eq) continue;
    *eq = 0;
    const char *value = eq + 1;
    if (!strcmp(item, "cluster")) snprintf(c->cluster, sizeof c->cluster, "%s", value);
    else if (!strcmp(item, "pool_header"))
      snprintf(c->pool_header, sizeof c->pool_header, "%s", value);
    else if (!strcmp(item, "max_resumptions")) c->max_resumptions = atoi(value);
    else if (!strcmp(item, "max_retries")) c->max_retries = atoi(value);
    else if (!strcmp(item, "retry_ms")) c->retry_ms = strtoull(value, NULL, 10);
    else if (!strcmp(item, "max_held_bytes")) c->max_held_bytes = strtoull(value, NULL, 10);
    else if (!strcmp(item, "send_batch_bytes")) c->send_batch_bytes = strtoull(value, NULL, 10);
    else if (!strcmp(item, "max_delivered_bytes"))
      c->max_delivered_bytes = strtoull(value, NULL, 10);
    else if (!strcmp(item, "timeout_ms")) c->timeout_ms = strtoull(value, NULL, 10);
  }
}

const void *envoy_dynamic_module_on_http_filter_config_new(void *envoy, dm_buf name, dm_buf text) {
  (void)name;
  config *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  parse_config(c, text.ptr, text.length);
  /* Envoy's own stats (its /stats/prometheus): moves by cause, streams that could not move by
     why, parks, and the gap a moved stream's caller saw. */
  dm_buf cause = {"cause", 5}, reason = {"reason", 6};
  c->metrics =
      envoy_dynamic_module_callback_http_filter_config_define_counter(
          envoy, (dm_buf){"tokenmesh_relay_resumptions", 27}, &cause, 1, &c->resumed) == 0 &&
      envoy_dynamic_module_callback_http_filter_config_define_counter(
          envoy, (dm_buf){"tokenmesh_relay_resumptions_refused", 35}, &reason, 1, &c->refused) ==
          0 &&
      envoy_dynamic_module_callback_http_filter_config_define_counter(
          envoy, (dm_buf){"tokenmesh_relay_parks", 21}, NULL, 0, &c->parks) == 0 &&
      envoy_dynamic_module_callback_http_filter_config_define_histogram(
          envoy, (dm_buf){"tokenmesh_relay_resumption_gap_ms", 33}, NULL, 0, &c->gap_ms) == 0;
  return c;
}

static void count(filter *f, size_t id, const char *label) {
  if (!f->cfg->metrics) return;
  dm_buf value = {label, label ? strlen(label) : 0};
  envoy_dynamic_module_callback_http_filter_increment_counter(f->envoy, id, label ? &value : NULL,
                                                              label ? 1 : 0, 1);
}
void envoy_dynamic_module_on_http_filter_config_destroy(const void *c) { free((void *)c); }
/* A route enables the filter (the mesh's edge: on the routes to the workers) with a per-route
   config that carries nothing: Envoy needs one, and refuses a NULL. */
const void *envoy_dynamic_module_on_http_filter_per_route_config_new(dm_buf n, dm_buf c) {
  static const char enabled = 1;
  (void)n;
  (void)c;
  return &enabled;
}
void envoy_dynamic_module_on_http_filter_per_route_config_destroy(const void *c) { (void)c; }

/* ---- the filter's life ------------------------------------------------------------------ */

const void *envoy_dynamic_module_on_http_filter_new(const void *cfg, dm_envoy envoy) {
  filter *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  f->named = -1;
  f->envoy = envoy;
  f->cfg = (const config *)cfg;
  return f;
}

void envoy_dynamic_module_on_http_filter_destroy(const void *p) {
  filter *f = (filter *)p;
  if (f->scheduler) envoy_dynamic_module_callback_http_filter_scheduler_delete(f->scheduler);
  bytes_free(&f->header_bytes);
  bytes_free(&f->request);
  bytes_free(&f->delivered);
  bytes_free(&f->scratch);
  bytes_free(&f->partial);
  bytes_free(&f->held);
  free(f);
}

/* The caller's stream ended (done, or the caller went away): the worker's stream ends too,
   which aborts its engine request. */
void envoy_dynamic_module_on_http_filter_stream_complete(dm_envoy envoy, const void *p) {
  filter *f = (filter *)p;
  f->done = 1;
  /* For the relay listener's access log, which Envoy writes after this: the worker the
     stream ended on, and how often it moved and was parked (dynamic metadata). */
  dm_buf ns = {METADATA, strlen(METADATA)};
  if (f->worker[0])
    envoy_dynamic_module_callback_http_set_dynamic_metadata_string(
        envoy, ns, (dm_buf){"worker", 6}, (dm_buf){f->worker, strlen(f->worker)});
  envoy_dynamic_module_callback_http_set_dynamic_metadata_number(envoy, ns, (dm_buf){"moves", 5},
                                                                 f->moves);
  envoy_dynamic_module_callback_http_set_dynamic_metadata_number(envoy, ns, (dm_buf){"parks", 5},
                                                                 f->parks);
  if (f->live) {
    f->live = 0;
    envoy_dynamic_module_callback_http_filter_reset_http_stream(envoy, f->stream);
  }
}

/* The worker's stream is over (cancelled, or it ended with messages the caller was not sent):
   the stream goes on from what was delivered once the caller has read, or at once if it has. */
static void park(filter *f) {
  f->parking = 0;
  f->live = 0;
  f->parked = 1;
  f->parks++;
  bytes_free(&f->partial); /* what was not whole of the cancelled stream is not delivered */
  count(f, f->cfg->parks, NULL);
  if (!f->above_watermark) post(f, EVENT_DRAINED);
}

/* ---- towards the caller ----------------------------------------------------------------- */

/* Envoy keeps each piece a filter sends as a slice of whole 4 KiB pages, and moves it whole
   into the HTTP/2 codec's buffer, which copies only pieces under 512 bytes into the slice
   before them (Buffer::OwnedImpl); the frames the edge takes from the relay's listener are
   kept the same way. A stalled caller's window of 1 KB messages so cost 4 KiB a message in
   each of those buffers (16 streams of 64 KiB stalled: Envoy grew 6.5 MB with 1 KB messages
   against 3.2 MB with 0.3 KB ones, the same 1.05 MB waiting to be sent). So whole pages go
   whole, and the rest in pieces under 512 bytes, which every buffer on the way copies. */
#define PAGE 4096
#define COPIED 511

static void send_data(filter *f, const char *p, size_t n, bool end) {
  size_t pages = n / PAGE * PAGE;
  if (pages) {
    envoy_dynamic_module_callback_http_send_response_data(f->envoy, (dm_buf){p, pages},
                                                          end && pages == n);
  }
  for (size_t at = pages; at < n;) {
    size_t piece = n - at > COPIED ? COPIED : n - at;
    envoy_dynamic_module_callback_http_send_response_data(f->envoy, (dm_buf){p + at, piece},
                                                          end && at + piece == n);
    at += piece;
  }
  if (!n && end)
    envoy_dynamic_module_callback_http_send_response_data(f->envoy, (dm_buf){p, 0}, true);
}

/* Sends the caller what was held (end: and ends its body), and frees it. */
static void send_held(filter *f, bool end) {
  if (f->held.n || end) send_data(f, f->held.p, f->held.n, end);
  bytes_free(&f->held);
}

static void end_with(filter *f, const char *status, const char *message) {
  f->done = 1;
  dm_hdr trailers[] = {{"grpc-status", 11, status, strlen(status)},
                       {"grpc-message", 12, message, strlen(message)}};
  if (!f->headers_sent) {
    f->headers_sent = 1;
    dm_hdr h[] = {{":status", 7, "200", 3},
                  {"content-type", 12, "application/grpc", 16},
                  trailers[0],
                  trailers[1]};
    envoy_dynamic_module_callback_http_send_response_headers(f->envoy, h, 4, true);
    return;
  }
  send_held(f, false);
  envoy_dynamic_module_callback_http_send_response_trailers(f->envoy, trailers, 2);
}

static void send_or_hold(filter *f, const char *p, size_t n) {
  if (f->above_watermark || f->held.n) {
    bytes_add(&f->held, p, n);
    return;
  }
  send_data(f, p, n, false);
}

/* ---- towards the workers ---------------------------------------------------------------- */

/* The request for the next worker: the request's message with the delivered messages (and the
   move's count, and for GenerateOpenAI the relayed mark) appended as fields, framed again. */
static void next_request(filter *f, bytes *out) {
  static const unsigned char relayed[] = {0x32, 0x02, 0x48, 0x01}; /* openai { relayed: true } */
  bytes payload = {0};
  bytes_add(&payload, f->request.p + 5, f->request.n - 5);
  if (f->openai) bytes_add(&payload, relayed, sizeof relayed);
  bytes_add(&payload, f->delivered.p, f->delivered.n);
  if (f->moves) {
    unsigned char attempt[14] = {0x5a, 0, 0x10}; /* resume { attempt: moves } */
    size_t v = varint(attempt + 3, (uint64_t)f->moves);
    attempt[1] = (unsigned char)(1 + v);
    bytes_add(&payload, attempt, 3 + v);
  }
  unsigned char frame[5] = {0, (unsigned char)(payload.n >> 24), (unsigned char)(payload.n >> 16),
                            (unsigned char)(payload.n >> 8), (unsigned char)payload.n};
  out->n = 0;
  bytes_add(out, frame, 5);
  bytes_add(out, payload.p, payload.n);
  bytes_free(&payload);
}

static void start_worker_stream(filter *f) {
  if (f->timeout_header && (f->messages || f->retries)) {
    /* The stream goes on within what is left of the caller's deadline. */
    uint64_t now = now_ms();
    if (now >= f->deadline_ms) {
      count(f, f->cfg->refused, "deadline");
      end_with(f, "4", "relay: the caller's deadline passed before the stream could go on");
      return;
    }
    int n = snprintf(f->timeout_value, sizeof f->timeout_value, "%llum",
                     (unsigned long long)(f->deadline_ms - now));
    f->timeout_header->v = f->timeout_value;
    f->timeout_header->vl = (size_t)n;
  }
  bytes body = {0};
  if (f->messages || f->openai) next_request(f, &body);
  else bytes_add(&body, f->request.p, f->request.n);
  bytes_free(&f->partial);
  f->answered = 0;
  f->discarded = 0;
  f->parking = 0;
  dm_buf cluster = {f->cluster, strlen(f->cluster)};
  uint64_t id = 0;
  int started = envoy_dynamic_module_callback_http_filter_start_http_stream(
      f->envoy, &id, cluster, f->headers, f->header_count, (dm_buf){body.p, body.n}, true,
      f->cfg->timeout_ms);
  bytes_free(&body);
  if (started != INIT_OK) {
    end_with(f, GRPC_UNAVAILABLE, "relay: no worker stream could be started");
    return;
  }
  f->stream = id;
  f->live = 1;
}

/* The next worker the gateway named (x-tokenmesh-worker: "host:port,host:port", best first;
   Envoy's override-host policy takes the first): the one that failed leaves the list, and with
   the last one the header goes, so the cluster's own balancing picks among healthy workers. */
static void next_named_worker(filter *f) {
  if (f->named < 0) return;
  dm_hdr *h = &f->headers[f->named];
  const char *comma = memchr(h->v, ',', h->vl);
  if (comma) {
    size_t skip = (size_t)(comma + 1 - h->v);
    h->v += skip;
    h->vl -= skip;
    while (h->vl && *h->v == ' ') h->v++, h->vl--;
    return;
  }
  dm_hdr *last = &f->headers[--f->header_count];
  if (f->timeout_header == last) f->timeout_header = h;
  *h = *last;
  f->named = -1;
}

/* The worker's stream failed: reset, Envoy's own reply (no worker answered), or UNAVAILABLE.
   A stream whose worker had answered and delivered something goes on at another worker (a
   move, at most max_resumptions); one whose attempt failed before its worker answered is
   tried again as it was. `why` is the caller's message when it cannot go on. */
static void worker_failed(filter *f, const char *why, const char *cause) {
  f->live = 0;
  if (f->done) return;
  if (f->last_seen) {
    /* Gone after the stream's last message (its trailers lost): the caller has every token
       and the usage (an OpenAI answer's last part holds its usage chunk and [DONE] too). */
    end_with(f, "0", "");
    return;
  }
  if (f->answered && f->messages) {
    if (f->unresumable) {
      count(f, f->cfg->refused, "unkept");
      char message[256];
      snprintf(message, sizeof message,
               "worker: went away after %zu messages (%s); the stream cannot move: its "
               "messages passed the relay's max_delivered_bytes (%zu)",
               f->messages, why, f->cfg->max_delivered_bytes);
      end_with(f, GRPC_UNAVAILABLE, message);
      return;
    }
    if (f->moves >= f->cfg->max_resumptions) {
      count(f, f->cfg->refused, "limit");
      char message[256];
      snprintf(message, sizeof message,
               "worker: went away after %zu messages (%s); the stream moved %d times already",
               f->messages, why, f->moves);
      end_with(f, GRPC_UNAVAILABLE, message);
      return;
    }
    f->moves++;
    f->gap_pending = 1;
    count(f, f->cfg->resumed, cause);
  } else {
    /* Envoy may pick the worker that just failed again until its ejection (outlier detection,
       on the main thread) reaches this worker thread: retried on later turns of the event
       loop, within retry_ms and max_retries. */
    uint64_t now = now_ms();
    if (!f->retries++) f->first_retry_ms = now;
    if (f->retries > f->cfg->max_retries || now - f->first_retry_ms > f->cfg->retry_ms) {
      end_with(f, GRPC_UNAVAILABLE, why);
      return;
    }
  }
  /* By the next turn of the event loop Envoy has taken the failed worker out (outlier
     detection) and closed its connection. */
  next_named_worker(f);
  post(f, EVENT_NEXT_WORKER);
}

/* ---- the request ------------------------------------------------------------------------ */

static int ends_with(const dm_hdr *h, const char *suffix) {
  size_t l = strlen(suffix);
  return h->vl >= l && !memcmp(h->v + h->vl - l, suffix, l);
}

static int named(const dm_hdr *h, const char *name) {
  size_t l = strlen(name);
  return h->kl == l && !memcmp(h->k, name, l);
}

/* A grpc-timeout header's value (digits and a unit: H, M, S, m, u, n) in milliseconds, at
   least 1. */
static uint64_t grpc_timeout_ms(const dm_hdr *h) {
  uint64_t n = 0;
  size_t i = 0;
  for (; i < h->vl && h->v[i] >= '0' && h->v[i] <= '9'; i++) n = n * 10 + (uint64_t)(h->v[i] - '0');
  char unit = i < h->vl ? h->v[i] : 'S';
  uint64_t ms = unit == 'H'   ? n * 3600000u
                : unit == 'M' ? n * 60000u
                : unit == 'S' ? n * 1000u
                : unit == 'm' ? n
                : unit == 'u' ? n / 1000u
                              : n / 1000000u;
  return ms ? ms : 1;
}

/* A pool's name: lower-case letters, digits and '-', neither first nor last, 1 to MAX_POOL. */
static int pool_name(const dm_hdr *h) {
  if (!h->vl || h->vl > MAX_POOL || h->v[0] == '-' || h->v[h->vl - 1] == '-') return 0;
  for (size_t i = 0; i < h->vl; i++) {
    char c = h->v[i];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return 0;
  }
  return 1;
}

static void request_complete(filter *f) {
  if (f->request.n < 5) {
    end_with(f, "13", "relay: the request has no gRPC message");
    return;
  }
  start_worker_stream(f);
}

int envoy_dynamic_module_on_http_filter_request_headers(dm_envoy envoy, const void *p, bool end) {
  filter *f = (filter *)p;
  size_t n = envoy_dynamic_module_callback_http_get_headers_size(envoy, HT_REQ_HDR);
  dm_hdr found[MAX_HEADERS * 2];
  if (n > MAX_HEADERS * 2) n = MAX_HEADERS * 2;
  envoy_dynamic_module_callback_http_get_headers(envoy, HT_REQ_HDR, found);
  size_t total = 0;
  for (size_t i = 0; i < n; i++) total += found[i].kl + found[i].vl;
  f->header_bytes.p = malloc(total ? total : 1); /* one block: the pointers below stay valid */
  if (!f->header_bytes.p) abort();
  f->header_bytes.cap = total ? total : 1;
  snprintf(f->cluster, sizeof f->cluster, "%s", f->cfg->cluster);
  for (size_t i = 0; i < n && f->header_count < MAX_HEADERS; i++) {
    if (found[i].kl > 8 && !memcmp(found[i].k, "x-envoy-", 8)) continue;
    if (named(&found[i], ":path") && ends_with(&found[i], "/GenerateOpenAI")) f->openai = 1;
    if (named(&found[i], "x-tokenmesh-worker")) f->named = (int)f->header_count;
    if (f->cfg->pool_header[0] && named(&found[i], f->cfg->pool_header) && pool_name(&found[i]))
      snprintf(f->cluster, sizeof f->cluster, "%s-%.*s", f->cfg->cluster, (int)found[i].vl,
               found[i].v);
    if (named(&found[i], "grpc-timeout")) {
      f->timeout_header = &f->headers[f->header_count];
      f->deadline_ms = now_ms() + grpc_timeout_ms(&found[i]);
    }
    char *k = f->header_bytes.p + f->header_bytes.n;
    memcpy(k, found[i].k, found[i].kl);
    f->header_bytes.n += found[i].kl;
    char *v = f->header_bytes.p + f->header_bytes.n;
    memcpy(v, found[i].v, found[i].vl);
    f->header_bytes.n += found[i].vl;
    f->headers[f->header_count++] = (dm_hdr){k, found[i].kl, v, found[i].vl};
  }
  if (end) request_complete(f);
  return HDRS_STOP;
}

int envoy_dynamic_module_on_http_filter_request_body(dm_envoy envoy, const void *p, bool end) {
  filter *f = (filter *)p;
  size_t n = envoy_dynamic_module_callback_http_get_body_chunks_size(envoy, BODY_RECEIVED_REQ);
  if (n) {
    dm_buf chunks[n];
    if (envoy_dynamic_module_callback_http_get_body_chunks(envoy, BODY_RECEIVED_REQ, chunks))
      for (size_t i = 0; i < n; i++) bytes_add(&f->request, chunks[i].ptr, chunks[i].length);
  }
  if (end) request_complete(f);
  return BODY_STOP_NOBUFFER;
}

int envoy_dynamic_module_on_http_filter_request_trailers(dm_envoy envoy, const void *p) {
  (void)envoy;
  request_complete((filter *)p);
  return TRL_STOP;
}

int envoy_dynamic_module_on_http_filter_response_headers(dm_envoy e, const void *p, bool end) {
  (void)e;
  (void)p;
  (void)end;
  return HDRS_CONTINUE;
}
int envoy_dynamic_module_on_http_filter_response_body(dm_envoy e, const void *p, bool end) {
  (void)e;
  (void)p;
  (void)end;
  return BODY_CONTINUE;
}
int envoy_dynamic_module_on_http_filter_response_trailers(dm_envoy e, const void *p) {
  (void)e;
  (void)p;
  return TRL_CONTINUE;
}
int envoy_dynamic_module_on_http_filter_local_reply(dm_envoy e, const void *p, uint32_t code,
                                                    dm_buf details, bool reset) {
  (void)e;
  (void)p;
  (void)code;
  (void)details;
  (void)reset;
  return 0;
}

/* ---- the worker's stream ---------------------------------------------------------------- */

static const dm_hdr *header(dm_hdr *h, size_t n, const char *name) {
  for (size_t i = 0; i < n; i++)
    if (named(&h[i], name)) return &h[i];
  return NULL;
}

static int is(const dm_hdr *h, const char *value) {
  return h && h->vl == strlen(value) && !memcmp(h->v, value, h->vl);
}

void envoy_dynamic_module_on_http_filter_http_stream_headers(dm_envoy envoy, const void *p,
                                                             uint64_t id, dm_hdr *h, size_t n,
                                                             bool end) {
  filter *f = (filter *)p;
  if (id != f->stream || !f->live || f->done) return;
  const dm_hdr *status = header(h, n, ":status");
  const dm_hdr *grpc_status = header(h, n, "grpc-status");
  if (!is(status, "200")) {
    /* Envoy's own reply (no healthy worker, a connection that failed): not the worker's. Its
       body is ignored (the stream is no longer live) as it ends. */
    worker_failed(f, "relay: no worker answered", CAUSE_RESET);
    return;
  }
  if (end && is(grpc_status, GRPC_UNAVAILABLE)) {
    /* Envoy's reply when it reached no worker, or a worker without its engine. */
    worker_failed(f, "worker: unavailable", CAUSE_UNAVAILABLE);
    return;
  }
  if (!end) f->answered = 1;
  const dm_hdr *upstream = header(h, n, UPSTREAM_HEADER);
  if (upstream && upstream->vl < sizeof f->worker) {
    memcpy(f->worker, upstream->v, upstream->vl);
    f->worker[upstream->vl] = 0;
  }
  if (end && f->moves && header(h, n, "grpc-status") && !is(grpc_status, "0")) {
    /* The next worker refused to continue the stream (what it cannot carry over). */
    count(f, f->cfg->refused, "request");
    const dm_hdr *m = header(h, n, "grpc-message");
    char message[512];
    snprintf(message, sizeof message,
             "worker: went away after %zu messages, and the stream cannot continue on "
             "another worker: %.*s",
             f->messages, m ? (int)m->vl : 0, m ? m->v : "");
    f->live = 0;
    end_with(f, GRPC_UNAVAILABLE, message);
    return;
  }
  if (end) f->live = 0;
  if (!f->headers_sent) {
    f->headers_sent = 1;
    if (end) f->done = 1;
    envoy_dynamic_module_callback_http_send_response_headers(envoy, h, n, end);
  } else if (end) {
    /* A later worker's trailers-only answer: the caller has headers already. */
    dm_hdr t[MAX_HEADERS];
    size_t k = 0;
    for (size_t i = 0; i < n && k < MAX_HEADERS; i++)
      if (h[i].kl && h[i].k[0] != ':' && !named(&h[i], "content-type")) t[k++] = h[i];
    f->done = 1;
    envoy_dynamic_module_callback_http_send_response_trailers(envoy, t, k);
  }
}

/* Keeps what a move needs of a delivered message (walk; the whole message if it is not one,
   for the worker to name), as a delivered_messages field of the next request, within
   max_delivered_bytes; sets f->last_seen at the stream's last message. */
static void keep(filter *f, const unsigned char *message, size_t n) {
  int last = 0;
  if (f->unresumable) {
    walk(NULL, message, n, f->openai, &last);
  } else {
    f->scratch.n = 0;
    if (!walk(&f->scratch, message, n, f->openai, &last)) {
      f->scratch.n = 0;
      bytes_add(&f->scratch, message, n);
    }
    unsigned char head[11] = {0x62}; /* field 12, length-delimited */
    size_t h = 1 + varint(head + 1, f->scratch.n);
    if (f->delivered.n + h + f->scratch.n > f->cfg->max_delivered_bytes) {
      f->unresumable = 1; /* too long to keep: a failure from here on ends the stream */
      bytes_free(&f->delivered);
    } else {
      bytes_add(&f->delivered, head, h);
      bytes_add(&f->delivered, f->scratch.p, f->scratch.n);
    }
  }
  if (last) f->last_seen = 1;
}

void envoy_dynamic_module_on_http_filter_http_stream_data(dm_envoy envoy, const void *p,
                                                          uint64_t id, const dm_buf *data,
                                                          size_t count, bool end) {
  filter *f = (filter *)p;
  if (id != f->stream || !f->live || f->done) return;
  for (size_t i = 0; i < count; i++) bytes_add(&f->partial, data[i].ptr, data[i].length);
  /* Whole gRPC messages only: 1 byte flags, 4 bytes big-endian length, the message. Bytes of
     whole messages read; of those, the ones for the caller (a prefix: what a park drops comes
     after), and of those the ones already sent or held. */
  size_t whole = 0, passed = 0, routed = 0;
  while (f->partial.n - whole >= 5) {
    const unsigned char *q = (const unsigned char *)f->partial.p + whole;
    size_t len = ((size_t)q[1] << 24) | ((size_t)q[2] << 16) | ((size_t)q[3] << 8) | q[4];
    if (f->partial.n - whole < 5 + len) break;
    whole += 5 + len;
    if (f->parking && !f->unresumable) {
      /* The caller cannot take it and the worker's stream is being parked: not delivered,
         not held (a stalled caller costs the relay at most max_held_bytes); the stream goes
         on from what was delivered, and the next worker makes these again. */
      f->discarded = 1;
      continue;
    }
    keep(f, q + 5, len);
    f->messages++;
    passed = whole;
    if (passed - routed >= f->cfg->send_batch_bytes) {
      /* What Envoy hands over at once (a frame, or what it buffered for the stream) goes on
         a batch at a time: Envoy raises the caller's watermark while a batch goes in, so
         what follows is held, and past max_held_bytes dropped, instead of passing whole a
         caller that cannot take it. */
      send_or_hold(f, f->partial.p + routed, passed - routed);
      routed = passed;
      if (f->done || !f->live) return; /* the send ended the caller's stream */
    }
    if ((f->above_watermark || f->held.n) &&
        f->held.n + (passed - routed) > f->cfg->max_held_bytes && !f->parking &&
        !f->last_seen && !f->unresumable) {
      /* The caller reads too slowly: cancel the worker's stream, continue once it has read.
         Not once the last message came: the engine is done, and a stream continued with
         nothing left to generate would be refused. */
      f->parking = 1;
      post(f, EVENT_PARK);
    }
  }
  if (passed) {
    uint64_t now = now_ms();
    if (f->gap_pending && f->cfg->metrics)
      envoy_dynamic_module_callback_http_filter_record_histogram_value(
          envoy, f->cfg->gap_ms, NULL, 0, now - f->last_message_ms);
    f->gap_pending = 0;
    f->last_message_ms = now;
  }
  if (passed > routed) send_or_hold(f, f->partial.p + routed, passed - routed);
  bytes_consume(&f->partial, whole);
  if (end && f->discarded) {
    park(f); /* the worker is done, but what it made last never reached the caller */
    return;
  }
  if (end) {
    f->live = 0;
    f->done = 1;
    send_held(f, true);
    return;
  }
  if (f->unresumable && f->held.n > f->cfg->max_held_bytes && !f->last_seen) {
    /* It could not go on elsewhere: it ends, and its worker stream with it. */
    f->parking = 1;
    post(f, EVENT_PARK);
    end_with(f, "8", "relay: the caller reads too slowly, and the stream is too long to "
                     "hold back (max_held_bytes, max_delivered_bytes)");
  }
}

void envoy_dynamic_module_on_http_filter_http_stream_trailers(dm_envoy envoy, const void *p,
                                                              uint64_t id, dm_hdr *t, size_t n) {
  filter *f = (filter *)p;
  if (id != f->stream || !f->live || f->done) return;
  f->live = 0;
  if (is(header(t, n, "grpc-status"), GRPC_UNAVAILABLE)) {
    worker_failed(f, "worker: unavailable", CAUSE_UNAVAILABLE);
    return;
  }
  if (f->discarded) {
    park(f); /* its last messages never reached the caller: it goes on from the delivered */
    return;
  }
  send_held(f, false);
  f->done = 1;
  envoy_dynamic_module_callback_http_send_response_trailers(envoy, t, n);
}

void envoy_dynamic_module_on_http_filter_http_stream_complete(dm_envoy e, const void *p,
                                                              uint64_t id) {
  (void)e;
  filter *f = (filter *)p;
  if (id == f->stream) f->live = 0;
}

void envoy_dynamic_module_on_http_filter_http_stream_reset(dm_envoy e, const void *p, uint64_t id,
                                                           int reason) {
  (void)e;
  filter *f = (filter *)p;
  if (id != f->stream || !f->live || f->done) return;
  char why[64];
  snprintf(why, sizeof why, "worker: stream reset (reason %d)", reason);
  worker_failed(f, why, CAUSE_RESET);
}

/* ---- the caller's flow control, and what was posted to a later turn -------------------------- */

void envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    dm_envoy e, const void *p) {
  (void)e;
  ((filter *)p)->above_watermark++;
}

void envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    dm_envoy e, const void *p) {
  (void)e;
  filter *f = (filter *)p;
  if (f->above_watermark) f->above_watermark--;
  if (!f->above_watermark && !f->done) post(f, EVENT_DRAINED);
}

/* The caller has read: what was held goes to it, and a parked stream goes on. */
static void drained(filter *f) {
  if (f->above_watermark) return;
  if (!f->discarded) f->parking = 0; /* a park not yet made is not needed, unless it dropped */
  send_held(f, false);
  if (f->parked && !f->above_watermark) {
    f->parked = 0;
    start_worker_stream(f);
  }
}

void envoy_dynamic_module_on_http_filter_scheduled(dm_envoy envoy, const void *p, uint64_t event) {
  filter *f = (filter *)p;
  if (event == EVENT_PARK) {
    if (!f->parking || !f->live) return;
    f->live = 0;
    envoy_dynamic_module_callback_http_filter_reset_http_stream(envoy, f->stream);
    if (!f->done) park(f);
    else f->parking = 0;
    return;
  }
  if (f->done) return;
  if (event == EVENT_DRAINED) {
    drained(f);
    return;
  }
  if (!f->live && !f->parked) start_worker_stream(f);
}
