{{/* Names, labels, images, probes and the kinds every component shares. */}}

{{- define "tokenmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- /* Release names may contain dots, which Service names may not. */}}
{{- $release := .Release.Name | replace "." "-" }}
{{- if contains $name $release }}
{{- $release | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" $release $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The name of one component's objects: (dict "root" $ "component" "worker"). The prefix is at
most 41 characters, so that the longest name built on it, <prefix>-controlplane-headless (22
more), fits in 63. A longer one keeps its first 35 characters and a hash of the whole, so that
two release names that differ only at the end still get names of their own.
*/}}
{{- define "tokenmesh.componentName" -}}
{{- printf "%s-%s" (include "tokenmesh.prefix" .root) .component }}
{{- end }}

{{- define "tokenmesh.prefix" -}}
{{- $fullname := include "tokenmesh.fullname" . }}
{{- if gt (len $fullname) 41 }}
{{- printf "%s-%s" ($fullname | trunc 35 | trimSuffix "-") ($fullname | sha256sum | trunc 5) }}
{{- else }}
{{- $fullname }}
{{- end }}
{{- end }}

{{/* The headless Service of a component: its DNS name lists the ready pods. */}}
{{- define "tokenmesh.headlessName" -}}
{{- printf "%s-headless" (include "tokenmesh.componentName" .) }}
{{- end }}

{{- define "tokenmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The labels of every object (not pods: see tokenmesh.podLabels). */}}
{{- define "tokenmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tokenmesh.stableLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
{{- end }}

{{/* Labels that do not change from one chart version to the next. */}}
{{- define "tokenmesh.stableLabels" -}}
{{ include "tokenmesh.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tokenmesh
{{- end }}

{{/*
A pod template's labels: the stable ones and the component's podLabels, never the chart's
version or appVersion, so that a chart bump alone restarts no pod. podLabels may not replace
a selector label (the Deployment would lose its pods).
(dict "root" $ "component" name "values" $values)
*/}}
{{- define "tokenmesh.podLabels" -}}
{{- $selector := include "tokenmesh.selectorLabels" . | fromYaml }}
{{- range $key, $_ := .values.podLabels }}
{{- if hasKey $selector $key }}
{{- fail (printf "%s.podLabels may not set %s: it selects the component's pods" $.component $key) }}
{{- end }}
{{- end }}
{{- include "tokenmesh.stableLabels" . }}
{{- with .values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A pod template's metadata: labels, and annotations (podAnnotations plus the template's own,
e.g. a config checksum). (dict "root" $ "component" name "values" $values ["annotations" dict])
*/}}
{{- define "tokenmesh.podMetadata" -}}
labels:
  {{- include "tokenmesh.podLabels" . | nindent 2 }}
{{- $annotations := merge (dict) (.annotations | default dict) (.values.podAnnotations | default dict) }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* repository:tag, the tag defaulting to appVersion, plus -variant when set. */}}
{{- define "tokenmesh.image" -}}
{{- $image := .image }}
{{- $tag := default .root.Chart.AppVersion $image.tag }}
{{- if $image.variant }}{{ $tag = printf "%s-%s" $tag $image.variant }}{{ end }}
{{- printf "%s:%s" $image.repository $tag }}
{{- end }}

{{/* The gRPC health service each component's readiness reports on. */}}
{{- define "tokenmesh.healthService" -}}
{{- $services := dict
  "gateway" "tokenmesh.v1.LLMService"
  "worker" "tokenmesh.v1.InferenceService"
  "reranker" "tokenmesh.v1.RerankService"
  "controlplane" "envoy.service.discovery.v3.AggregatedDiscoveryService" }}
{{- required (printf "no health service for %s" .) (get $services .) }}
{{- end }}

{{- define "tokenmesh.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurityContext.runAsUser }}
runAsGroup: {{ .Values.podSecurityContext.runAsGroup }}
fsGroup: {{ .Values.podSecurityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* (dict "readOnly" bool) */}}
{{- define "tokenmesh.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .readOnly }}
capabilities:
  drop: ["ALL"]
{{- end }}

{{/*
Native gRPC probes (grpc.health.v1): startup and readiness ask about the component's service,
liveness about the whole server (""). A worker is NOT_SERVING while its model loads: the
startup probe holds liveness off until then. Periods, timeouts and thresholds come from the
component's probes values.
(dict "port" int "component" name "probes" (dict "startup" {..} "readiness" {..} "liveness" {..}))
*/}}
{{- define "tokenmesh.grpcProbes" -}}
{{- $service := include "tokenmesh.healthService" .component }}
startupProbe:
  grpc:
    port: {{ .port }}
    service: {{ $service }}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ .port }}
    service: {{ $service }}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ .port }}
    service: ""
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end }}

{{/*
What every pod spec takes from its component's values: its ServiceAccount (no API token
mounted: no component calls the Kubernetes API), priority and runtime classes, scheduling.
A topology spread constraint without a labelSelector spreads the component's own pods.
(dict "root" $ "component" name "values" $values)
*/}}
{{- define "tokenmesh.podExtensions" -}}
serviceAccountName: {{ include "tokenmesh.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  {{- $constraint := deepCopy . }}
  {{- if not (hasKey $constraint "labelSelector") }}
  {{- $_ := set $constraint "labelSelector" (dict "matchLabels" (include "tokenmesh.selectorLabels" $ | fromYaml)) }}
  {{- end }}
  - {{- toYaml $constraint | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* A component's ServiceAccount: its serviceAccount.name, or the chart's.
(dict "root" $ "component" name "values" $values ["pool" name]) */}}
{{- define "tokenmesh.serviceAccountName" -}}
{{- $account := .values.serviceAccount }}
{{- if $account.create }}
{{- /* A worker pool's pods run as the workers. */}}
{{- $account.name | default (include "tokenmesh.componentName" (dict "root" .root "component" (ternary "worker" .component (not (empty .pool))))) }}
{{- else }}
{{- $account.name | default "default" }}
{{- end }}
{{- end }}

{{/*
A service's shutdown: Kubernetes sends SIGTERM after the preStop sleep (time for Envoy to
learn the pod is gone), the service then drains for drainSeconds (NOT_SERVING, still
accepting), gives in-flight RPCs graceSeconds (TOKENMESH_<SERVICE>_DRAIN_SECONDS and
_GRACE_SECONDS, set in tokenmesh.serviceEnv) and needs marginSeconds to finish stopping; the
pod's terminationGracePeriodSeconds must cover all four, or the kubelet
kills streams the service would have finished. (dict "component" name "values" $values)
*/}}
{{- define "tokenmesh.terminationGracePeriod" -}}
{{- $shutdown := .values.shutdown }}
{{- $needed := add $shutdown.preStopSleepSeconds $shutdown.drainSeconds $shutdown.graceSeconds $shutdown.marginSeconds }}
{{- $period := int ($shutdown.terminationGracePeriodSeconds | default $needed) }}
{{- if lt $period (int $needed) }}
{{- fail (printf "%s.shutdown.terminationGracePeriodSeconds (%d) is below preStopSleepSeconds + drainSeconds + graceSeconds + marginSeconds (%d): the kubelet would kill the pod before its streams finish" .component $period (int $needed)) }}
{{- end }}
{{- $period }}
{{- end }}

{{/* The preStop sleep of a service, if any: (dict "values" $values) */}}
{{- define "tokenmesh.preStop" -}}
{{- $sleep := int .values.shutdown.preStopSleepSeconds }}
{{- if gt $sleep 0 }}
# The pod leaves the headless Service's DNS answer, so the control plane and Envoy stop
# sending it new streams before the service stops accepting them.
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ $sleep | quote }}]
{{- end }}
{{- end }}

{{/*
Settings every Python service reads (TOKENMESH_<SERVICE>_*): all interfaces, JSON logs, its pod
IP for Consul, and in consul mode the agent address.
(dict "root" $ "prefix" "TOKENMESH_GATEWAY_" "values" .Values.gateway)
*/}}
{{- define "tokenmesh.serviceEnv" -}}
- name: {{ .prefix }}HOST
  value: "0.0.0.0"
- name: {{ .prefix }}PORT
  value: {{ .values.port | quote }}
- name: {{ .prefix }}METRICS_HOST
  value: "0.0.0.0"
- name: {{ .prefix }}METRICS_PORT
  value: {{ .values.metricsPort | quote }}
- name: {{ .prefix }}LOG_FORMAT
  value: json
- name: {{ .prefix }}ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if eq .root.Values.discovery.mode "consul" }}
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
- name: {{ .prefix }}CONSUL_HTTP_ADDR
  value: {{ .root.Values.consul.address | default "$(HOST_IP):8500" | quote }}
{{- end }}
{{- with .values.shutdown }}
- name: {{ $.prefix }}DRAIN_SECONDS
  value: {{ .drainSeconds | quote }}
- name: {{ $.prefix }}GRACE_SECONDS
  value: {{ .graceSeconds | quote }}
{{- end }}
{{- /* tracing.otlpEndpoint, unless env or extraEnv sets the service's own. */}}
{{- $otlp := printf "%sOTLP_ENDPOINT" .prefix }}
{{- $own := hasKey (.values.env | default dict) $otlp }}
{{- range .values.extraEnv }}{{ if eq .name $otlp }}{{ $own = true }}{{ end }}{{ end }}
{{- if and .root.Values.tracing.otlpEndpoint (not $own) }}
- name: {{ $otlp }}
  value: {{ .root.Values.tracing.otlpEndpoint | quote }}
{{- end }}
{{- $computed := list (printf "%sGRACE_SECONDS" .prefix) (printf "%sDRAIN_SECONDS" .prefix) }}
{{- range $name, $value := .values.env }}
{{- if and $.values.shutdown (has $name $computed) }}
{{- fail (printf "set %s with shutdown.graceSeconds or drainSeconds, not env: terminationGracePeriodSeconds is computed from them" $name) }}
{{- end }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- /* A later duplicate in extraEnv would win over the computed one. */}}
{{- range .values.extraEnv }}
{{- if and $.values.shutdown (has .name $computed) }}
{{- fail (printf "set %s with shutdown.graceSeconds or drainSeconds, not extraEnv: terminationGracePeriodSeconds is computed from them" .name) }}
{{- end }}
{{- end }}
{{- with .values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The pod template's common spec: pull secrets, security context, ServiceAccount, scheduling.
(dict "root" $ "component" name "values" $values) */}}
{{- define "tokenmesh.podCommon" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "tokenmesh.podSecurityContext" .root | nindent 2 }}
  {{- if and (or (eq .component "worker") .pool) .root.Values.podSecurityContext.fsGroup }}
  # The kubelet chowns a volume to fsGroup only when its root is not already owned by it, not
  # every file of a model cache at every start.
  fsGroupChangePolicy: OnRootMismatch
  {{- end }}
{{ include "tokenmesh.podExtensions" . }}
{{- end }}

{{/* A headless Service for a Python component: gRPC and metrics ports, ready pods only.
(dict "root" $ "component" name ["values" $values, a worker pool's]) */}}
{{- define "tokenmesh.headlessService" -}}
{{- $values := .values | default (index .root.Values .component) }}
{{- if $values.enabled }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "tokenmesh.headlessName" . }}
  labels:
    {{- include "tokenmesh.labels" . | nindent 4 }}
spec:
  # Headless: the name resolves to every ready pod's IP, so Envoy gets each replica as its own
  # endpoint (through the control plane) and balances per stream; a Service VIP would be one
  # endpoint, balanced per connection.
  clusterIP: None
  selector:
    {{- include "tokenmesh.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ include "tokenmesh.port" (dict "root" .root "component" (ternary "worker" .component (not (empty .pool)))) }}
      targetPort: grpc
      appProtocol: grpc
    - name: metrics
      port: {{ $values.metricsPort }}
      targetPort: metrics
{{- end }}
{{- end }}

{{- define "tokenmesh.pdb" -}}
{{- $values := .values | default (index .root.Values .component) }}
{{- if and $values.enabled $values.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tokenmesh.componentName" . }}
  labels:
    {{- include "tokenmesh.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $values.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "tokenmesh.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/*
Ingress of a Python component: its gRPC port from Envoy's pods (and from Consul's health
checks in consul mode), its metrics port from networkPolicy.metricsFrom. Besides Envoy, the
control plane's ops feed asks each worker on its gRPC port (grpc.health.v1 Check and
GetEngineStats), Envoy's edge reaches the control plane's ops page, and with
envoy.workerRouting.policy=picker the gateways reach the control plane's gRPC port (the
workers' feed, OpsService.SubscribeWorkers).
*/}}
{{- define "tokenmesh.serviceNetworkPolicy" -}}
{{- $values := .values | default (index .root.Values .component) }}
{{- if and $values.enabled .root.Values.networkPolicy.enabled }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "tokenmesh.componentName" . }}
  labels:
    {{- include "tokenmesh.labels" . | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "tokenmesh.selectorLabels" . | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    - from:
        - podSelector:
            matchLabels:
              {{- include "tokenmesh.selectorLabels" (dict "root" .root "component" "envoy") | nindent 14 }}
        {{- if eq .root.Values.discovery.mode "consul" }}
        {{- with .root.Values.networkPolicy.consulFrom }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- end }}
      ports:
        - port: grpc
        {{- if eq .component "gateway" }}
        # The OpenAI HTTP API (the edge's /v1/).
        - port: openai
        {{- end }}
    {{- if and (or (eq .component "worker") .pool) .root.Values.controlplane.enabled }}
    # The ops feed: the control plane probes every worker (health, engine stats).
    - from:
        - podSelector:
            matchLabels:
              {{- include "tokenmesh.selectorLabels" (dict "root" .root "component" "controlplane") | nindent 14 }}
      ports:
        - port: grpc
    {{- end }}
    {{- if eq .component "controlplane" }}
    # The ops page's files, which Envoy's edge serves under /ops/.
    - from:
        - podSelector:
            matchLabels:
              {{- include "tokenmesh.selectorLabels" (dict "root" .root "component" "envoy") | nindent 14 }}
      ports:
        - port: ops-page
    {{- if and (eq .root.Values.envoy.workerRouting.policy "picker") .root.Values.gateway.enabled }}
    # worker_routing picker: each gateway's endpoint picker follows the workers' load here.
    - from:
        - podSelector:
            matchLabels:
              {{- include "tokenmesh.selectorLabels" (dict "root" .root "component" "gateway") | nindent 14 }}
      ports:
        - port: grpc
    {{- end }}
    {{- end }}
    - from:
        {{- toYaml .root.Values.networkPolicy.metricsFrom | nindent 8 }}
      ports:
        - port: metrics
{{- end }}
{{- end }}

{{/*
Whether the egress NetworkPolicies render: networkPolicy.egress.enabled when set (true renders
them even with networkPolicy.enabled=false, which is the ingress policies), else (null, the
default) networkPolicy.enabled. "true" or "".
*/}}
{{- define "tokenmesh.egressEnabled" -}}
{{- $np := .Values.networkPolicy }}
{{- $egress := dig "enabled" nil ($np.egress | default dict) }}
{{- if kindIs "bool" $egress }}{{ ternary "true" "" $egress }}{{ else }}{{ ternary "true" "" (eq (toString $np.enabled) "true") }}{{ end }}
{{- end }}

{{/*
The port of an OTLP/gRPC endpoint as the services take it ("host:port", "http://host:port",
"https://host:port/"): the explicit port, else 4317.
*/}}
{{- define "tokenmesh.otlpPort" -}}
{{- $address := regexReplaceAll "^[a-zA-Z][a-zA-Z0-9+.-]*://" (toString .) "" }}
{{- $host := regexReplaceAll "/.*$" $address "" }}
{{- if regexMatch ":[0-9]+$" $host }}{{ regexFind "[0-9]+$" $host | int }}{{ else }}4317{{ end }}
{{- end }}

{{/*
A ServiceMonitor for a component, when enabled and the Prometheus Operator's CRD exists. The
dashboards and alerts select on `service` (gateway, worker, ...) and `replica` (the pod), as
the local stack labels them.
(dict "root" $ "component" "worker" "service" name "port" portName "path" path
      ["values" $values "pool" name, a worker pool's])
*/}}
{{- define "tokenmesh.serviceMonitor" -}}
{{- $values := .values | default (index .root.Values .component) }}
{{- $monitoring := .root.Values.monitoring.serviceMonitor }}
{{- if and $values.enabled $monitoring.enabled (.root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "tokenmesh.componentName" . }}
  labels:
    {{- include "tokenmesh.labels" . | nindent 4 }}
    {{- with $monitoring.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "tokenmesh.selectorLabels" . | nindent 6 }}
  endpoints:
    - port: {{ .port | default "metrics" }}
      path: {{ .path | default "/metrics" }}
      interval: {{ $monitoring.interval }}
      relabelings:
        - targetLabel: service
          replacement: {{ ternary "worker" .component (not (empty .pool)) }}
        - sourceLabels: [__meta_kubernetes_pod_name]
          targetLabel: replica
        {{- with .pool }}
        # A pool's workers are workers (the dashboards' service="worker"), of their pool.
        - targetLabel: pool
          replacement: {{ . }}
        {{- end }}
      {{- if or (eq .component "worker") .pool }}
      # prometheus_client writes vLLM's `vllm:*` names as `vllm_*` for OpenMetrics scrapes: put
      # back the names vLLM documents and the dashboards use (as the local stack does).
      metricRelabelings:
        - sourceLabels: [__name__]
          regex: vllm_(.+)
          targetLabel: __name__
          replacement: vllm:$1
      {{- end }}
{{- end }}
{{- end }}

{{/*
Envoy's configuration, generated from services/tokenmesh/meshconfig (make chart): the edge
with TLS when envoy.tls.enabled, mTLS to the services when mtls.enabled, the workers' streams
through the edge's stream relay when envoy.streamRelay.enabled, the control plane's
placeholder host replaced by its headless Service, the health checks' placeholders by
envoy.healthChecks and the workers' load_balancing_policy by envoy.workerRouting's, from
files/worker-balancing.yaml (meshconfig's balancing.worker_balancing for each policy). Listener
and admin ports are read from it, never repeated in values.
*/}}
{{- define "tokenmesh.envoyConfig" -}}
{{- $relay := .Values.envoy.streamRelay.enabled }}
{{- if and $relay (hasPrefix "envoyproxy/envoy" .Values.envoy.image.repository) }}
{{- fail (printf "envoy.streamRelay.enabled needs an Envoy image that carries the relay's module, and %s has none: use ghcr.io/tokenmesh/envoy (docker/envoy.Dockerfile), or set envoy.streamRelay.enabled=false" .Values.envoy.image.repository) }}
{{- end }}
{{- $file := printf "files/envoy%s%s%s.yaml" (ternary "-relay" "" $relay) (ternary "-tls" "" .Values.envoy.tls.enabled) (ternary "-mtls" "" .Values.mtls.enabled) }}
{{- $host := printf "%s.%s.svc.%s" (include "tokenmesh.headlessName" (dict "root" . "component" "controlplane")) .Release.Namespace .Values.clusterDomain }}
{{- $checks := .Values.envoy.healthChecks }}
{{- $routing := .Values.envoy.workerRouting }}
{{- $text := .Files.Get $file }}
{{- $line := regexFind "(?m)^ *load_balancing_policy: \\$\\{TOKENMESH_WORKER_BALANCING\\}$" $text }}
{{- $policies := .Files.Get "files/worker-balancing.yaml" | fromYaml }}
{{- if or (not $line) (not (hasKey $policies $routing.policy)) }}
{{- fail (printf "%s has no workers' balancing placeholder, or files/worker-balancing.yaml no policy %s: regenerate the chart files (make chart)" $file $routing.policy) }}
{{- end }}
{{- $indent := len (regexFind "^ *" $line) }}
{{- $text = replace $line (printf "%sload_balancing_policy:%s" (repeat $indent " ") (get $policies $routing.policy | toYaml | nindent (add $indent 2 | int))) $text }}
{{- $text = $text | replace "${TOKENMESH_CONTROLPLANE_HOST}" $host
  | replace "${TOKENMESH_HEALTH_CHECK_TIMEOUT}" (include "tokenmesh.duration" $checks.timeoutSeconds)
  | replace "${TOKENMESH_HEALTH_CHECK_INTERVAL}" (include "tokenmesh.duration" $checks.intervalSeconds)
  | replace "${TOKENMESH_HEALTH_CHECK_UNHEALTHY_THRESHOLD}" (printf "%d" (int $checks.unhealthyThreshold))
  | replace "${TOKENMESH_HEALTH_CHECK_HEALTHY_THRESHOLD}" (printf "%d" (int $checks.healthyThreshold))
  | replace "${TOKENMESH_HEALTHY_PANIC_THRESHOLD_PERCENT}" (printf "%g" (float64 $checks.panicThresholdPercent))
  | replace "${TOKENMESH_PREFIX_BALANCE_FACTOR}" (printf "%d" (int $routing.prefixBalanceFactorPercent)) }}
{{- if and .Values.worker.enabled .Values.worker.pools }}
{{- include "tokenmesh.envoyPools" (dict "root" . "text" $text "file" (base $file)) }}
{{- else }}
{{- $text }}
{{- end }}
{{- end }}

{{/*
Envoy's configuration with worker.pools' clusters and routes, as meshconfig's worker_pools
renders them (files/worker-pools.yaml, from meshconfig: the header naming a request's pool,
and the listeners whose routes to the workers it applies to): after the cluster `worker`, a
copy named worker-<pool> per pool; before each route of those listeners to the cluster
`worker`, a copy per pool whose match also takes the header naming the pool, to its
cluster (meshconfig's routes.pool_routes).
(dict "root" $ "text" config "file" "envoy[-relay][-tls][-mtls].yaml")
*/}}
{{- define "tokenmesh.envoyPools" -}}
{{- $config := .text | fromYaml }}
{{- $spec := .root.Files.Get "files/worker-pools.yaml" | fromYaml }}
{{- $listeners := get ($spec.listeners | default dict) .file }}
{{- if not $listeners }}
{{- fail (printf "files/worker-pools.yaml names no pool listeners for %s: regenerate the chart files (make chart)" .file) }}
{{- end }}
{{- $pools := include "tokenmesh.poolNames" .root | fromJsonArray }}
{{- $clusters := list }}
{{- range $cluster := $config.static_resources.clusters }}
{{- $clusters = append $clusters $cluster }}
{{- if eq $cluster.name "worker" }}
{{- range $pool := $pools }}
{{- $clusters = append $clusters (set (deepCopy $cluster) "name" (printf "worker-%s" $pool)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $_ := set $config.static_resources "clusters" $clusters }}
{{- range $listener := $config.static_resources.listeners }}
{{- if has $listener.name $listeners }}
{{- range $chain := $listener.filter_chains }}
{{- range $filter := $chain.filters }}
{{- range $host := dig "typed_config" "route_config" "virtual_hosts" list $filter }}
{{- $routes := list }}
{{- range $route := $host.routes }}
{{- if eq (dig "route" "cluster" "" $route) "worker" }}
{{- range $pool := $pools }}
{{- $copy := deepCopy $route }}
{{- $header := dict "name" $spec.header "string_match" (dict "exact" $pool) }}
{{- $_ := set $copy.match "headers" (list $header) }}
{{- $_ := set $copy.route "cluster" (printf "worker-%s" $pool) }}
{{- $routes = append $routes $copy }}
{{- end }}
{{- end }}
{{- $routes = append $routes $route }}
{{- end }}
{{- $_ := set $host "routes" $routes }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* Seconds as an Envoy duration, as meshconfig writes them: 0.5 -> 0.5s, 1 -> 1s. */}}
{{- define "tokenmesh.duration" -}}
{{- regexReplaceAll "\\.?0+$" (printf "%.3f" (float64 .)) "" }}s
{{- end }}

{{/* A port of the generated Envoy config: (dict "root" $ "listener" "edge"|"worker"|"reranker"|"admin"|"xds"|"ops_page") */}}
{{- define "tokenmesh.envoyPort" -}}
{{- $config := .root.Files.Get "files/envoy.yaml" | fromYaml }}
{{- $port := 0 }}
{{- if eq .listener "admin" }}
{{- $port = $config.admin.address.socket_address.port_value }}
{{- else if has .listener (list "xds" "ops_page") }}
{{- $cluster := get (dict "xds" "xds_cluster" "ops_page" "ops_page") .listener }}
{{- range $config.static_resources.clusters }}
{{- if eq .name $cluster }}
{{- $port = (index (index .load_assignment.endpoints 0).lb_endpoints 0).endpoint.address.socket_address.port_value }}
{{- end }}
{{- end }}
{{- else }}
{{- range $config.static_resources.listeners }}
{{- if eq .name $.listener }}
{{- $port = .address.socket_address.port_value }}
{{- end }}
{{- end }}
{{- end }}
{{- required (printf "no %s port in files/envoy.yaml" .listener) $port | int }}
{{- end }}

{{/* A component's gRPC port: from values, the control plane's from the Envoy config. */}}
{{- define "tokenmesh.port" -}}
{{- if eq .component "controlplane" }}
{{- include "tokenmesh.envoyPort" (dict "root" .root "listener" "xds") }}
{{- else }}
{{- (index .root.Values .component).port | int }}
{{- end }}
{{- end }}

{{/* The kubernetes.io/tls Secret of the edge: an existing one, or the Certificate's. */}}
{{- define "tokenmesh.tlsSecretName" -}}
{{- $tls := .Values.envoy.tls }}
{{- if $tls.existingSecret }}
{{- $tls.existingSecret }}
{{- else if $tls.certManager.enabled }}
{{- printf "%s-tls" (include "tokenmesh.componentName" (dict "root" . "component" "envoy")) }}
{{- else }}
{{- fail "envoy.tls.enabled needs envoy.tls.existingSecret or envoy.tls.certManager.enabled" }}
{{- end }}
{{- end }}

{{/* The Secret holding the gateways' keys file: gateway.auth.existingSecret or the chart's. */}}
{{- define "tokenmesh.gatewayKeysSecret" -}}
{{- .Values.gateway.auth.existingSecret | default (printf "%s-keys" (include "tokenmesh.componentName" (dict "root" . "component" "gateway"))) }}
{{- end }}

{{/*
mTLS inside the mesh (mtls.enabled). A certificate, its key and the CA are mounted as tls.crt,
tls.key and ca.crt: from the shared existingSecret (`make certs` file names: file.crt,
file.key) or from the Secret of the cert-manager Certificate named after the component.
(dict "root" $ "component" "envoy"|"envoy-internal"|"gateway"|"worker"|"reranker"
      "file" "envoy-client"|"envoy"|... "volume" name)
*/}}
{{- define "tokenmesh.mtlsVolume" -}}
{{- $mtls := .root.Values.mtls }}
- name: {{ .volume }}
  secret:
    {{- if $mtls.existingSecret }}
    {{- $file := .file }}
    secretName: {{ $mtls.existingSecret }}
    items:
      - key: {{ $file }}.crt
        path: tls.crt
      - key: {{ $file }}.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
    {{- else if $mtls.certManager.enabled }}
    secretName: {{ include "tokenmesh.mtlsSecretName" . }}
    {{- else }}
    {{- fail "mtls.enabled needs mtls.existingSecret or mtls.certManager.enabled" }}
    {{- end }}
{{- end }}

{{/* The Secret a component's mTLS Certificate writes. (dict "root" $ "component" name) */}}
{{- define "tokenmesh.mtlsSecretName" -}}
{{- printf "%s-mtls" (include "tokenmesh.componentName" .) }}
{{- end }}

{{/* Where a service mounts its mTLS files. */}}
{{- define "tokenmesh.mtlsDir" -}}
/etc/tokenmesh/mtls
{{- end }}

{{/*
A service's mTLS settings: its certificate, key and the CA its clients' certificates must
chain to, and the plaintext health-only port its probes use. (dict "root" $ "prefix" P)
*/}}
{{- define "tokenmesh.mtlsEnv" -}}
{{- if .root.Values.mtls.enabled }}
{{- $dir := include "tokenmesh.mtlsDir" . }}
- name: {{ .prefix }}TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" $dir }}
- name: {{ .prefix }}TLS_KEY_FILE
  value: {{ printf "%s/tls.key" $dir }}
- name: {{ .prefix }}TLS_CLIENT_CA_FILE
  value: {{ printf "%s/ca.crt" $dir }}
- name: {{ .prefix }}HEALTH_PORT
  value: {{ .root.Values.mtls.healthPort | quote }}
{{- if eq .prefix "TOKENMESH_GATEWAY_" }}
# Envoy's internal listeners speak TLS too, with a certificate from the same CA.
- name: TOKENMESH_GATEWAY_DEPENDENCY_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $dir }}
{{- end }}
{{- if eq .prefix "TOKENMESH_WORKER_" }}
# The internal worker listener a worker hands its streams over through speaks TLS too.
- name: TOKENMESH_WORKER_HANDOVER_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $dir }}
{{- end }}
{{- end }}
{{- end }}

{{/* The port a service's probes ask: its gRPC port, or with mTLS the plaintext health port. */}}
{{- define "tokenmesh.probePort" -}}
{{- if .root.Values.mtls.enabled }}{{ .root.Values.mtls.healthPort }}{{ else }}{{ .values.port }}{{ end }}
{{- end }}

{{/* A Kubernetes quantity (8Gi, 512M, 1e9, ...) in bytes, as a string: for comparisons. */}}
{{- define "tokenmesh.bytes" -}}
{{- $quantity := toString . }}
{{- $factors := dict "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 }}
{{- $bytes := float64 0 }}
{{- $found := false }}
{{- range $suffix, $factor := $factors }}
{{- if and (not $found) (hasSuffix $suffix $quantity) }}
{{- $bytes = mulf (float64 (trimSuffix $suffix $quantity)) $factor }}
{{- $found = true }}
{{- end }}
{{- end }}
{{- if not $found }}{{ $bytes = float64 $quantity }}{{ end }}
{{- printf "%.0f" $bytes }}
{{- end }}

{{/* The claim the chart makes for the workers' cache (worker.model.storage.type=pvc). */}}
{{- define "tokenmesh.modelClaimName" -}}
{{- printf "%s-models" (include "tokenmesh.componentName" (dict "root" . "component" "worker")) }}
{{- end }}

{{/*
Value combinations that can never work, refused at render time with the reason.
*/}}
{{- define "tokenmesh.checks" -}}
{{- $v := .Values }}
{{- $fullname := include "tokenmesh.fullname" . }}
{{- if not (regexMatch "^[a-z]" $fullname) }}
{{- fail (printf "the chart's object names would start with %q: Service names must start with a lowercase letter (DNS-1035 labels), so use a release name that starts with one, or set fullnameOverride" (substr 0 1 $fullname)) }}
{{- end }}
{{- if and (eq $v.discovery.mode "consul") $v.mtls.enabled }}
{{- fail "discovery.mode=consul cannot be combined with mtls.enabled: Consul's gRPC health checks are plaintext and the services' gRPC ports accept only mTLS, so every instance would stay critical in Consul (use discovery.mode=kubernetes with mTLS)" }}
{{- end }}
{{- $worker := $v.worker }}
{{- if and $worker.autoscaling.enabled $worker.keda.enabled }}
{{- fail "worker.autoscaling.enabled and worker.keda.enabled cannot both be on: KEDA makes its own HorizontalPodAutoscaler, and two autoscalers would fight over the replica count" }}
{{- end }}
{{- if and $worker.keda.enabled (not (or $worker.keda.queue.enabled $worker.keda.ttft.enabled)) }}
{{- fail "worker.keda.enabled needs a trigger: worker.keda.queue.enabled or worker.keda.ttft.enabled" }}
{{- end }}
{{- range $component := list "gateway" "worker" }}
{{- $scaling := (index $v $component).autoscaling }}
{{- if and $scaling.enabled (gt (int $scaling.minReplicas) (int $scaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $component (int $scaling.minReplicas) (int $scaling.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if and $worker.keda.enabled (gt (int $worker.keda.minReplicaCount) (int $worker.keda.maxReplicaCount)) }}
{{- fail (printf "worker.keda.minReplicaCount (%d) is above maxReplicaCount (%d)" (int $worker.keda.minReplicaCount) (int $worker.keda.maxReplicaCount)) }}
{{- end }}
{{- /* The default queries read the series the workers' ServiceMonitor makes (job, namespace). */}}
{{- $keda := $worker.keda }}
{{- $defaultQueries := or (and $keda.queue.enabled (not $keda.queue.query)) (and $keda.ttft.enabled (not $keda.ttft.query)) }}
{{- if and $keda.enabled $defaultQueries (not $v.monitoring.serviceMonitor.enabled) }}
{{- fail "worker.keda.enabled needs monitoring.serviceMonitor.enabled: the default KEDA queries read the series the workers' ServiceMonitor scrapes, and without it they would find none and never scale (or give every enabled trigger a query of your own)" }}
{{- end }}
{{- $rolling := $worker.updateStrategy.rollingUpdate | default dict }}
{{- /* Unset, Kubernetes makes each 25%; "0%" is as zero as 0. */}}
{{- $surge := ternary "25%" $rolling.maxSurge (kindIs "invalid" $rolling.maxSurge) | toString | trimSuffix "%" | atoi }}
{{- $unavailable := ternary "25%" $rolling.maxUnavailable (kindIs "invalid" $rolling.maxUnavailable) | toString | trimSuffix "%" | atoi }}
{{- if and (eq $worker.updateStrategy.type "RollingUpdate") (eq $surge 0) (eq $unavailable 0) }}
{{- fail "worker.updateStrategy.rollingUpdate: maxSurge and maxUnavailable cannot both be 0 (the rollout could never replace a pod)" }}
{{- end }}
{{- $storage := $worker.model.storage }}
{{- if and (eq $storage.type "existingClaim") (not $storage.existingClaim.claimName) }}
{{- fail "worker.model.storage.type=existingClaim needs worker.model.storage.existingClaim.claimName" }}
{{- end }}
{{- if and (eq $storage.type "pvc") (has $storage.pvc.accessMode (list "ReadWriteOnce" "ReadWriteOncePod")) }}
{{- $most := int $worker.replicas }}
{{- $source := "replicas" }}
{{- if $worker.autoscaling.enabled }}{{ $most = int $worker.autoscaling.maxReplicas }}{{ $source = "autoscaling.maxReplicas" }}{{ end }}
{{- if $worker.keda.enabled }}{{ $most = int $worker.keda.maxReplicaCount }}{{ $source = "keda.maxReplicaCount" }}{{ end }}
{{- if gt $most 1 }}
{{- $where := ternary "in one pod only" "on one node only" (eq $storage.pvc.accessMode "ReadWriteOncePod") }}
{{- fail (printf "worker.model.storage.pvc.accessMode=%s mounts the claim %s, but worker.%s allows %d workers: those that cannot mount it would wait in ContainerCreating (Multi-Attach error); use ReadWriteMany, or one worker" $storage.pvc.accessMode $where $source $most) }}
{{- end }}
{{- end }}
{{- include "tokenmesh.workerChecks" (dict "values" $worker "key" "worker") }}
{{- include "tokenmesh.poolChecks" . }}
{{- /* Envoy runs its health checks' timers in whole milliseconds and drops the rest (a 0.4 ms
timeout would fail every check); the schema bounds the values themselves. */}}
{{- range $key := list "intervalSeconds" "timeoutSeconds" }}
{{- $seconds := toString (index $v.envoy.healthChecks $key) }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]{1,3})?$" $seconds) }}
{{- fail (printf "envoy.healthChecks.%s (%s) must be a whole number of milliseconds: Envoy times health checks in milliseconds and would drop the rest" $key $seconds) }}
{{- end }}
{{- end }}
{{- /* The gateways' endpoint picker: its settings come from envoy.workerRouting only. */}}
{{- $routing := $v.envoy.workerRouting }}
{{- if and (eq $routing.policy "picker") (not $v.controlplane.enabled) }}
{{- fail "envoy.workerRouting.policy=picker needs controlplane.enabled: the gateways' endpoint picker follows the workers' load on the control plane's feed (without it every request would fall back to least request)" }}
{{- end }}
{{- if and (eq $routing.policy "picker") (le (mulf $routing.picker.staleSeconds 1000) (float64 $routing.picker.feedIntervalMs)) }}
{{- fail (printf "envoy.workerRouting.picker.staleSeconds (%v) must exceed feedIntervalMs (%v ms): the gateways would count the figures stale between two reports and name no worker" $routing.picker.staleSeconds $routing.picker.feedIntervalMs) }}
{{- end }}
{{- $pickerEnv := list }}
{{- range $name, $_ := $v.gateway.env }}{{ $pickerEnv = append $pickerEnv (dict "name" $name "where" "env") }}{{ end }}
{{- range $v.gateway.extraEnv }}{{ $pickerEnv = append $pickerEnv (dict "name" .name "where" "extraEnv") }}{{ end }}
{{- range $pickerEnv }}
{{- if hasPrefix "TOKENMESH_GATEWAY_PICKER__" .name }}
{{- fail (printf "set %s with envoy.workerRouting (policy picker, picker.*), not gateway.%s: the chart sets the gateways' picker settings, and with the other policies Envoy ignores the workers a picker names" .name .where) }}
{{- end }}
{{- end }}
{{- range $component := list "gateway" "worker" "reranker" "controlplane" }}
{{- $values := index $v $component }}
{{- if $values.enabled }}
{{- $ports := dict }}
{{- $named := dict "port" $values.port "metricsPort" $values.metricsPort "openaiPort" $values.openaiPort }}
{{- if and $v.mtls.enabled (ne $component "controlplane") }}{{ $_ := set $named "mtls.healthPort" $v.mtls.healthPort }}{{ end }}
{{- range $key, $port := $named }}
{{- if $port }}
{{- $seen := get $ports (toString (int $port)) }}
{{- if $seen }}
{{- fail (printf "%s: %s and %s are the same port (%d)" $component $seen $key (int $port)) }}
{{- end }}
{{- $_ := set $ports (toString (int $port)) $key }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- /* The worker's engine arguments by vLLM's names, dashes read as underscores (as the
worker reads them). (dict "values" $values: worker's or a pool's) */}}
{{- define "tokenmesh.workerEngineArgs" -}}
{{- $args := dict }}
{{- range $name, $value := (.values.engineArgs | default dict) }}
{{- $_ := set $args (replace "-" "_" $name) $value }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{- /* How the worker's GPUs are split (JSON): tensor parallel count/pipeline parallel, and the
pipeline parallel size (engineArgs.pipeline_parallel_size, 1 unset). */}}
{{- define "tokenmesh.workerParallelism" -}}
{{- $args := include "tokenmesh.workerEngineArgs" . | fromJson }}
{{- $gpus := int .values.gpu.count }}
{{- $pipeline := int (get $args "pipeline_parallel_size" | default 1) }}
{{- $tensor := ternary (div $gpus $pipeline) 1 (gt $gpus 0) }}
{{- toJson (dict "tensor" $tensor "pipeline" $pipeline) }}
{{- end }}

{{- /* The worker's container resources: what worker.resources sets, the rest per GPU
(gpu.perGpu times gpu.count, at least one GPU's worth), and a core per front end beyond the
first. */}}
{{- define "tokenmesh.workerResources" -}}
{{- $worker := .values }}
{{- $per := $worker.gpu.perGpu }}
{{- $n := max 1 (int $worker.gpu.count) }}
{{- $resources := deepCopy ($worker.resources | default dict) }}
{{- $requests := $resources.requests | default dict }}
{{- $limits := $resources.limits | default dict }}
{{- $frontends := sub (max 1 (int ($worker.frontends | default 1))) 1 }}
{{- if not (hasKey $requests "cpu") }}{{ $_ := set $requests "cpu" (add (mul $n (int $per.cpu)) $frontends | toString) }}{{ end }}
{{- if not (hasKey $requests "memory") }}{{ $_ := set $requests "memory" (printf "%dGi" (mul $n (int $per.memoryGi))) }}{{ end }}
{{- if not (hasKey $limits "memory") }}{{ $_ := set $limits "memory" (printf "%dGi" (mul $n (int $per.memoryLimitGi))) }}{{ end }}
{{- $_ := set $resources "requests" $requests }}
{{- $_ := set $resources "limits" $limits }}
{{- toJson $resources }}
{{- end }}

{{- /* The worker's /dev/shm: shmSize, or gpu.perGpu.shmGi per GPU. */}}
{{- define "tokenmesh.workerShm" -}}
{{- $worker := .values }}
{{- $worker.shmSize | default (printf "%dGi" (mul (max 1 (int $worker.gpu.count)) (int $worker.gpu.perGpu.shmGi))) }}
{{- end }}

{{- /* What one pool's worker values can never do (the default pool's: key "worker", a further
pool's: "worker.pools[<name>]"). (dict "values" $values "key" where) */}}
{{- define "tokenmesh.workerChecks" -}}
{{- $worker := .values }}
{{- $key := .key }}
{{- $memory := dig "limits" "memory" "" (include "tokenmesh.workerResources" . | fromJson) }}
{{- $shm := include "tokenmesh.workerShm" . }}
{{- if ge (float64 (include "tokenmesh.bytes" $shm)) (float64 (include "tokenmesh.bytes" $memory)) }}
{{- fail (printf "%s.shmSize (%s) must be below the worker's memory limit (%s): /dev/shm is memory-backed and counts against the limit" $key $shm $memory) }}
{{- end }}
{{- $gpus := int $worker.gpu.count }}
{{- if gt $gpus (int $worker.gpu.maxPerNode) }}
{{- fail (printf "%s.gpu.count (%d) is more GPUs than one node offers (%s.gpu.maxPerNode, %d): a worker is one engine in one pod, and multi-node serving is not supported; use fewer GPUs per worker and more replicas" $key $gpus $key (int $worker.gpu.maxPerNode)) }}
{{- end }}
{{- $args := include "tokenmesh.workerEngineArgs" . | fromJson }}
{{- range $name := list "data_parallel_size" "nnodes" }}
{{- if gt (int (get $args $name | default 1)) 1 }}
{{- fail (printf "%s.engineArgs.%s: a worker is one engine in one pod on one node; scale with %s.replicas (each pod an engine) instead" $key $name $key) }}
{{- end }}
{{- end }}
{{- $pipeline := int (get $args "pipeline_parallel_size" | default 1) }}
{{- if and (gt $pipeline 1) (or (eq $gpus 0) (ne (mod $gpus $pipeline) 0)) }}
{{- fail (printf "%s.engineArgs.pipeline_parallel_size (%d) must divide %s.gpu.count (%d): the pod's GPUs are split into that many stages" $key $pipeline $key $gpus) }}
{{- end }}
{{- $parallel := include "tokenmesh.workerParallelism" . | fromJson }}
{{- if and (hasKey $args "tensor_parallel_size") (ne (int (get $args "tensor_parallel_size")) (int $parallel.tensor)) }}
{{- fail (printf "%s.engineArgs.tensor_parallel_size (%d) disagrees with %s.gpu.count (%d GPUs, pipeline parallel %d: tensor parallel %d); leave it out, the chart sets it" $key (int (get $args "tensor_parallel_size")) $key $gpus $pipeline (int $parallel.tensor)) }}
{{- end }}
{{- end }}

{{- /*
worker.pools: names as the schema has them (a DNS label each, at most 32 characters), given
once, each with a model, its Service's name within 63 characters; their workers and
autoscalers checked as the default's; a claim
every pool can mount; only with Kubernetes discovery (a worker registers in Consul as
`worker`, whatever its pool).
*/}}
{{- define "tokenmesh.poolChecks" -}}
{{- $seen := dict }}
{{- range $pool := .Values.worker.pools | default list }}
{{- $name := toString $pool.name }}
{{- if not (regexMatch "^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$" $name) }}
{{- fail (printf "worker.pools: pool name %q must be a DNS label of 1 to 32 characters (lower-case letters, digits and '-', starting and ending with a letter or digit): it names the pool's Envoy cluster worker-<name> and its objects" $name) }}
{{- end }}
{{- if hasKey $seen $name }}
{{- fail (printf "worker.pools: pool name %q is given twice" $name) }}
{{- end }}
{{- $_ := set $seen $name true }}
{{- end }}
{{- $storage := .Values.worker.model.storage }}
{{- if and .Values.worker.pools (eq $storage.type "pvc") (has $storage.pvc.accessMode (list "ReadWriteOnce" "ReadWriteOncePod")) }}
{{- fail (printf "worker.pools share the workers' claim, and worker.model.storage.pvc.accessMode=%s mounts it for one node or pod only: use ReadWriteMany with pools" $storage.pvc.accessMode) }}
{{- end }}
{{- range include "tokenmesh.workerPools" . | fromJsonArray }}
{{- $key := printf "worker.pools[%s]" .name }}
{{- $service := include "tokenmesh.headlessName" (dict "root" $ "component" .component) }}
{{- if gt (len $service) 63 }}
{{- fail (printf "%s: its headless Service would be named %s, %d characters, and Service names have at most 63: use a pool name of at most %d characters here (or a shorter release name or fullnameOverride)" $key $service (len $service) (sub 63 (sub (len $service) (len .name)))) }}
{{- end }}
{{- if not .values.model.name }}
{{- fail (printf "%s.model.name is required: each pool serves a base model of its own" $key) }}
{{- end }}
{{- include "tokenmesh.workerChecks" (dict "values" .values "key" $key) }}
{{- $scaling := .values.autoscaling }}
{{- if and $scaling.enabled .values.keda.enabled }}
{{- fail (printf "%s.autoscaling.enabled and worker.keda.enabled cannot both be on: KEDA makes its own HorizontalPodAutoscaler, and two autoscalers would fight over the replica count" $key) }}
{{- end }}
{{- if and $scaling.enabled (gt (int $scaling.minReplicas) (int $scaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $key (int $scaling.minReplicas) (int $scaling.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{- /*
worker.pools, each as the workers' values with the pool's own on top (JSON list of
{"name", "component": "worker-<name>", "values"}): maps merge key by key, except that a pool's
engineArgs, nodeSelector, tolerations and affinity replace the workers' whole, and model.name,
servedName and loraModules are the pool's only (model.storage and hfToken are the workers').
Its pods carry the label tokenmesh.io/pool.
*/}}
{{- define "tokenmesh.workerPools" -}}
{{- $worker := omit .Values.worker "pools" }}
{{- $replaced := list "engineArgs" "nodeSelector" "tolerations" "affinity" }}
{{- $found := list }}
{{- range $pool := .Values.worker.pools | default list }}
{{- $values := deepCopy $worker }}
{{- $_ := set $values "model" (omit $values.model "name" "servedName" "loraModules") }}
{{- range $key, $value := omit $pool "name" }}
{{- if and (kindIs "map" $value) (kindIs "map" (get $values $key)) (not (has $key $replaced)) }}
{{- include "tokenmesh.mergeInto" (dict "into" (get $values $key) "from" $value) }}
{{- else }}
{{- $_ := set $values $key (deepCopy $value) }}
{{- end }}
{{- end }}
{{- $_ := set $values "podLabels" (merge (dict "tokenmesh.io/pool" (toString $pool.name)) ($values.podLabels | default dict)) }}
{{- $found = append $found (dict "name" (toString $pool.name) "component" (printf "worker-%s" $pool.name) "values" $values) }}
{{- end }}
{{- toJson $found }}
{{- end }}

{{- /* worker.pools' names, in order (JSON list). */}}
{{- define "tokenmesh.poolNames" -}}
{{- $names := list }}
{{- range .Values.worker.pools | default list }}{{ $names = append $names (toString .name) }}{{ end }}
{{- toJson $names }}
{{- end }}

{{- /* Sets each key of from in into, maps merged key by key (zeros and empties too, which
sprig's merge skips). (dict "into" map "from" map) */}}
{{- define "tokenmesh.mergeInto" -}}
{{- $into := .into }}
{{- range $key, $value := .from }}
{{- if and (kindIs "map" $value) (kindIs "map" (get $into $key)) }}
{{- include "tokenmesh.mergeInto" (dict "into" (get $into $key) "from" $value) }}
{{- else }}
{{- $_ := set $into $key (deepCopy $value) }}
{{- end }}
{{- end }}
{{- end }}
