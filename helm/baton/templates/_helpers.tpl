{{/* Names and labels. Names stay within 40 characters: KubeRay allows RayService names of
at most 47, and appends suffixes of its own to Services and pods. */}}

{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "baton.fullname" -}}
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

{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "baton.labels" -}}
helm.sh/chart: {{ include "baton.chart" . }}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: baton
{{- end }}

{{/* Labels of a component: pass (dict "root" $ "component" "redis"). */}}
{{- define "baton.componentLabels" -}}
{{ include "baton.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "baton.componentSelectorLabels" -}}
{{ include "baton.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* A label selector of the release's Ray pods (heads, GPU workers and gateway workers). */}}
{{- define "baton.rayPodSelector" -}}
matchLabels:
  {{- include "baton.selectorLabels" . | nindent 2 }}
matchExpressions:
  - {key: app.kubernetes.io/component, operator: In, values: [ray-head, ray-worker, ray-gateway]}
{{- end }}

{{/* The Ray resource each gateway replica asks one unit of (deploy/config.py's
gateway_resources): the nodes that declare it are where gateways run. */}}
{{- define "baton.gatewayResourceName" -}}
baton_gateway
{{- end }}

{{/* That resource as `ray start --resources` takes it in KubeRay's rayStartParams: pass the
amount a node declares. JSON in single quotes for the shell KubeRay runs `ray start` in, the
form KubeRay writes itself: it parses the value to add accelerators, and a backslash-escaped
one fails that parse with an error on every pod it builds (tests/test_kube_chart.py). */}}
{{- define "baton.gatewayResource" -}}
{{- printf "'{\"%s\": %d}'" (include "baton.gatewayResourceName" nil) (int .) }}
{{- end }}

{{/* A NetworkPolicy peer: pass a {namespace, podLabels} value. */}}
{{- define "baton.namespacePeer" -}}
namespaceSelector:
  matchLabels: {kubernetes.io/metadata.name: {{ .namespace }}}
podSelector:
  {{- with .podLabels }}
  matchLabels:
    {{- toYaml . | nindent 4 }}
  {{- else }} {}
  {{- end }}
{{- end }}

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "baton.serveServiceName" -}}
{{- printf "%s-serve" (include "baton.fullname" .) }}
{{- end }}

{{- define "baton.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "baton.fullname" .)) }}
{{- end }}

{{- define "baton.rayAuthSecretName" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "baton.fullname" .)) }}
{{- end }}

{{/* The Ray pods' ServiceAccount; empty: KubeRay's own (the head's autoscaler account). */}}
{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.name | default (include "baton.fullname" .) }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Whether the Ray autoscaler runs (KubeRay's in-tree autoscaler, a sidecar of the head). */}}
{{- define "baton.autoscaling" -}}
{{- if lt (int .Values.workers.minReplicas) (int .Values.workers.maxReplicas) }}true{{ end }}
{{- end }}

{{- define "baton.redisName" -}}
{{- printf "%s-redis" (include "baton.fullname" .) }}
{{- end }}

{{- define "baton.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "baton.redisName" .) }}
{{- end }}

{{/* The Redis of Ray's GCS fault tolerance (gcsFaultTolerance.redis chart): never the index's. */}}
{{- define "baton.gcsRedisName" -}}
{{- printf "%s-gcs-redis" (include "baton.fullname" .) }}
{{- end }}

{{- define "baton.gcsRedisSecretName" -}}
{{- .Values.gcsFaultTolerance.chartRedis.auth.existingSecret | default (include "baton.gcsRedisName" .) }}
{{- end }}

{{/* The model file the replicas load; empty for the model inside the image. */}}
{{- define "baton.modelPath" -}}
{{- if ne .Values.model.source "image" }}
{{- printf "%s/%s" .Values.model.mountPath .Values.model.file }}
{{- end }}
{{- end }}

{{/* The model's name in the API, as Baton derives it (BatonConfig.served_model_name). */}}
{{- define "baton.servedModelName" -}}
{{- if .Values.model.name }}
{{- .Values.model.name }}
{{- else if eq .Values.model.source "image" }}
{{- "SmolLM2-135M-Instruct.Q4_1" }}
{{- else }}
{{- regexReplaceAll "\\.[^.]*$" (base .Values.model.file) "" }}
{{- end }}
{{- end }}

{{/* Rules across values, which a JSON schema cannot state: they fail `helm template` and
`helm install` (helm lint only reports them as INFO). */}}
{{- define "baton.validate" -}}
{{- if not (regexMatch "^[a-z]" (include "baton.fullname" .)) }}
{{- fail (printf "the RayService name %q must start with a letter (KubeRay): set fullnameOverride" (include "baton.fullname" .)) }}
{{- end }}
{{- $w := .Values.workers }}
{{- if or (gt (int $w.minReplicas) (int $w.replicas)) (gt (int $w.replicas) (int $w.maxReplicas)) }}
{{- fail (printf "workers: need minReplicas (%d) <= replicas (%d) <= maxReplicas (%d)" (int $w.minReplicas) (int $w.replicas) (int $w.maxReplicas)) }}
{{- end }}
{{- $shutdown := add 90 (int .Values.replicas.handoffSeconds) }}
{{- if lt (int $w.terminationGracePeriodSeconds) (int $shutdown) }}
{{- fail (printf "workers.terminationGracePeriodSeconds (%d) must be at least %d: 60 s to start a replacement and drain, replicas.handoffSeconds, and 30 s to close" (int $w.terminationGracePeriodSeconds) (int $shutdown)) }}
{{- end }}
{{- $taken := list 6379 8265 10001 52365 (int .Values.metrics.port) }}
{{- if has (int .Values.serve.port) $taken }}
{{- fail (printf "serve.port %d is taken by Ray (GCS 6379, dashboard 8265, client 10001, dashboard agent 52365) or metrics.port" (int .Values.serve.port)) }}
{{- end }}
{{- if semverCompare "<2.53.0" .Values.rayVersion }}
{{- fail (printf "rayVersion %s: the chart needs Ray 2.53.0 or later (token auth, the Ray node's /api/healthz)" .Values.rayVersion) }}
{{- end }}
{{- if and .Values.model.mmproj (not (has .Values.model.source (list "pvc" "hostPath"))) }}
{{- fail (printf "model.mmproj is read from the model volume: model.source %s has none it can be in (use pvc or hostPath)" .Values.model.source) }}
{{- end }}
{{- if and .Values.routing (ne .Values.router "baton") }}
{{- fail (printf "routing is Baton's router's: router %s never reads it (leave routing empty)" .Values.router) }}
{{- end }}
{{- $disk := .Values.diskTier }}
{{- if and $disk.enabled (eq $disk.volume "hostPath") (not ($disk.hostPath | default dict).path) }}
{{- fail "diskTier.volume is hostPath: set diskTier.hostPath.path (a directory on every GPU node)" }}
{{- end }}
{{- $chartEnv := list "RAY_AUTH_MODE" "RAY_AUTH_TOKEN" "RAY_REDIS_ADDRESS" "REDIS_PASSWORD" "REDIS_USERNAME" }}
{{- range include "baton.rayEnv" . | fromYamlArray }}
{{- $chartEnv = append $chartEnv .name }}
{{- end }}
{{- range .Values.extraEnv }}
{{- if has .name $chartEnv }}
{{- fail (printf "extraEnv: %s is set by the chart (or KubeRay); use its value instead" .name) }}
{{- end }}
{{- end }}
{{- $pdb := .Values.podDisruptionBudget }}
{{- if and $pdb.enabled (ge (int $pdb.minAvailable) (int $w.maxReplicas)) }}
{{- fail (printf "podDisruptionBudget.minAvailable (%d) must be below workers.maxReplicas (%d), or no ready worker could ever be evicted" (int $pdb.minAvailable) (int $w.maxReplicas)) }}
{{- end }}
{{- $r := .Values.replicas }}
{{- $most := int $r.count }}
{{- if $r.autoscaling.enabled }}
{{- $most = int (($r.autoscaling.config | default dict).max_replicas | default 1) }}
{{- end }}
{{- if gt (float64 $r.gpus) 0.0 }}
{{- /* A replica's GPUs come from one worker, and a share below one GPU from one GPU
       (as deploy/capacity_check.py's gpu_room counts them). */}}
{{- $perWorker := floor (addf (divf $w.gpus $r.gpus) 0.000000001) }}
{{- if lt (float64 $r.gpus) 1.0 }}
{{- $perWorker = mulf $w.gpus (floor (addf (divf 1 $r.gpus) 0.000000001)) }}
{{- end }}
{{- if gt (float64 $most) (mulf $w.maxReplicas $perWorker) }}
{{- fail (printf "replicas: %d replicas x %v GPUs do not fit on workers.maxReplicas (%d) x workers.gpus (%d) GPUs: each worker holds %d such replica(s), a replica's GPUs coming from one worker (num_gpus_per_replica is replicas.gpus)" $most $r.gpus (int $w.maxReplicas) (int $w.gpus) (int $perWorker)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A worker pod's preStop: drain its Ray node, so Serve moves the replicas elsewhere and stops
these gracefully (requests finish, checkpoints are handed off); `ray stop` once no replica
process is left, or a little before the pod's grace period ends.
*/}}
{{- define "baton.workerPreStop" -}}
{{- $grace := int .Values.workers.terminationGracePeriodSeconds -}}
ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "pod terminating" --deadline-remaining-seconds {{ $grace }} || true; end=$(( $(date +%s) + {{ sub $grace 10 }} )); while grep -qs ServeReplica: /proc/[0-9]*/cmdline && [ "$(date +%s)" -lt "$end" ]; do sleep 1; done; ray stop
{{- end }}
