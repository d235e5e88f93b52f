/* The hooks of Envoy's dynamic-module ABI that the relay (tokenmesh_relay.c) does not use:
   Envoy resolves every hook of the ABI when it loads a module, so each must be exported. */
#include "abi.h"

/* Each hook takes the ABI's parameters and uses none of them. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

void envoy_dynamic_module_on_http_filter_http_callout_done(dm_envoy e, const void *p, uint64_t id,
                                                           int r, dm_hdr *h, size_t nh, dm_buf *b,
                                                           size_t nb) {}
void envoy_dynamic_module_on_http_filter_config_scheduled(void *ce, const void *c, uint64_t x) {}
void envoy_dynamic_module_on_http_filter_config_http_callout_done(void *ce, const void *c,
                                                                  uint64_t id, int r, dm_hdr *h,
                                                                  size_t nh, dm_buf *b,
                                                                  size_t nb) {}
void envoy_dynamic_module_on_http_filter_config_http_stream_headers(void *ce, const void *c,
                                                                    uint64_t s, dm_hdr *h,
                                                                    size_t n, bool e) {}
void envoy_dynamic_module_on_http_filter_config_http_stream_data(void *ce, const void *c,
                                                                 uint64_t s, const dm_buf *d,
                                                                 size_t n, bool e) {}
void envoy_dynamic_module_on_http_filter_config_http_stream_trailers(void *ce, const void *c,
                                                                     uint64_t s, dm_hdr *h,
                                                                     size_t n) {}
void envoy_dynamic_module_on_http_filter_config_http_stream_complete(void *ce, const void *c,
                                                                     uint64_t s) {}
void envoy_dynamic_module_on_http_filter_config_http_stream_reset(void *ce, const void *c,
                                                                  uint64_t s, int r) {}
