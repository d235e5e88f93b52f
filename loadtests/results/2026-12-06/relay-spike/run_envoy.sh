#!/bin/bash
# usage: run_envoy.sh "<relay config string>" [extra env...]
cd /tmp/dm-spike
sed "s|RELAY_CONFIG|$1|" envoy.yaml > envoy.run.yaml
export ENVOY_DYNAMIC_MODULES_SEARCH_PATH=/tmp/dm-spike
exec /work/main/.venv/lib/python3.11/site-packages/envoy/_bin/envoy -c envoy.run.yaml --concurrency 1 -l ${LOGLEVEL:-warning} --base-id 7331 --disable-hot-restart
