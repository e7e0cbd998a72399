{{/* The release's name for its objects, within Kubernetes' 63 characters. */}}
{{- define "dphandler.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dphandler.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dphandler.labels" -}}
{{ include "dphandler.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
A value as an environment variable's text. Helm reads numbers as floats:
67108864 would print as 6.7108864e+07, so whole numbers print as integers.
*/}}
{{- define "dphandler.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . | toString -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* True (non-empty) when the metrics listen on loopback only. */}}
{{- define "dphandler.metricsLoopback" -}}
{{- if or (hasPrefix "127." .Values.metrics.address) (eq .Values.metrics.address "::1") (eq .Values.metrics.address "localhost") -}}
true
{{- end -}}
{{- end -}}

{{/* host:port, with brackets around an IPv6 host. */}}
{{- define "dphandler.hostPort" -}}
{{- if contains ":" .host -}}
[{{ .host }}]:{{ .port }}
{{- else -}}
{{ .host }}:{{ .port }}
{{- end -}}
{{- end -}}

{{/* Settings that cannot work together fail the render, naming the values. */}}
{{- define "dphandler.checks" -}}
{{- if and .Values.tcp.enabled (not .Values.tcp.insecure) (not .Values.tcp.tlsSecret) -}}
{{- fail "tcp.enabled needs tcp.tlsSecret (a Secret with tls.crt, tls.key and ca.crt), or tcp.insecure=true for a test cluster" -}}
{{- end -}}
{{- if and .Values.tcp.enabled .Values.tcp.insecure .Values.tcp.tlsSecret -}}
{{- fail "tcp.insecure and tcp.tlsSecret exclude each other" -}}
{{- end -}}
{{- if and (or .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled) (not .Values.metrics.enabled) -}}
{{- fail "metrics.serviceMonitor/podMonitor need metrics.enabled=true" -}}
{{- end -}}
{{- if and (or .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled) (include "dphandler.metricsLoopback" .) -}}
{{- fail (printf "metrics.address %s is the node's loopback: Prometheus cannot scrape it. Set metrics.address=0.0.0.0 (or the node's IP) for a ServiceMonitor/PodMonitor" .Values.metrics.address) -}}
{{- end -}}
{{- if and (eq (toString .Values.config.wireguardImpl) "userspace") (not .Values.privileged) -}}
{{- fail "config.wireguardImpl=userspace needs privileged=true (wireguard-go opens /dev/net/tun, which an unprivileged container cannot)" -}}
{{- end -}}
{{- end -}}
