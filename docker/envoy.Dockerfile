# syntax=docker/dockerfile:1
# Envoy with the edge's stream relay (envoy/relay, docs/decisions/0031-the-edges-stream-relay.md):
# the official image of the Envoy version the chart's config is validated with, plus the relay's
# dynamic module where Envoy looks for it. The chart uses it with envoy.streamRelay.enabled.
#   docker build -f docker/envoy.Dockerfile -t tokenmesh/envoy .
# The module is built against an older glibc than the Envoy image's (Debian 12's 2.36 against
# Ubuntu's), which a shared object may be; it needs nothing else (plain C, Envoy's ABI v0.2.0,
# which follows the Envoy version: build again for another).
ARG BUILD_IMAGE=python:3.11.13-slim-bookworm
ARG ENVOY_IMAGE=envoyproxy/envoy:v1.40.0

FROM ${BUILD_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY envoy/relay envoy/relay
# The flags and files of localmesh's build (services/tokenmesh/localmesh/relay_module.py).
RUN mkdir -p /out \
    && gcc -O2 -Wall -Wextra -Werror -fPIC -shared -o /out/libtokenmesh_relay.so envoy/relay/*.c

FROM ${ENVOY_IMAGE} AS final
COPY --from=build /out/libtokenmesh_relay.so /usr/lib/tokenmesh/envoy-modules/
# Where Envoy loads the module named tokenmesh_relay from (lib<name>.so).
ENV ENVOY_DYNAMIC_MODULES_SEARCH_PATH=/usr/lib/tokenmesh/envoy-modules
# The chart runs Envoy as its own uid (envoy.podSecurityContext); this is the same.
USER 10101:10101
ENTRYPOINT ["/usr/local/bin/envoy"]
CMD ["--config-path", "/etc/envoy/envoy.yaml"]
