{{/* Pieces shared by the Ray head and worker pod templates. */}}

{{/* BATON_* settings from Secrets: baton_serve.deploy.app.app_builder reads them (load_config)
under the Serve config's args, wherever Serve builds the app. Each replica reads BATON_HMAC_KEY
from its own pod's environment: the cluster key is never in the Serve config or a deployment's
arguments (cache_store/checkpoints/cluster_key.py). The index's password is not in REDIS_PASSWORD: KubeRay
sets that one for GCS fault tolerance, and refuses a head that has it. The RAY_SERVE_* settings are
`baton serve`'s local cluster's (deploy/local_ray.py: HTTP through Serve's HAProxy straight to
the gateway replica, Serve's calls over gRPC, user code and request router on each replica's own
event loop, the controller's loop every 0.5 s, gRPC messages up to 64 MiB). */}}
{{- define "baton.rayEnv" -}}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
  value: "2"
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: "1"
- name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
  value: "0"
- name: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP
  value: "0"
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "0.5"
- name: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
  value: "67108864"
- name: BATON_HMAC_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "baton.authSecretName" . }}, key: hmac-key}
{{- if .Values.auth.requireApiKey }}
- name: BATON_API_KEYS
  valueFrom:
    secretKeyRef: {name: {{ include "baton.authSecretName" . }}, key: api-keys}
{{- end }}
{{- if eq .Values.redis.mode "chart" }}
- name: REDIS_INDEX_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "baton.redisSecretName" . }}, key: redis-password}
- name: BATON_INDEX
  value: "redis://:$(REDIS_INDEX_PASSWORD)@{{ include "baton.redisName" . }}:6379/0"
{{- else if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret }}
- name: BATON_INDEX
  valueFrom:
    secretKeyRef: {name: {{ .Values.redis.external.existingSecret }}, key: {{ .Values.redis.external.existingSecretKey }}}
{{- end }}
{{- end }}

{{/* The Ray containers' environment: the BATON_* settings, then extraEnv. */}}
{{- define "baton.rayContainerEnv" -}}
{{ include "baton.rayEnv" . | trim }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* extraEnv and envFrom of a container of the Ray pods, as container fields. */}}
{{- define "baton.extraEnvFields" -}}
{{- with .Values.extraEnv }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "baton.modelVolumes" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim: {claimName: {{ .Values.model.pvc.claimName }}, readOnly: true}
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath: {path: {{ .Values.model.hostPath.path }}, type: Directory}
{{- else if eq .Values.model.source "download" }}
- name: model
  emptyDir: {sizeLimit: {{ .Values.model.download.sizeLimit }}}
{{- else if eq .Values.model.source "hf" }}
- name: model
  emptyDir: {sizeLimit: 1Mi}
- name: model-cache
  persistentVolumeClaim: {claimName: {{ .Values.model.hf.cache.claimName }}}
{{- with .Values.model.hf.tokenSecret }}
- name: hf-token
  secret: {secretName: {{ . }}, items: [{key: token, path: token}]}
{{- end }}
{{- end }}
{{- end }}

{{/* Every volume of a Ray pod: the model's, and the disk tier's. */}}
{{- define "baton.rayVolumes" -}}
{{ include "baton.modelVolumes" . }}
{{- $disk := .Values.diskTier }}
{{- if $disk.enabled }}
- name: checkpoints
{{- if eq $disk.volume "hostPath" }}
  hostPath: {path: {{ $disk.hostPath.path }}, type: DirectoryOrCreate}
{{- else }}
  emptyDir:
    {{- with $disk.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
    {{- with $disk.emptyDir.medium }}
    medium: {{ . }}
    {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "baton.rayVolumeMounts" -}}
{{ include "baton.modelVolumeMounts" . }}
{{- if .Values.diskTier.enabled }}
- {name: checkpoints, mountPath: {{ .Values.diskTier.path }}}
{{- end }}
{{- end }}

{{- define "baton.modelVolumeMounts" -}}
{{- if ne .Values.model.source "image" }}
- {name: model, mountPath: {{ .Values.model.mountPath }}, readOnly: true}
{{- end }}
{{- if eq .Values.model.source "hf" }}
- {name: model-cache, mountPath: {{ .Values.model.hf.cache.mountPath }}, readOnly: true}
{{- end }}
{{- end }}

{{/* Downloads the model into the pod's emptyDir and checks its SHA-256 before Ray starts. */}}
{{- define "baton.modelInitContainers" -}}
{{- if eq .Values.model.source "download" }}
- name: model-download
  image: {{ include "baton.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [python, -m, baton_serve.deploy.model_download]
  args:
    - {{ .Values.model.download.url | quote }}
    - {{ .Values.model.download.sha256 | lower | quote }}
    - {{ include "baton.modelPath" . | quote }}
  {{- with include "baton.extraEnvFields" . }}
  {{- . | nindent 2 }}
  {{- end }}
  volumeMounts:
    - {name: model, mountPath: {{ .Values.model.mountPath }}}
  resources:
    requests: {cpu: 250m, memory: 256Mi}
    limits: {cpu: "1", memory: 512Mi}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- else if eq .Values.model.source "hf" }}
{{- $hf := .Values.model.hf }}
- name: model-download
  image: {{ include "baton.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [python, -m, baton_serve.deploy.model_download]
  args:
    - {{ printf "hf://%s/%s" $hf.repo .Values.model.file | quote }}
    - --revision
    - {{ $hf.revision | quote }}
    {{- with $hf.sha256 }}
    - --sha256
    - {{ . | lower | quote }}
    {{- end }}
    - --cache
    - {{ $hf.cache.mountPath | quote }}
    - --link
    - {{ include "baton.modelPath" . | quote }}
  env:
    - {name: BATON_CACHE_DIR, value: {{ $hf.cache.mountPath | quote }}}
    {{- with $hf.tokenSecret }}
    - {name: HF_TOKEN_PATH, value: /var/run/secrets/hf/token}
    {{- end }}
    {{- with $hf.endpoint }}
    - {name: HF_ENDPOINT, value: {{ . | quote }}}
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - {name: model, mountPath: {{ .Values.model.mountPath }}}
    - {name: model-cache, mountPath: {{ $hf.cache.mountPath }}}
    {{- if $hf.tokenSecret }}
    - {name: hf-token, mountPath: /var/run/secrets/hf, readOnly: true}
    {{- end }}
  resources:
    requests: {cpu: 250m, memory: 256Mi}
    limits: {cpu: "1", memory: 512Mi}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations for Ray's metrics export port. */}}
{{- define "baton.metricsAnnotations" -}}
{{- if .Values.metrics.enabled }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* A Ray pod template's metadata: pass (dict "root" $ "component" "ray-head"). The
chart's labels win over podLabels (selectors rely on them); podAnnotations win over the
chart's. */}}
{{- define "baton.rayPodMetadata" -}}
{{- $values := .root.Values }}
{{- $labels := merge (include "baton.componentSelectorLabels" . | fromYaml) $values.podLabels }}
{{- $annotations := merge (deepCopy $values.podAnnotations) (include "baton.metricsAnnotations" .root | fromYaml) }}
labels:
  {{- toYaml $labels | nindent 2 }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Settings common to both pod specs: pass (dict "root" $ "head" true|false). Only the
head mounts a ServiceAccount token, and only for the Ray autoscaler (its sidecar). */}}
{{- define "baton.rayPodSpec" -}}
{{- $values := .root.Values }}
{{- with include "baton.serviceAccountName" .root }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: {{ and .head (eq (include "baton.autoscaling" .root) "true") }}
{{- with $values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with $values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Probes of a Ray container: pass (dict "root" $ "head" true|false). Readiness: the head's
Ray node (KubeRay deploys the app once the head is ready), a worker's Serve ingress, HAProxy
(a ready worker takes API traffic). Liveness: the Ray node. The dashboard agent (port 52365) answers
/api/healthz without the Ray token. */}}
{{- define "baton.rayProbes" -}}
{{- $probes := .root.Values.probes }}
readinessProbe:
  {{- if .head }}
  httpGet: {path: /api/healthz, port: 52365}
  {{- else }}
  httpGet: {path: /-/healthz, port: serve}
  {{- end }}
  {{- toYaml $probes.readiness | nindent 2 }}
livenessProbe:
  httpGet: {path: /api/healthz, port: 52365}
  {{- toYaml $probes.liveness | nindent 2 }}
{{- end }}
