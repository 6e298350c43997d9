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

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "baton.serveServiceName" -}}
{{- printf "%s-serve" (include "baton.fullname" .) }}
{{- end }}

{{- define "baton.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "baton.fullname" .)) }}
{{- end }}

{{- define "baton.redisName" -}}
{{- printf "%s-redis" (include "baton.fullname" .) }}
{{- end }}

{{- define "baton.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "baton.redisName" .) }}
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
{{- $taken := list 6379 8265 10001 (int .Values.metrics.port) }}
{{- if has (int .Values.serve.port) $taken }}
{{- fail (printf "serve.port %d is taken by Ray (GCS 6379, dashboard 8265, client 10001) or metrics.port" (int .Values.serve.port)) }}
{{- end }}
{{- $r := .Values.replicas }}
{{- $most := int $r.count }}
{{- if $r.autoscaling.enabled }}
{{- $most = int (($r.autoscaling.config | default dict).max_replicas | default 1) }}
{{- end }}
{{- if and (gt (float64 $r.gpus) 0.0) (gt (mulf $most $r.gpus) (mulf $w.maxReplicas $w.gpus)) }}
{{- fail (printf "replicas: %d replicas x %v GPUs do not fit on workers.maxReplicas (%d) x workers.gpus (%d) GPUs" $most $r.gpus (int $w.maxReplicas) (int $w.gpus)) }}
{{- end }}
{{- end }}
