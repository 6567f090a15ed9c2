{{/* Name prefix of every object: the release name, "dray" by default. */}}
{{- define "dray.fullname" -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "dray.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Labels; call with (list $ "component"). */}}
{{- define "dray.labels" -}}
{{ include "dray.selectorLabels" . }}
app.kubernetes.io/part-of: dray
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
{{- end -}}

{{- define "dray.selectorLabels" -}}
app.kubernetes.io/name: dray
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Base URLs of every tracker replica, one per StatefulSet ordinal. */}}
{{- define "dray.trackerUrls" -}}
{{- $name := printf "%s-tracker" (include "dray.fullname" .) -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.tracker.replicas) -}}
{{- $urls = append $urls (printf "https://%s-%d.%s.%s.svc.%s:%d" $name $i $name $.Release.Namespace $.Values.clusterDomain (int $.Values.tracker.port)) -}}
{{- end -}}
{{- $urls | toJson -}}
{{- end -}}

{{/* TOML "key = value" lines for a map of scalars; null values are left out
     so the component's default applies. */}}
{{- define "dray.tomlKeys" -}}
{{- $lines := list -}}
{{- range $k, $v := . -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $lines = append $lines (printf "%s = %s" $k (toJson $v)) -}}
{{- end -}}
{{- end -}}
{{- join "\n" $lines -}}
{{- end -}}

{{- define "dray.podAnnotations" -}}
{{- if .root.Values.metrics.annotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* The registries for `configure-containerd`: NAME or NAME=SERVER, space-separated. */}}
{{- define "dray.registryArgs" -}}
{{- $args := list -}}
{{- range .Values.registries -}}
{{- $args = append $args (ternary (printf "%s=%s" .name .server) .name (not (empty .server))) -}}
{{- end -}}
{{- join " " $args -}}
{{- end -}}
