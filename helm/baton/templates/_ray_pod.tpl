{{/* Pieces shared by the Ray head and worker pod templates. */}}

{{/* BATON_* settings from Secrets: baton_serve.deploy.app.app_builder reads them (load_config) under the
Serve config's args, wherever Serve builds the app. */}}
{{- define "baton.rayEnv" -}}
- name: BATON_HMAC_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "baton.authSecretName" . }}, key: hmac-key}
{{- if .Values.auth.requireApiKey }}
- name: BATON_API_KEYS
  valueFrom:
    secretKeyRef: {name: {{ include "baton.authSecretName" . }}, key: api-keys}
{{- end }}
{{- if eq .Values.redis.mode "chart" }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "baton.redisSecretName" . }}, key: redis-password}
- name: BATON_INDEX
  value: "redis://:$(REDIS_PASSWORD)@{{ include "baton.redisName" . }}:6379/0"
{{- else if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret }}
- name: BATON_INDEX
  valueFrom:
    secretKeyRef: {name: {{ .Values.redis.external.existingSecret }}, key: {{ .Values.redis.external.existingSecretKey }}}
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
{{- end }}
{{- end }}

{{- define "baton.modelVolumeMounts" -}}
{{- if ne .Values.model.source "image" }}
- {name: model, mountPath: {{ .Values.model.mountPath }}, readOnly: true}
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
  volumeMounts:
    - {name: model, mountPath: {{ .Values.model.mountPath }}}
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

{{/* Settings common to both pod specs. */}}
{{- define "baton.rayPodSpec" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
