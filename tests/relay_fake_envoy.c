/* Envoy's side of the dynamic-module ABI, faked for tests/unit/test_relay_flow.py: built into
   one shared object with envoy/relay's sources, it drives the relay's hooks as Envoy would
   (a request, then the worker's headers and data in whatever pieces the test gives) and plays
   the caller's HTTP/2 codec: what the relay sends waits there until the test "reads" it, and
   crossing its high (low) watermark calls the relay's hook at once, as Envoy's codec does from
   inside the send. Only the relay's flow-control logic is under test here; the relay inside a
   real Envoy is tests/unit/test_relay_module.py. */
#include <stdlib.h>
#include <string.h>

#include "abi.h"

/* The relay's hooks this fake calls. */
const void *envoy_dynamic_module_on_http_filter_config_new(void *envoy, dm_buf name, dm_buf text);
const void *envoy_dynamic_module_on_http_filter_new(const void *cfg, dm_envoy envoy);
void envoy_dynamic_module_on_http_filter_destroy(const void *p);
int envoy_dynamic_module_on_http_filter_request_headers(dm_envoy envoy, const void *p, bool end);
int envoy_dynamic_module_on_http_filter_request_body(dm_envoy envoy, const void *p, bool end);
void envoy_dynamic_module_on_http_filter_http_stream_headers(dm_envoy envoy, const void *p,
                                                             uint64_t id, dm_hdr *h, size_t n,
                                                             bool end);
void envoy_dynamic_module_on_http_filter_http_stream_data(dm_envoy envoy, const void *p,
                                                          uint64_t id, const dm_buf *data,
                                                          size_t count, bool end);
void envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    dm_envoy e, const void *p);
void envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    dm_envoy e, const void *p);
void envoy_dynamic_module_on_http_filter_scheduled(dm_envoy envoy, const void *p, uint64_t event);

#define MAX_EVENTS 1024

/* One filter at a time: a test's whole state. */
static struct {
  const void *config, *filter;
  size_t high, low;     /* the caller's codec's watermarks */
  char *caller;         /* what the relay sent the caller, read or not */
  size_t sent, read;    /* its bytes, and how many of them the caller has read */
  int above;            /* the codec is over its high watermark */
  size_t max_waiting;   /* the most that ever waited in the codec */
  size_t sends;         /* the relay's sends of data */
  size_t sliced;        /* of those, the ones Envoy would keep as a slice of their own with
                           room to spare: 512 bytes or more, not whole 4 KiB pages */
  uint64_t streams;     /* worker streams started */
  uint64_t resets;      /* worker streams reset */
  char *request;        /* the body of the last worker stream started */
  size_t request_n;
  uint64_t events[MAX_EVENTS];
  size_t event_n;
  const char *body;     /* the caller's request body */
  size_t body_n;
} fake;

static char envoy_token; /* the filter's Envoy pointer: never dereferenced */
#define ENVOY ((dm_envoy)&envoy_token)

static size_t waiting(void) { return fake.sent - fake.read; }

/* ---- the driver: what the test calls ------------------------------------------------------ */

int fake_start(const char *config, size_t high, size_t low, const char *body, size_t body_n) {
  free(fake.caller);
  free(fake.request);
  memset(&fake, 0, sizeof fake);
  fake.high = high;
  fake.low = low;
  fake.body = body;
  fake.body_n = body_n;
  fake.config = envoy_dynamic_module_on_http_filter_config_new(
      NULL, (dm_buf){"relay", 5}, (dm_buf){config, strlen(config)});
  fake.filter = envoy_dynamic_module_on_http_filter_new(fake.config, ENVOY);
  envoy_dynamic_module_on_http_filter_request_headers(ENVOY, fake.filter, false);
  envoy_dynamic_module_on_http_filter_request_body(ENVOY, fake.filter, true);
  return fake.streams == 1;
}

/* The current worker stream answers (its headers). */
void fake_worker_headers(void) {
  dm_hdr h[] = {{":status", 7, "200", 3}, {"content-type", 12, "application/grpc", 16}};
  envoy_dynamic_module_on_http_filter_http_stream_headers(ENVOY, fake.filter, fake.streams, h, 2,
                                                          false);
}

/* Bytes of the current worker stream, in one piece as Envoy may hand them over. */
void fake_worker_data(const char *p, size_t n) {
  dm_buf data = {p, n};
  envoy_dynamic_module_on_http_filter_http_stream_data(ENVOY, fake.filter, fake.streams, &data, 1,
                                                       false);
}

/* Runs what the relay posted to a later turn of the event loop (and what that posts). */
void fake_run_posted(void) {
  for (size_t i = 0; i < fake.event_n; i++)
    envoy_dynamic_module_on_http_filter_scheduled(ENVOY, fake.filter, fake.events[i]);
  fake.event_n = 0;
}

/* The caller reads n bytes (all that wait, if fewer): past the low watermark the relay hears
   of it, as from Envoy's codec. */
void fake_caller_reads(size_t n) {
  fake.read += n < waiting() ? n : waiting();
  if (fake.above && waiting() < fake.low) {
    fake.above = 0;
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(ENVOY,
                                                                                   fake.filter);
  }
}

size_t fake_sent(void) { return fake.sent; }
size_t fake_max_waiting(void) { return fake.max_waiting; }
size_t fake_sends(void) { return fake.sends; }
size_t fake_sliced(void) { return fake.sliced; }
uint64_t fake_streams(void) { return fake.streams; }
uint64_t fake_resets(void) { return fake.resets; }
const char *fake_caller_bytes(void) { return fake.caller; }
const char *fake_request_bytes(void) { return fake.request; }
size_t fake_request_size(void) { return fake.request_n; }

void fake_end(void) {
  if (fake.filter) envoy_dynamic_module_on_http_filter_destroy(fake.filter);
  fake.filter = NULL;
}

/* ---- Envoy's callbacks, as the relay calls them ------------------------------------------- */

size_t envoy_dynamic_module_callback_http_get_headers_size(dm_envoy f, int type) {
  (void)f;
  return type == HT_REQ_HDR ? 4 : 0;
}

bool envoy_dynamic_module_callback_http_get_headers(dm_envoy f, int type, dm_hdr *out) {
  (void)f;
  if (type != HT_REQ_HDR) return false;
  static const char path[] = "/tokenmesh.v1.InferenceService/Generate";
  out[0] = (dm_hdr){":path", 5, path, sizeof path - 1};
  out[1] = (dm_hdr){":method", 7, "POST", 4};
  out[2] = (dm_hdr){":authority", 10, "worker", 6};
  out[3] = (dm_hdr){"content-type", 12, "application/grpc", 16};
  return true;
}

size_t envoy_dynamic_module_callback_http_get_body_chunks_size(dm_envoy f, int type) {
  (void)f;
  return type == BODY_RECEIVED_REQ ? 1 : 0;
}

bool envoy_dynamic_module_callback_http_get_body_chunks(dm_envoy f, int type, dm_buf *out) {
  (void)f;
  if (type != BODY_RECEIVED_REQ) return false;
  out[0] = (dm_buf){fake.body, fake.body_n};
  return true;
}

void envoy_dynamic_module_callback_http_send_response_headers(dm_envoy f, dm_hdr *h, size_t n,
                                                              bool end) {
  (void)f, (void)h, (void)n, (void)end;
}

/* The caller's codec takes the bytes; over its high watermark it tells the relay at once. */
void envoy_dynamic_module_callback_http_send_response_data(dm_envoy f, dm_buf data, bool end) {
  (void)f, (void)end;
  char *grown = realloc(fake.caller, fake.sent + data.length + 1);
  if (!grown) abort();
  fake.caller = grown;
  memcpy(fake.caller + fake.sent, data.ptr, data.length);
  fake.sent += data.length;
  fake.sends++;
  if (data.length >= 512 && data.length % 4096) fake.sliced++;
  if (waiting() > fake.max_waiting) fake.max_waiting = waiting();
  if (!fake.above && waiting() > fake.high) {
    fake.above = 1;
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(ENVOY,
                                                                                    fake.filter);
  }
}

void envoy_dynamic_module_callback_http_send_response_trailers(dm_envoy f, dm_hdr *h, size_t n) {
  (void)f, (void)h, (void)n;
}

int envoy_dynamic_module_callback_http_filter_start_http_stream(dm_envoy f, uint64_t *id,
                                                               dm_buf cluster, dm_hdr *h,
                                                               size_t n, dm_buf body, bool end,
                                                               uint64_t timeout_ms) {
  (void)f, (void)cluster, (void)h, (void)n, (void)end, (void)timeout_ms;
  free(fake.request);
  fake.request = malloc(body.length ? body.length : 1);
  if (!fake.request) abort();
  memcpy(fake.request, body.ptr, body.length);
  fake.request_n = body.length;
  *id = ++fake.streams;
  return INIT_OK;
}

void envoy_dynamic_module_callback_http_filter_reset_http_stream(dm_envoy f, uint64_t id) {
  (void)f, (void)id;
  fake.resets++;
}

void envoy_dynamic_module_callback_http_set_dynamic_metadata_string(dm_envoy f, dm_buf ns,
                                                                    dm_buf key, dm_buf value) {
  (void)f, (void)ns, (void)key, (void)value;
}

void envoy_dynamic_module_callback_http_set_dynamic_metadata_number(dm_envoy f, dm_buf ns,
                                                                    dm_buf key, double value) {
  (void)f, (void)ns, (void)key, (void)value;
}

void *envoy_dynamic_module_callback_http_filter_scheduler_new(dm_envoy f) {
  (void)f;
  return &fake;
}

void envoy_dynamic_module_callback_http_filter_scheduler_commit(void *scheduler, uint64_t event) {
  (void)scheduler;
  if (fake.event_n < MAX_EVENTS) fake.events[fake.event_n++] = event;
}

void envoy_dynamic_module_callback_http_filter_scheduler_delete(void *scheduler) {
  (void)scheduler;
}

/* No metrics: the relay then records none (config.metrics is 0). */
int envoy_dynamic_module_callback_http_filter_config_define_counter(void *c, dm_buf name,
                                                                      dm_buf *labels, size_t n,
                                                                      size_t *id) {
  (void)c, (void)name, (void)labels, (void)n, (void)id;
  return 1;
}

int envoy_dynamic_module_callback_http_filter_config_define_histogram(void *c, dm_buf name,
                                                                        dm_buf *labels, size_t n,
                                                                        size_t *id) {
  (void)c, (void)name, (void)labels, (void)n, (void)id;
  return 1;
}

int envoy_dynamic_module_callback_http_filter_increment_counter(dm_envoy f, size_t id,
                                                                dm_buf *labels, size_t n,
                                                                uint64_t value) {
  (void)f, (void)id, (void)labels, (void)n, (void)value;
  return 1;
}

int envoy_dynamic_module_callback_http_filter_record_histogram_value(dm_envoy f, size_t id,
                                                                     dm_buf *labels, size_t n,
                                                                     uint64_t value) {
  (void)f, (void)id, (void)labels, (void)n, (void)value;
  return 1;
}
