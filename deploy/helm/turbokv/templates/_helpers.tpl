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

{{/* turbokvd's image: the tag defaults to the chart's appVersion. */}}
{{- define "turbokv.turbokvdImage" -}}
{{- printf "%s:%s" .Values.turbokvd.image.repository (default .Chart.AppVersion .Values.turbokvd.image.tag) }}
{{- end }}

{{/* Whether the sidecar computes on a GPU (--device=cuda:N), and so requests one. */}}
{{- define "turbokv.sidecarGpu" -}}
{{- if hasPrefix "cuda" .Values.turbokvd.device }}true{{ end }}
{{- end }}

{{/* The unix socket the worker connects to. */}}
{{- define "turbokv.target" -}}
unix://{{ .Values.turbokvd.socketDir }}/turbokv.sock
{{- end }}

{{/* A StatefulSet (one snapshot claim per pod) when snapshots persist, else a Deployment. */}}
{{- define "turbokv.kind" -}}
{{- if and .Values.turbokvd.snapshot.enabled .Values.turbokvd.snapshot.persistence.enabled }}StatefulSet{{ else }}Deployment{{ end }}
{{- end }}
