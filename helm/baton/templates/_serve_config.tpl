{{/*
The RayService's serveConfigV2: files/serve_config.yaml, which deploy/serve_config.py writes
(the same Serve config `serve run` deploys), with the application's `args` and the HTTP port
set from the values (`requestBounds` merged in as they are; the disk tier's `baton` directory in its mount as the engine's
checkpoint_dir: the mount point of an emptyDir is world-writable, which the tier refuses), and the
Replica deployment's size or Ray Serve autoscaling in the file's one `deployments` entry: not
in `args`, which are part of Serve's code version, so that a new size scales the deployment
instead of replacing every replica (and its cached states). Secrets never appear here: API keys, the HMAC key and a Redis URL with
a password reach the app builder as BATON_* environment variables (see baton.rayEnv), and the
gateways and replicas read the keys from their own pods' environment. Gateways ask one unit of
baton_gateway, which the head or the gateway group's pods declare (rayservice.yaml).
*/}}
{{- define "baton.serveConfig" -}}
{{- $config := .Files.Get "files/serve_config.yaml" | fromYaml }}
{{- $_ := set $config.http_options "port" (int .Values.serve.port) }}
{{- $app := first $config.applications }}
{{- $args := dict
  "port" (int .Values.serve.port)
  "router" .Values.router
  "num_gpus_per_replica" .Values.replicas.gpus
  "num_cpus_per_replica" .Values.replicas.cpus
  "gateway_replicas" (int .Values.gateway.replicas)
  "gateway_resources" (dict (include "baton.gatewayResourceName" .) 1)
  "engine" (deepCopy .Values.engine)
  "rollout_surge_percent" (int .Values.replicas.rolloutSurgePercent)
}}
{{- if eq .Values.router "baton" }}{{/* only Baton's router reaches a chosen replica */}}
{{- $_ := set $args "handoff_s" .Values.replicas.handoffSeconds }}
{{- with .Values.replicas.pullBandwidthGBs }}
{{- $_ := set $args "pull_bandwidth_gb_s" . }}
{{- end }}
{{- with .Values.routing }}
{{- $_ := set $args "routing" (deepCopy .) }}
{{- end }}
{{- end }}
{{- $args = mergeOverwrite $args (deepCopy .Values.requestBounds) }}
{{- if .Values.diskTier.enabled }}
{{- $_ := set $args.engine "checkpoint_dir" (printf "%s/baton" (trimSuffix "/" .Values.diskTier.path)) }}
{{- end }}
{{- with .Values.serve.maxBodyBytes }}
{{- $_ := set $args "max_body_bytes" (int64 .) }}
{{- end }}
{{- with .Values.gateway.maxOngoingRequests }}
{{- $_ := set $args "gateway_max_ongoing_requests" (int .) }}
{{- end }}
{{- with .Values.gateway.memoryBytes }}
{{- $_ := set $args "gateway_memory_bytes" (int64 .) }}
{{- end }}
{{- with .Values.gateway.bodyReadTimeoutSeconds }}
{{- $_ := set $args "body_read_timeout_s" . }}
{{- end }}
{{- if not (kindIs "invalid" .Values.gateway.streamPingSeconds) }}
{{- $_ := set $args "stream_ping_s" .Values.gateway.streamPingSeconds }}
{{- end }}
{{- with include "baton.modelPath" . }}
{{- $_ := set $args "model" . }}
{{- end }}
{{- with .Values.model.name }}
{{- $_ := set $args "model_name" . }}
{{- end }}
{{- with .Values.model.mmproj }}
{{- $_ := set $args "mmproj" (printf "%s/%s" $.Values.model.mountPath .) }}
{{- end }}
{{- if eq .Values.redis.mode "none" }}
{{- $_ := set $args "index" "embedded" }}
{{- else if and (eq .Values.redis.mode "external") (not .Values.redis.external.existingSecret) }}
{{- $_ := set $args "index" .Values.redis.external.url }}
{{- end }}
{{- $_ := set $app "args" (mergeOverwrite (omit $app.args "api_keys" "hmac_key" "index") $args) }}
{{- $replica := first $app.deployments }}
{{- if .Values.replicas.autoscaling.enabled }}
{{- $_ := set $replica "num_replicas" "auto" }}
{{- $_ := set $replica "autoscaling_config" .Values.replicas.autoscaling.config }}
{{- else }}
{{- $_ := set $replica "num_replicas" (int .Values.replicas.count) }}
{{- end }}
{{- toYaml $config }}
{{- end }}
