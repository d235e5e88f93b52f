{{/* Names, labels, images, probes and the kinds every component shares. */}}

{{- define "tokenmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one component's objects: (dict "root" $ "component" "worker"). */}}
{{- define "tokenmesh.componentName" -}}
{{- printf "%s-%s" (include "tokenmesh.fullname" .root | trunc 48 | trimSuffix "-") .component }}
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

{{- define "tokenmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "tokenmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tokenmesh
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
startup probe holds liveness off until then.
(dict "port" int "component" name "startup" (dict "periodSeconds" n "failureThreshold" n))
*/}}
{{- define "tokenmesh.grpcProbes" -}}
{{- $service := include "tokenmesh.healthService" .component }}
{{- $startup := .startup | default (dict "periodSeconds" 2 "failureThreshold" 60) }}
startupProbe:
  grpc:
    port: {{ .port }}
    service: {{ $service }}
  periodSeconds: {{ $startup.periodSeconds }}
  failureThreshold: {{ $startup.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ .port }}
    service: {{ $service }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ .port }}
    service: ""
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
{{- end }}

{{/* nodeSelector, tolerations, affinity from a component's values. */}}
{{- define "tokenmesh.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
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
{{- range $name, $value := .values.env }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* The pod template's common spec: pull secrets, security context, scheduling. */}}
{{- define "tokenmesh.podCommon" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "tokenmesh.podSecurityContext" .root | nindent 2 }}
{{- include "tokenmesh.scheduling" .values }}
{{- end }}

{{/* A headless Service for a Python component: gRPC and metrics ports, ready pods only. */}}
{{- define "tokenmesh.headlessService" -}}
{{- $values := index .root.Values .component }}
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
      port: {{ include "tokenmesh.port" . }}
      targetPort: grpc
      appProtocol: grpc
    - name: metrics
      port: {{ $values.metricsPort }}
      targetPort: metrics
{{- end }}
{{- end }}

{{- define "tokenmesh.pdb" -}}
{{- $values := index .root.Values .component }}
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
Ingress of a Python component: its gRPC port from Envoy's pods only (and from Consul's health
checks in consul mode), its metrics port from networkPolicy.metricsFrom.
*/}}
{{- define "tokenmesh.serviceNetworkPolicy" -}}
{{- $values := index .root.Values .component }}
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
    - from:
        {{- toYaml .root.Values.networkPolicy.metricsFrom | nindent 8 }}
      ports:
        - port: metrics
{{- end }}
{{- end }}

{{/*
A ServiceMonitor for a component, when enabled and the Prometheus Operator's CRD exists. The
dashboards and alerts select on `service` (gateway, worker, ...) and `replica` (the pod), as
the local stack labels them.
(dict "root" $ "component" "worker" "service" name "port" portName "path" path)
*/}}
{{- define "tokenmesh.serviceMonitor" -}}
{{- $values := index .root.Values .component }}
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
          replacement: {{ .component }}
        - sourceLabels: [__meta_kubernetes_pod_name]
          targetLabel: replica
      {{- if eq .component "worker" }}
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
with TLS when envoy.tls.enabled, mTLS to the services when mtls.enabled, the control plane's placeholder host replaced by its
headless Service. Listener and admin ports are read from it, never repeated in values.
*/}}
{{- define "tokenmesh.envoyConfig" -}}
{{- $file := printf "files/envoy%s%s.yaml" (ternary "-tls" "" .Values.envoy.tls.enabled) (ternary "-mtls" "" .Values.mtls.enabled) }}
{{- $host := printf "%s.%s.svc.%s" (include "tokenmesh.headlessName" (dict "root" . "component" "controlplane")) .Release.Namespace .Values.clusterDomain }}
{{- .Files.Get $file | replace "${TOKENMESH_CONTROLPLANE_HOST}" $host }}
{{- end }}

{{/* A port of the generated Envoy config: (dict "root" $ "listener" "edge"|"worker"|"reranker"|"admin"|"xds") */}}
{{- define "tokenmesh.envoyPort" -}}
{{- $config := .root.Files.Get "files/envoy.yaml" | fromYaml }}
{{- $port := 0 }}
{{- if eq .listener "admin" }}
{{- $port = $config.admin.address.socket_address.port_value }}
{{- else if eq .listener "xds" }}
{{- range $config.static_resources.clusters }}
{{- if eq .name "xds_cluster" }}
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
{{- end }}
{{- end }}

{{/* The port a service's probes ask: its gRPC port, or with mTLS the plaintext health port. */}}
{{- define "tokenmesh.probePort" -}}
{{- if .root.Values.mtls.enabled }}{{ .root.Values.mtls.healthPort }}{{ else }}{{ .values.port }}{{ end }}
{{- end }}
