/* Spike: gRPC server-stream relay with mid-stream failover, as an Envoy dynamic module (terminal HTTP filter). */
#include "dm_abi.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXH 64
#define MAXHOSTS 8
static int g_log = 0;
#define LOG(...) do { if (g_log) { fprintf(stderr, "[relay] " __VA_ARGS__); fputc('\n', stderr); } } while (0)

typedef struct { char *p; size_t n, cap; } bytes;
static void b_add(bytes *b, const char *p, size_t n) {
  if (b->n + n > b->cap) { size_t c = b->cap ? b->cap : 256; while (c < b->n + n) c *= 2; b->p = realloc(b->p, c); b->cap = c; }
  memcpy(b->p + b->n, p, n); b->n += n;
}
static void b_free(bytes *b) { free(b->p); b->p = NULL; b->n = b->cap = 0; }

typedef struct {
  char cluster[128], planner[128];
  char hosts[MAXHOSTS][64]; int nhosts;
  int max_attempts;
  unsigned rr;
} config;

typedef struct {
  dm_envoy f; config *cfg;
  dm_hdr req_h[MAXH]; size_t nreq_h; bytes req_hstore;  /* copy of request headers */
  bytes req_body;          /* original request body (gRPC framed) */
  bytes cur_body;          /* body used for the current attempt */
  bytes delivered;         /* every byte sent downstream (whole gRPC frames only) */
  bytes partial;           /* incomplete frame bytes of the current attempt */
  bytes pending;           /* complete frames held back while downstream is above high watermark */
  uint64_t sid; int stream_live; int attempt; int host_idx;
  int headers_sent, done, above_wm, got_data_this_attempt;
  uint64_t planner_id; int waiting_planner;
  unsigned long frames_out, failovers;
} filt;

/* ---------------- program / config ---------------- */
const char *envoy_dynamic_module_on_program_init(void) {
  g_log = getenv("RELAY_LOG") != NULL;
  const char *v = getenv("RELAY_ABI_VERSION");
  return v ? v : "v0.2.0";
}

static void parse_cfg(config *c, const char *s, size_t n) {
  char tmp[1024]; if (n >= sizeof tmp) n = sizeof tmp - 1; memcpy(tmp, s, n); tmp[n] = 0;
  strcpy(c->cluster, "worker"); c->max_attempts = 3;
  for (char *save, *tok = strtok_r(tmp, ";", &save); tok; tok = strtok_r(NULL, ";", &save)) {
    char *eq = strchr(tok, '='); if (!eq) continue; *eq = 0; char *v = eq + 1;
    if (!strcmp(tok, "cluster")) snprintf(c->cluster, sizeof c->cluster, "%s", v);
    else if (!strcmp(tok, "planner")) snprintf(c->planner, sizeof c->planner, "%s", v);
    else if (!strcmp(tok, "max_attempts")) c->max_attempts = atoi(v);
    else if (!strcmp(tok, "hosts")) {
      for (char *s2, *h = strtok_r(v, ",", &s2); h && c->nhosts < MAXHOSTS; h = strtok_r(NULL, ",", &s2))
        snprintf(c->hosts[c->nhosts++], 64, "%s", h);
    }
  }
}

const void *envoy_dynamic_module_on_http_filter_config_new(void *cfg_envoy, dm_buf name, dm_buf conf) {
  (void)cfg_envoy;
  config *c = calloc(1, sizeof *c);
  parse_cfg(c, conf.ptr, conf.length);
  fprintf(stderr, "[relay] config name=%.*s cluster=%s planner=%s hosts=%d max_attempts=%d\n", (int)name.length,
          name.ptr, c->cluster, c->planner, c->nhosts, c->max_attempts);
  return c;
}
void envoy_dynamic_module_on_http_filter_config_destroy(const void *c) { free((void *)c); }
const void *envoy_dynamic_module_on_http_filter_per_route_config_new(dm_buf n, dm_buf c) { (void)n; (void)c; return NULL; }
void envoy_dynamic_module_on_http_filter_per_route_config_destroy(const void *c) { (void)c; }

/* ---------------- filter lifecycle ---------------- */
const void *envoy_dynamic_module_on_http_filter_new(const void *cfgp, dm_envoy f) {
  filt *x = calloc(1, sizeof *x); x->f = f; x->cfg = (config *)cfgp;
  if (x->cfg->nhosts) x->host_idx = (int)(x->cfg->rr++ % (unsigned)x->cfg->nhosts);
  return x;
}
void envoy_dynamic_module_on_http_filter_destroy(const void *p) {
  filt *x = (filt *)p;
  b_free(&x->req_hstore); b_free(&x->req_body); b_free(&x->cur_body); b_free(&x->delivered);
  b_free(&x->partial); b_free(&x->pending); free(x);
}
void envoy_dynamic_module_on_http_filter_stream_complete(dm_envoy f, const void *p) { (void)f; (void)p; }

static void fail_downstream(filt *x, const char *why) {
  LOG("giving up: %s", why);
  x->done = 1;
  if (!x->headers_sent) {
    dm_hdr h[] = {{":status", 7, "200", 3}, {"content-type", 12, "application/grpc", 16},
                  {"grpc-status", 11, "14", 2}, {"grpc-message", 12, why, strlen(why)}};
    envoy_dynamic_module_callback_http_send_response_headers(x->f, h, 4, true);
  } else {
    dm_hdr t[] = {{"grpc-status", 11, "14", 2}, {"grpc-message", 12, why, strlen(why)}};
    envoy_dynamic_module_callback_http_send_response_trailers(x->f, t, 2);
  }
}

static void start_attempt(filt *x) {
  if (x->attempt >= x->cfg->max_attempts) { fail_downstream(x, "relay: attempts exhausted"); return; }
  x->attempt++;
  x->partial.n = 0; x->got_data_this_attempt = 0;
  dm_hdr h[MAXH + 1]; size_t n = x->nreq_h;
  memcpy(h, x->req_h, n * sizeof *h);
  char hostbuf[64];
  if (x->cfg->nhosts) { /* module-side host choice via ORIGINAL_DST + x-envoy-original-dst-host */
    int idx = (x->host_idx + x->attempt - 1) % x->cfg->nhosts;
    snprintf(hostbuf, sizeof hostbuf, "%s", x->cfg->hosts[idx]);
    h[n++] = (dm_hdr){"x-envoy-original-dst-host", 25, hostbuf, strlen(hostbuf)};
    LOG("attempt %d -> %s (body %zu bytes)", x->attempt, hostbuf, x->cur_body.n);
  } else LOG("attempt %d -> cluster %s (body %zu bytes)", x->attempt, x->cfg->cluster, x->cur_body.n);
  dm_buf cl = {x->cfg->cluster, strlen(x->cfg->cluster)};
  dm_buf body = {x->cur_body.p, x->cur_body.n};
  uint64_t sid = 0;
  int r = envoy_dynamic_module_callback_http_filter_start_http_stream(x->f, &sid, cl, h, n, body, true, 600000);
  if (r != INIT_OK) { LOG("start_http_stream failed: %d", r); fail_downstream(x, "relay: cannot start stream"); return; }
  x->sid = sid; x->stream_live = 1;
}

static void on_stream_failed(filt *x, const char *why) {
  x->stream_live = 0;
  if (x->done) return;
  x->failovers++;
  LOG("filter %p stream %lu failed (%s) after %zu delivered bytes / %lu frames; failing over", (void*)x, (unsigned long)x->sid, why, x->delivered.n, x->frames_out);
  if (x->cfg->planner[0] && x->delivered.n > 0) {
    /* one-shot callout: new body = f(original body, delivered bytes) */
    bytes b = {0}; b_add(&b, x->req_body.p, x->req_body.n); b_add(&b, x->delivered.p, x->delivered.n);
    char ol[32]; snprintf(ol, sizeof ol, "%zu", x->req_body.n);
    dm_hdr h[] = {{":method", 7, "POST", 4}, {":path", 5, "/resume", 7}, {"host", 4, "planner", 7},
                  {"x-orig-len", 10, ol, strlen(ol)}};
    dm_buf cl = {x->cfg->planner, strlen(x->cfg->planner)};
    int r = envoy_dynamic_module_callback_http_filter_http_callout(x->f, &x->planner_id, cl, h, 4,
                                                                   (dm_buf){b.p, b.n}, 5000);
    b_free(&b);
    if (r != INIT_OK) { fail_downstream(x, "relay: planner callout failed"); return; }
    x->waiting_planner = 1;
    return;
  }
  start_attempt(x);
}

/* ---------------- request path ---------------- */
static void start_first(filt *x) {
  x->cur_body.n = 0; b_add(&x->cur_body, x->req_body.p, x->req_body.n);
  start_attempt(x);
}
static void collect_body(filt *x, int type) {
  size_t n = envoy_dynamic_module_callback_http_get_body_chunks_size(x->f, type);
  if (!n) return;
  dm_buf v[n];
  if (!envoy_dynamic_module_callback_http_get_body_chunks(x->f, type, v)) return;
  for (size_t i = 0; i < n; i++) b_add(&x->req_body, v[i].ptr, v[i].length);
}
int envoy_dynamic_module_on_http_filter_request_headers(dm_envoy f, const void *p, bool eos) {
  filt *x = (filt *)p;
  size_t n = envoy_dynamic_module_callback_http_get_headers_size(f, HT_REQ_HDR);
  if (n > MAXH) n = MAXH;
  dm_hdr tmp[MAXH];
  envoy_dynamic_module_callback_http_get_headers(f, HT_REQ_HDR, tmp);
  size_t tot = 0; for (size_t i = 0; i < n; i++) tot += tmp[i].kl + tmp[i].vl;
  x->req_hstore.p = malloc(tot ? tot : 1); x->req_hstore.cap = tot;
  for (size_t i = 0; i < n; i++) {
    if (tmp[i].kl > 8 && !memcmp(tmp[i].k, "x-envoy-", 8)) continue;
    char *k = x->req_hstore.p + x->req_hstore.n; memcpy(k, tmp[i].k, tmp[i].kl); x->req_hstore.n += tmp[i].kl;
    char *v = x->req_hstore.p + x->req_hstore.n; memcpy(v, tmp[i].v, tmp[i].vl); x->req_hstore.n += tmp[i].vl;
    x->req_h[x->nreq_h++] = (dm_hdr){k, tmp[i].kl, v, tmp[i].vl};
  }
  if (eos) start_first(x);
  return HDRS_STOP;
}
int envoy_dynamic_module_on_http_filter_request_body(dm_envoy f, const void *p, bool eos) {
  (void)f; filt *x = (filt *)p;
  collect_body(x, BODY_RECEIVED_REQ);
  if (eos) start_first(x);
  return BODY_STOP_NOBUFFER;
}
int envoy_dynamic_module_on_http_filter_request_trailers(dm_envoy f, const void *p) {
  (void)f; start_first((filt *)p); return TRL_STOP;
}
int envoy_dynamic_module_on_http_filter_response_headers(dm_envoy f, const void *p, bool e) { (void)f; (void)p; (void)e; return HDRS_CONTINUE; }
int envoy_dynamic_module_on_http_filter_response_body(dm_envoy f, const void *p, bool e) { (void)f; (void)p; (void)e; return BODY_CONTINUE; }
int envoy_dynamic_module_on_http_filter_response_trailers(dm_envoy f, const void *p) { (void)f; (void)p; return TRL_CONTINUE; }
int envoy_dynamic_module_on_http_filter_local_reply(dm_envoy f, const void *p, uint32_t c, dm_buf d, bool r) {
  (void)f; (void)p; (void)c; (void)d; (void)r; return 0;
}

/* ---------------- callout stream events ---------------- */
static int hdr_is(const dm_hdr *h, const char *k) { size_t l = strlen(k); return h->kl == l && !memcmp(h->k, k, l); }

void envoy_dynamic_module_on_http_filter_http_stream_headers(dm_envoy f, const void *p, uint64_t sid, dm_hdr *h,
                                                             size_t n, bool eos) {
  filt *x = (filt *)p;
  if (sid != x->sid || x->done) return;
  const dm_hdr *st = NULL, *gs = NULL;
  for (size_t i = 0; i < n; i++) { if (hdr_is(&h[i], ":status")) st = &h[i]; else if (hdr_is(&h[i], "grpc-status")) gs = &h[i]; }
  int ok_status = st && st->vl == 3 && !memcmp(st->v, "200", 3);
  int grpc_err = gs && !(gs->vl == 1 && gs->v[0] == '0');
  if (!ok_status || (eos && grpc_err)) {   /* e.g. Envoy's local 503/UNAVAILABLE when the host is down */
    LOG("attempt %d got error headers (status=%.*s grpc-status=%.*s)", x->attempt, st ? (int)st->vl : 0,
        st ? st->v : "", gs ? (int)gs->vl : 0, gs ? gs->v : "");
    if (!eos) envoy_dynamic_module_callback_http_filter_reset_http_stream(f, sid);
    on_stream_failed(x, "error headers");
    return;
  }
  if (!x->headers_sent) {
    x->headers_sent = 1;
    envoy_dynamic_module_callback_http_send_response_headers(f, h, n, eos);
    if (eos) x->done = 1;
  }
}

static void emit(filt *x, const char *p, size_t n) {
  if (!n) return;
  if (x->above_wm || x->pending.n) { b_add(&x->pending, p, n); return; }
  envoy_dynamic_module_callback_http_send_response_data(x->f, (dm_buf){p, n}, false);
}

void envoy_dynamic_module_on_http_filter_http_stream_data(dm_envoy f, const void *p, uint64_t sid, const dm_buf *d,
                                                          size_t cnt, bool eos) {
  (void)f; filt *x = (filt *)p;
  if (sid != x->sid || x->done) return;
  x->got_data_this_attempt = 1;
  for (size_t i = 0; i < cnt; i++) b_add(&x->partial, d[i].ptr, d[i].length);
  /* forward only whole gRPC frames: 1 byte flag + 4 byte big-endian length + payload */
  size_t off = 0;
  while (x->partial.n - off >= 5) {
    const unsigned char *q = (const unsigned char *)x->partial.p + off;
    size_t len = ((size_t)q[1] << 24) | ((size_t)q[2] << 16) | ((size_t)q[3] << 8) | q[4];
    if (x->partial.n - off < 5 + len) break;
    off += 5 + len; x->frames_out++;
  }
  if (off) {
    b_add(&x->delivered, x->partial.p, off);
    emit(x, x->partial.p, off);
    memmove(x->partial.p, x->partial.p + off, x->partial.n - off); x->partial.n -= off;
  }
  if (eos) { /* stream ended without trailers */
    x->done = 1;
    envoy_dynamic_module_callback_http_send_response_data(x->f, (dm_buf){x->pending.p, x->pending.n}, true);
    x->pending.n = 0;
  }
}

void envoy_dynamic_module_on_http_filter_http_stream_trailers(dm_envoy f, const void *p, uint64_t sid, dm_hdr *t,
                                                              size_t n) {
  filt *x = (filt *)p;
  if (sid != x->sid || x->done) return;
  if (x->pending.n) { envoy_dynamic_module_callback_http_send_response_data(f, (dm_buf){x->pending.p, x->pending.n}, false); x->pending.n = 0; }
  x->done = 1;
  char fo[32]; snprintf(fo, sizeof fo, "%lu", x->failovers);
  dm_hdr tt[MAXH + 1]; if (n > MAXH) n = MAXH; memcpy(tt, t, n * sizeof *t);
  tt[n++] = (dm_hdr){"x-relay-failovers", 17, fo, strlen(fo)};
  envoy_dynamic_module_callback_http_send_response_trailers(f, tt, n);
  LOG("stream %lu done: frames=%lu failovers=%lu", (unsigned long)sid, x->frames_out, x->failovers);
}
void envoy_dynamic_module_on_http_filter_http_stream_complete(dm_envoy f, const void *p, uint64_t sid) {
  (void)f; filt *x = (filt *)p;
  if (sid == x->sid) x->stream_live = 0;
}
void envoy_dynamic_module_on_http_filter_http_stream_reset(dm_envoy f, const void *p, uint64_t sid, int reason) {
  (void)f; filt *x = (filt *)p;
  if (sid != x->sid || x->done || !x->stream_live) return;
  char why[32]; snprintf(why, sizeof why, "reset reason %d", reason);
  on_stream_failed(x, why);
}

/* one-shot planner callout */
void envoy_dynamic_module_on_http_filter_http_callout_done(dm_envoy f, const void *p, uint64_t id, int result,
                                                           dm_hdr *h, size_t nh, dm_buf *body, size_t nb) {
  (void)f; filt *x = (filt *)p;
  if (!x->waiting_planner || id != x->planner_id || x->done) return;
  x->waiting_planner = 0;
  int st200 = 0;
  for (size_t i = 0; i < nh; i++) if (hdr_is(&h[i], ":status") && h[i].vl == 3 && !memcmp(h[i].v, "200", 3)) st200 = 1;
  /* NB: a callout timeout / no-host arrives as result=Success with Envoy's local 504/503 reply */
  if (result != CALLOUT_SUCCESS || !st200) { fail_downstream(x, "relay: planner failed"); return; }
  x->cur_body.n = 0;
  for (size_t i = 0; i < nb; i++) b_add(&x->cur_body, body[i].ptr, body[i].length);
  LOG("planner returned %zu-byte resume body (nb=%zu) for filter %p: %.*s", x->cur_body.n, nb, (void*)x, (int)(x->cur_body.n > 5 ? x->cur_body.n - 5 : 0), x->cur_body.p + 5);
  start_attempt(x);
}

/* downstream flow control (terminal filter only) */
void envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(dm_envoy f, const void *p) {
  (void)f; filt *x = (filt *)p; x->above_wm++; LOG("downstream above high watermark (%d)", x->above_wm);
}
void envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(dm_envoy f, const void *p) {
  filt *x = (filt *)p; if (x->above_wm) x->above_wm--;
  LOG("downstream below low watermark (%d), flushing %zu held bytes", x->above_wm, x->pending.n);
  if (!x->above_wm && x->pending.n && !x->done) {
    envoy_dynamic_module_callback_http_send_response_data(f, (dm_buf){x->pending.p, x->pending.n}, false);
    x->pending.n = 0;
  }
}

/* unused hooks that Envoy resolves */
void envoy_dynamic_module_on_http_filter_scheduled(dm_envoy f, const void *p, uint64_t e) { (void)f; (void)p; (void)e; }
void envoy_dynamic_module_on_http_filter_config_scheduled(void *ce, const void *c, uint64_t e) { (void)ce; (void)c; (void)e; }
void envoy_dynamic_module_on_http_filter_config_http_callout_done(void *ce, const void *c, uint64_t id, int r, dm_hdr *h,
                                                                  size_t nh, dm_buf *b, size_t nb) {
  (void)ce; (void)c; (void)id; (void)r; (void)h; (void)nh; (void)b; (void)nb;
}
void envoy_dynamic_module_on_http_filter_config_http_stream_headers(void *ce, const void *c, uint64_t s, dm_hdr *h, size_t n, bool e) {
  (void)ce; (void)c; (void)s; (void)h; (void)n; (void)e;
}
void envoy_dynamic_module_on_http_filter_config_http_stream_data(void *ce, const void *c, uint64_t s, const dm_buf *d, size_t n, bool e) {
  (void)ce; (void)c; (void)s; (void)d; (void)n; (void)e;
}
void envoy_dynamic_module_on_http_filter_config_http_stream_trailers(void *ce, const void *c, uint64_t s, dm_hdr *h, size_t n) {
  (void)ce; (void)c; (void)s; (void)h; (void)n;
}
void envoy_dynamic_module_on_http_filter_config_http_stream_complete(void *ce, const void *c, uint64_t s) { (void)ce; (void)c; (void)s; }
void envoy_dynamic_module_on_http_filter_config_http_stream_reset(void *ce, const void *c, uint64_t s, int r) { (void)ce; (void)c; (void)s; (void)r; }
