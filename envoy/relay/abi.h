/* The Envoy dynamic-module ABI (v0.2.0, Envoy 1.40) as tokenmesh_relay.c uses it: only the
   declarations it needs, written from the ABI's documented signatures. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct { const char *ptr; size_t length; } dm_buf;            /* envoy_buffer / module_buffer */
typedef struct { const char *k; size_t kl; const char *v; size_t vl; } dm_hdr; /* http_header */
typedef void *dm_envoy;        /* *_envoy_ptr */
typedef const void *dm_mod;    /* *_module_ptr */

enum { HT_REQ_HDR = 0, HT_REQ_TRL = 1, HT_RESP_HDR = 2, HT_RESP_TRL = 3 };
enum { BODY_RECEIVED_REQ = 0, BODY_BUFFERED_REQ = 1, BODY_RECEIVED_RESP = 2, BODY_BUFFERED_RESP = 3 };
enum { HDRS_CONTINUE = 0, HDRS_STOP = 1 };
enum { BODY_CONTINUE = 0, BODY_STOP_BUFFER = 1, BODY_STOP_WATERMARK = 2, BODY_STOP_NOBUFFER = 3 };
enum { TRL_CONTINUE = 0, TRL_STOP = 1 };
enum { INIT_OK = 0 }; /* http_callout_init_result */
enum { CALLOUT_SUCCESS = 0 };

/* callbacks implemented by Envoy */
size_t envoy_dynamic_module_callback_http_get_headers_size(dm_envoy f, int header_type);
bool envoy_dynamic_module_callback_http_get_headers(dm_envoy f, int header_type, dm_hdr *out);
size_t envoy_dynamic_module_callback_http_get_body_chunks_size(dm_envoy f, int body_type);
bool envoy_dynamic_module_callback_http_get_body_chunks(dm_envoy f, int body_type, dm_buf *out);
void envoy_dynamic_module_callback_http_send_response(dm_envoy f, uint32_t status, dm_hdr *h, size_t n,
                                                      dm_buf body, dm_buf details);
void envoy_dynamic_module_callback_http_send_response_headers(dm_envoy f, dm_hdr *h, size_t n, bool end_stream);
void envoy_dynamic_module_callback_http_send_response_data(dm_envoy f, dm_buf data, bool end_stream);
void envoy_dynamic_module_callback_http_send_response_trailers(dm_envoy f, dm_hdr *h, size_t n);
int envoy_dynamic_module_callback_http_filter_start_http_stream(dm_envoy f, uint64_t *stream_id_out, dm_buf cluster,
                                                               dm_hdr *h, size_t n, dm_buf body, bool end_stream,
                                                               uint64_t timeout_ms);
void envoy_dynamic_module_callback_http_filter_reset_http_stream(dm_envoy f, uint64_t stream_id);
int envoy_dynamic_module_callback_http_filter_http_callout(dm_envoy f, uint64_t *callout_id_out, dm_buf cluster,
                                                          dm_hdr *h, size_t n, dm_buf body, uint64_t timeout_ms);
void envoy_dynamic_module_callback_http_set_dynamic_metadata_string(dm_envoy f, dm_buf ns, dm_buf key,
                                                                    dm_buf value);
void envoy_dynamic_module_callback_http_set_dynamic_metadata_number(dm_envoy f, dm_buf ns, dm_buf key,
                                                                    double value);
void *envoy_dynamic_module_callback_http_filter_scheduler_new(dm_envoy f);
void envoy_dynamic_module_callback_http_filter_scheduler_commit(void *scheduler, uint64_t event_id);
void envoy_dynamic_module_callback_http_filter_scheduler_delete(void *scheduler);

int envoy_dynamic_module_callback_http_filter_config_define_counter(void *config_envoy, dm_buf name,
                                                                      dm_buf *labels, size_t n,
                                                                      size_t *id_out);
int envoy_dynamic_module_callback_http_filter_config_define_histogram(void *config_envoy, dm_buf name,
                                                                        dm_buf *labels, size_t n,
                                                                        size_t *id_out);
int envoy_dynamic_module_callback_http_filter_increment_counter(dm_envoy f, size_t id, dm_buf *labels,
                                                                size_t n, uint64_t value);
int envoy_dynamic_module_callback_http_filter_record_histogram_value(dm_envoy f, size_t id, dm_buf *labels,
                                                                     size_t n, uint64_t value);
