{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "kubetune.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, or the release name when it already contains the chart's. */}}
{{- define "kubetune.fullname" -}}
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

{{- define "kubetune.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kubetune.labels" -}}
helm.sh/chart: {{ include "kubetune.chart" . }}
{{ include "kubetune.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubetune
{{- end }}

{{- define "kubetune.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubetune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kubetune.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kubetune.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kubetune.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Leader election: on for more than one replica, or when asked for. */}}
{{- define "kubetune.leaderElection" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{- define "kubetune.leaseName" -}}
{{- default (include "kubetune.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* Cluster mode: no namespace list, so one ClusterRole covers everything. */}}
{{- define "kubetune.clusterMode" -}}
{{- if not .Values.watch.namespaces }}true{{ end }}
{{- end }}
