{{/* The labels of every object: the kustomize overlays' part-of, and Helm's own. */}}
{{- define "jitckpt.labels" -}}
app.kubernetes.io/part-of: jitckpt
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The labels of the webhook's own objects (its pods select on the name). */}}
{{- define "jitckpt.webhookLabels" -}}
app.kubernetes.io/name: jitckpt-webhook
{{ include "jitckpt.labels" . }}
{{- end -}}

{{/* The webhook's image by digest, as kustomize's images transformer writes it. */}}
{{- define "jitckpt.webhookImage" -}}
{{- with .Values.webhookImage -}}
{{- if .digest -}}
{{ .repository }}:{{ .tag }}@{{ .digest }}
{{- else -}}
{{ .repository }}:{{ .tag }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The webhook's Service as a DNS name in its namespace. */}}
{{- define "jitckpt.service" -}}
jitckpt-webhook.{{ .Release.Namespace }}
{{- end -}}
