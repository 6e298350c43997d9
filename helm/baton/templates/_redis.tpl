{{/*
A Redis StatefulSet of this chart (redis.image): pass (dict "root" $ "name" … "component" …
"secret" … "values" … "policy" …), where `secret` holds `redis-password`, `values` has
maxmemory, persistence, resources and scheduling (redis.*, gcsFaultTolerance.chartRedis.*),
and `policy` is its maxmemory-policy.
*/}}
{{- define "baton.redisStatefulSet" -}}
{{- $root := .root }}
{{- $r := .values }}
{{- $image := $root.Values.redis.image }}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ .name }}
  labels:
    {{- include "baton.componentLabels" (dict "root" $root "component" .component) | nindent 4 }}
spec:
  serviceName: {{ .name }}
  replicas: 1
  selector:
    matchLabels:
      {{- include "baton.componentSelectorLabels" (dict "root" $root "component" .component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "baton.componentLabels" (dict "root" $root "component" .component) | nindent 8 }}
    spec:
      automountServiceAccountToken: false
      {{- with $root.Values.image.pullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . }}
        {{- end }}
      {{- end }}
      {{- with $root.Values.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      securityContext:
        runAsNonRoot: true
        runAsUser: 999
        runAsGroup: 999
        fsGroup: 999
        seccompProfile: {type: RuntimeDefault}
      containers:
        - name: redis
          image: "{{ $image.repository }}:{{ $image.tag }}"
          imagePullPolicy: {{ $image.pullPolicy | default "IfNotPresent" }}
          command: [redis-server]
          args:
            - --requirepass
            - $(REDIS_PASSWORD)
            - --maxmemory
            - {{ $r.maxmemory | quote }}
            - --maxmemory-policy
            - {{ .policy }}
            {{- if $r.persistence.enabled }}
            - --appendonly
            - "yes"
            {{- else }}
            - --save
            - ""
            - --appendonly
            - "no"
            {{- end }}
          env:
            - name: REDIS_PASSWORD
              valueFrom:
                secretKeyRef: {name: {{ .secret }}, key: redis-password}
            - name: REDISCLI_AUTH
              valueFrom:
                secretKeyRef: {name: {{ .secret }}, key: redis-password}
          ports:
            - {name: redis, containerPort: 6379}
          readinessProbe:
            exec: {command: [redis-cli, ping]}
            periodSeconds: 5
            timeoutSeconds: 3
          livenessProbe:
            exec: {command: [redis-cli, ping]}
            initialDelaySeconds: 10
            periodSeconds: 10
            timeoutSeconds: 5
          resources:
            {{- toYaml $r.resources | nindent 12 }}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL]}
          volumeMounts:
            - {name: data, mountPath: /data}
      {{- with $r.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $r.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $r.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if not $r.persistence.enabled }}
      volumes:
        - name: data
          emptyDir: {}
      {{- end }}
  {{- if $r.persistence.enabled }}
  volumeClaimTemplates:
    - metadata:
        name: data
      spec:
        accessModes: [ReadWriteOnce]
        {{- with $r.persistence.storageClass }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $r.persistence.size }}
  {{- end }}
{{- end }}

{{/* The ClusterIP Service of a Redis StatefulSet: pass (dict "root" $ "name" … "component" …). */}}
{{- define "baton.redisService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ .name }}
  labels:
    {{- include "baton.componentLabels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "baton.componentSelectorLabels" (dict "root" .root "component" .component) | nindent 4 }}
  ports:
    - {name: redis, port: 6379, targetPort: redis}
{{- end }}

{{/* A generated Redis password Secret, kept across upgrades (lookup): pass (dict "root" $
"name" … "component" …). */}}
{{- define "baton.redisPasswordSecret" -}}
{{- $current := (lookup "v1" "Secret" .root.Release.Namespace .name).data | default dict }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  labels:
    {{- include "baton.componentLabels" (dict "root" .root "component" .component) | nindent 4 }}
type: Opaque
data:
  redis-password: {{ index $current "redis-password" | default (randAlphaNum 32 | b64enc) }}
{{- end }}
