{{/*
Names, labels and the pieces shared by the head and worker pod templates.
*/}}

{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name. Kept to 40 characters: KubeRay derives the RayCluster, pod and
service names from the RayService name and adds suffixes of its own.
*/}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "specserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "specserve.authSecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else if .Values.auth.create }}
{{- printf "%s-auth" (include "specserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* The OTLP endpoint the pods export to: the configured one, else the bundled Jaeger, else "". */}}
{{- define "specserve.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint }}
{{- .Values.tracing.otlpEndpoint }}
{{- else if .Values.jaeger.enabled }}
{{- printf "http://%s-jaeger.%s.svc:4317" (include "specserve.fullname" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/* Checks that values.schema.json cannot express. */}}
{{- define "specserve.validate" -}}
{{- if lt (int .Values.app.router.exit_threshold) (int .Values.app.router.enter_threshold) }}
{{- fail (printf "app.router.exit_threshold (%v) must be >= app.router.enter_threshold (%v): the router's hysteresis needs exit above enter" .Values.app.router.exit_threshold .Values.app.router.enter_threshold) }}
{{- end }}
{{- if and .Values.auth.create .Values.auth.existingSecret }}
{{- fail "auth.create and auth.existingSecret are exclusive: name an existing Secret or let the chart create one" }}
{{- end }}
{{- if and .Values.auth.create (not .Values.auth.token) }}
{{- fail "auth.create needs auth.token (or use auth.existingSecret)" }}
{{- end }}
{{- range $g := list .Values.targetWorkers .Values.draftWorkers }}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) }}
{{- fail (printf "worker group %s: replicas (%v) must lie within [minReplicas %v, maxReplicas %v]" $g.groupName $g.replicas $g.minReplicas $g.maxReplicas) }}
{{- end }}
{{- end }}
{{- if eq .Values.targetWorkers.groupName .Values.draftWorkers.groupName }}
{{- fail "targetWorkers.groupName and draftWorkers.groupName must differ" }}
{{- end }}
{{- end }}

{{/*
The serve application's arguments (AppConfig). auth and telemetry come from the auth and
tracing values so that the pods' environment and the app agree: token_env is set only when a
Secret fills SPECSERVE_AUTH_TOKEN (the Router refuses to start with a named but empty variable);
telemetry.enabled is left unset (on when an endpoint is known) when tracing is on without an
endpoint (the app refuses enabled=true without one).
*/}}
{{- define "specserve.appArgs" -}}
{{- $a := .Values.app }}
{{- $endpoint := include "specserve.otlpEndpoint" . }}
{{- $args := dict
  "model" $a.model
  "dtype" $a.dtype
  "drafter" $a.drafter
  "num_draft_tokens" $a.num_draft_tokens
  "suffix_corpus" $a.suffix_corpus
  "force_vocab_mismatch" (default false $a.force_vocab_mismatch)
  "placement" $a.placement
  "torch_threads" $a.torch_threads
  "router" $a.router
  "moe" (default (dict) $a.moe)
  "kvsync" (default (dict) $a.kvsync)
  "limits" $a.limits
  "http" (default (dict) $a.http)
  "auth" (dict "token_env" (ternary "SPECSERVE_AUTH_TOKEN" nil (ne (include "specserve.authSecretName" .) "")))
  "telemetry" (dict "otlp_endpoint" (ternary $endpoint nil (ne $endpoint "")) "sampling_ratio" .Values.tracing.samplingRatio "service_name" .Values.tracing.serviceName "enabled" (ternary nil .Values.tracing.enabled (and .Values.tracing.enabled (eq $endpoint ""))))
  "router_deployment" $a.router_deployment
  "spec_engine" $a.spec_engine
  "batch_engine" $a.batch_engine
  "draft_server" $a.draft_server
}}
{{- toYaml $args }}
{{- end }}

{{/* The whole Serve config (ServeDeploySchema) carried by spec.serveConfigV2. */}}
{{- define "specserve.serveConfig" -}}
{{- $app := dict
  "name" .Values.serve.applicationName
  "route_prefix" .Values.serve.routePrefix
  "import_path" .Values.serve.importPath
  "args" (include "specserve.appArgs" . | fromYaml)
}}
{{- /* EveryNode: a proxy on every node with replicas, so each worker answers its own gRPC probe. */}}
{{- $cfg := dict
  "proxy_location" "EveryNode"
  "http_options" (dict "host" "0.0.0.0" "port" .Values.serve.httpPort)
  "grpc_options" (dict "port" .Values.serve.grpcPort "grpc_servicer_functions" .Values.serve.grpcServicerFunctions)
  "applications" (list $app)
}}
{{- toYaml $cfg }}
{{- end }}

{{/* Environment shared by every Ray container. */}}
{{- define "specserve.env" -}}
{{- $secret := include "specserve.authSecretName" . }}
{{- if $secret }}
- name: SPECSERVE_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.auth.secretKey }}
{{- end }}
- name: SPECSERVE_CACHE
  value: {{ printf "%s/specserve" .Values.modelCache.mountPath | quote }}
{{- /* Ray Serve's gRPC proxy reads messages up to 2 GiB unless told otherwise: cap it at the app's
  limit (or the largest unary response, max_tokens x 64 bytes + 64 KiB, if larger), as
  AppConfig.proxy_max_message_bytes computes it; defaults as in AppConfig's Limits. */}}
{{- $limits := .Values.app.limits | default dict }}
{{- $request := int (get $limits "max_message_bytes" | default 1048576) }}
{{- $response := add (mul (int (get $limits "max_tokens" | default 1024)) 64) 65536 }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ max $request $response | quote }}
{{- /* Ray Serve kills a proxy that has not reported ready after 3 x 5 s; a busy node (models
  loading on few cores) takes longer: deployments/local.py SLOW_START_ENV gives the same 30 s. */}}
- name: RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S
  value: "30"
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.modelCache.mountPath | quote }}
{{- $endpoint := include "specserve.otlpEndpoint" . }}
{{- if $endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: grpc
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ .Values.tracing.serviceName | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .Values.tracing.samplingRatio | toString | quote }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "specserve.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "specserve.volumes" -}}
# Ray's object store lives in shared memory; the container default (64Mi) is far too small.
- name: dshm
  emptyDir:
    medium: Memory
- name: model-cache
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelCache.sizeLimit }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Pod template of one Ray node. Called with (dict "root" $ "group" <group values> "role" "head"|"worker").
*/}}
{{- define "specserve.podTemplate" -}}
{{- $root := .root }}
{{- $g := .group }}
{{- $isHead := eq .role "head" }}
metadata:
  labels:
    {{- include "specserve.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ ternary "head" $g.groupName $isHead }}
    specserve.io/ray: "true"
    specserve.io/ray-node: {{ ternary "head" "worker" $isHead }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" $isHead }}
      image: {{ include "specserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- with $root.Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        {{- include "specserve.env" $root | trim | nindent 8 }}
      ports:
        {{- if $isHead }}
        - name: gcs-server
          containerPort: 6379
        {{- if $root.Values.head.exposeDashboard }}
        - name: dashboard
          containerPort: 8265
        {{- end }}
        {{- if $root.Values.head.exposeClient }}
        - name: client
          containerPort: 10001
        {{- end }}
        # KubeRay's <name>-serve-svc (HTTP) is built from the head port named "serve", and its
        # proxy health check uses it: keep it on the HTTP port.
        - name: serve
          containerPort: {{ $root.Values.serve.httpPort }}
        {{- else }}
        # the OpenAI-compatible HTTP API through this worker's Serve proxy (the Service's http port)
        - name: http
          containerPort: {{ $root.Values.serve.httpPort }}
        {{- end }}
        - name: grpc
          containerPort: {{ $root.Values.serve.grpcPort }}
        {{- if $root.Values.metrics.enabled }}
        - name: metrics
          containerPort: {{ $root.Values.metrics.port }}
        {{- end }}
      {{- if not $isHead }}
      {{- with $root.Values.probes.readiness }}
      {{- if .enabled }}
      readinessProbe:
        grpc:
          port: {{ $root.Values.serve.grpcPort }}
          service: {{ .grpcService | quote }}
        initialDelaySeconds: {{ .initialDelaySeconds }}
        periodSeconds: {{ .periodSeconds }}
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ .failureThreshold }}
      {{- end }}
      {{- end }}
      {{- with $root.Values.probes.liveness }}
      {{- if .enabled }}
      startupProbe:
        grpc:
          port: {{ $root.Values.serve.grpcPort }}
          service: {{ .grpcService | quote }}
        periodSeconds: {{ .periodSeconds }}
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ .startupFailureThreshold }}
      livenessProbe:
        grpc:
          port: {{ $root.Values.serve.grpcPort }}
          service: {{ .grpcService | quote }}
        periodSeconds: {{ .periodSeconds }}
        timeoutSeconds: {{ .timeoutSeconds }}
        failureThreshold: {{ .failureThreshold }}
      {{- end }}
      {{- end }}
      lifecycle:
        preStop:
          exec:
            command: ["/bin/sh", "-c", "ray stop"]
      {{- end }}
      resources:
        {{- toYaml $g.resources | nindent 8 }}
      volumeMounts:
        {{- include "specserve.volumeMounts" $root | trim | nindent 8 }}
  volumes:
    {{- include "specserve.volumes" $root | trim | nindent 4 }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
rayStartParams of a group: the user's, plus the metrics port when it is not Ray's default, plus
(head only) the dashboard bound to the pod's loopback unless head.dashboardHost or the user's own
dashboard-host opens it (KubeRay would otherwise bind it to 0.0.0.0: the dashboard submits jobs,
so whoever reaches it runs code in the cluster).
*/}}
{{- define "specserve.rayStartParams" -}}
{{- $p := deepCopy (default (dict) .group.rayStartParams) }}
{{- if .root.Values.metrics.enabled }}
{{- $_ := set $p "metrics-export-port" (toString .root.Values.metrics.port) }}
{{- end }}
{{- if and .head (not (hasKey $p "dashboard-host")) }}
{{- $_ := set $p "dashboard-host" .root.Values.head.dashboardHost }}
{{- end }}
{{- if $p }}
{{- toYaml $p }}
{{- else }}
{}
{{- end }}
{{- end }}
