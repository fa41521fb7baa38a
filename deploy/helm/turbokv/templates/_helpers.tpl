{{/* The chart's name, or nameOverride; 63 characters at most (a label value). */}}
{{- define "turbokv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The name of the objects: fullnameOverride, else the release name followed by
the chart's name unless the release name already holds it. 63 characters at
most, since some Kubernetes name fields are DNS labels.
*/}}
{{- define "turbokv.fullname" -}}
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

{{/* chart-version, for the helm.sh/chart label ("+" is not allowed in a label). */}}
{{- define "turbokv.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels that select this release's pods: they never change on upgrade. */}}
{{- define "turbokv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "turbokv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The labels of every object. */}}
{{- define "turbokv.labels" -}}
helm.sh/chart: {{ include "turbokv.chart" . }}
{{ include "turbokv.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
turbokvd's image: no registry publishes it, so there is no default; the
chart fails, naming the value that is missing and how to build and push
the image (deploy/docker/Dockerfile).
*/}}
{{- define "turbokv.turbokvdImage" -}}
{{- $image := .Values.turbokvd.image }}
{{- $how := "turbokvd's image is not published: build it from the root of the turbokv repository with `docker build -f deploy/docker/Dockerfile -t REGISTRY/turbokvd:TAG .`, push it to a registry the cluster pulls from with `docker push REGISTRY/turbokvd:TAG` (imagePullSecrets if it is private), and install with --set turbokvd.image.repository=REGISTRY/turbokvd --set turbokvd.image.tag=TAG" }}
{{- $repository := required (printf "turbokvd.image.repository is required: %s" $how) $image.repository }}
{{- $tag := required (printf "turbokvd.image.tag is required: %s" $how) $image.tag }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/*
The worker's image: there is no default, the chart fails naming the value
that is missing.
*/}}
{{- define "turbokv.workerImage" -}}
{{- $image := .Values.worker.image }}
{{- $repository := required "worker.image.repository is required: the image of your inference worker, the container turbokvd runs beside (e.g. --set worker.image.repository=registry.example.com/inference-worker)" $image.repository }}
{{- $tag := required "worker.image.tag is required: the tag of worker.image.repository to run (e.g. --set worker.image.tag=1.4.2)" $image.tag }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/*
Whether the PodMonitor and the PrometheusRule are rendered: enabled, and
the cluster serves the Prometheus Operator's resource (with helm template,
--api-versions monitoring.coreos.com/v1/PodMonitor and .../PrometheusRule).
*/}}
{{- define "turbokv.podMonitor" -}}
{{- if and .Values.podMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PodMonitor") }}true{{ end }}
{{- end }}

{{- define "turbokv.prometheusRule" -}}
{{- if and .Values.prometheusRule.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule") }}true{{ end }}
{{- end }}

{{/* Whether the sidecar computes on a GPU (--device=cuda:N), and so requests one. */}}
{{- define "turbokv.sidecarGpu" -}}
{{- if hasPrefix "cuda" .Values.turbokvd.device }}true{{ end }}
{{- end }}

{{/* The unix socket the worker connects to. */}}
{{- define "turbokv.target" -}}
unix://{{ .Values.turbokvd.socketDir }}/turbokv.sock
{{- end }}

{{/*
Whether turbokvd gets a snapshot directory: turbokvd.snapshot.enabled when
it is true or false; unset (null, the default), unless the Redis tier is on,
since turbokvd refuses --snapshot-dir with --redis-url (true with the Redis
tier stops the rendering: turbokv.validate).
*/}}
{{- define "turbokv.snapshot" -}}
{{- $enabled := .Values.turbokvd.snapshot.enabled }}
{{- if kindIs "bool" $enabled }}
{{- if $enabled }}true{{ end }}
{{- else if not (include "turbokv.redisUrl" .) }}true
{{- end }}
{{- end }}

{{/* A StatefulSet (one snapshot claim per pod) when snapshots persist, else a Deployment. */}}
{{- define "turbokv.kind" -}}
{{- if and (include "turbokv.snapshot" .) .Values.turbokvd.snapshot.persistence.enabled }}StatefulSet{{ else }}Deployment{{ end }}
{{- end }}

{{/*
The name of redis.deploy's objects: 52 characters at most, since a
StatefulSet's name goes into its pods' controller-revision-hash label.
*/}}
{{- define "turbokv.redis.fullname" -}}
{{- printf "%s-redis" (include "turbokv.fullname" . | trunc 46 | trimSuffix "-") }}
{{- end }}

{{/*
The labels that select redis.deploy's pod: a name of its own, so that the
worker's selectors (the workload's, the PodDisruptionBudget's, the
PodMonitor's) never take it in.
*/}}
{{- define "turbokv.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "turbokv.name" . | trunc 57 | trimSuffix "-" }}-redis
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{/*
The labels of the helm test pod: a name of its own, so that no selector of
the worker's (its ReplicaSet's, a PodDisruptionBudget's) takes it in.
*/}}
{{- define "turbokv.test.labels" -}}
helm.sh/chart: {{ include "turbokv.chart" . }}
app.kubernetes.io/name: {{ include "turbokv.name" . | trunc 58 | trimSuffix "-" }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: test
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The labels of redis.deploy's objects. */}}
{{- define "turbokv.redis.labels" -}}
helm.sh/chart: {{ include "turbokv.chart" . }}
{{ include "turbokv.redis.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The Secret holding Redis' password under the key "password":
redis.auth.existingSecret, or the one made for redis.deploy; empty when
there is none.
*/}}
{{- define "turbokv.redisSecret" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else if .Values.redis.deploy.enabled }}
{{- printf "%s-auth" (include "turbokv.redis.fullname" .) }}
{{- end }}
{{- end }}

{{/* --redis-url: redis.url, or redis.deploy's Service; empty when the tier is off. */}}
{{- define "turbokv.redisUrl" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if .Values.redis.deploy.enabled }}
{{- printf "redis://%s.%s.svc:6379" (include "turbokv.redis.fullname" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/* Values that cannot go together: rendering stops, naming them. */}}
{{- define "turbokv.validate" -}}
{{- if and .Values.redis.url .Values.redis.deploy.enabled }}
{{- fail "redis.url and redis.deploy.enabled are both set: give turbokvd either an existing Redis (redis.url) or the chart's own (redis.deploy.enabled)" }}
{{- end }}
{{- if and (include "turbokv.redisUrl" .) (include "turbokv.snapshot" .) }}
{{- $tier := "redis.deploy.enabled" }}
{{- if .Values.redis.url }}
{{- $tier = "redis.url" }}
{{- end }}
{{- fail (printf "turbokvd.snapshot.enabled=true and %s cannot go together: turbokvd refuses --snapshot-dir with --redis-url (a snapshot loaded at the next start would bring back a session another turbokvd may hold since the drain, a second writer; the Redis tier keeps sessions across restarts itself); leave turbokvd.snapshot.enabled unset (null: snapshots are then off with the Redis tier) or set it to false" $tier) }}
{{- end }}
{{- end }}
