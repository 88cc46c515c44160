{{/* Name of the chart, overridable by nameOverride. */}}
{{- define "warmgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, with the chart name unless the release already contains it. */}}
{{- define "warmgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "warmgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ include "warmgate.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "warmgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "warmgate.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "warmgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "warmgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator's rights, from files/operator-rules.yaml: the same rules as
     operator/warmgate_operator/rbac.yaml (a test keeps the two equal). */}}
{{- define "warmgate.rules" -}}
{{ .Files.Get "files/operator-rules.yaml" }}
{{- end -}}

{{/* The router: its own name label, so that its Service and budget select only its pods (and
     the operator's selector never matches them). */}}
{{- define "warmgate.router.fullname" -}}
{{- printf "%s-router" (include "warmgate.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "warmgate.router.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ include "warmgate.name" . }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "warmgate.router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "warmgate.name" . }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The router's rights, from files/router-rules.yaml: the same rules as
     router/warmgate_router/rbac.yaml (a test keeps the two equal). */}}
{{- define "warmgate.router.rules" -}}
{{ .Files.Get "files/router-rules.yaml" }}
{{- end -}}
