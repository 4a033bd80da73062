{{/*
A role's terminationGracePeriodSeconds, refused unless it exceeds its preStop sleep plus its drain: a kill before the
drain ends would lose the work the drain is there to finish.
*/}}
{{- define "glmimage.terminationGrace" -}}
{{- $need := add (int .preStopSeconds) (int (ceil .drainSeconds)) -}}
{{- if le (int .terminationGracePeriodSeconds) $need -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed preStopSeconds + drainSeconds (%v)" .terminationGracePeriodSeconds $need) -}}
{{- end -}}
{{- .terminationGracePeriodSeconds -}}
{{- end }}

{{/* Names */}}
{{- define "glmimage.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "glmimage.fullname" -}}
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

{{/* "<fullname>-<component>", kept within the 63-character DNS label limit. */}}
{{- define "glmimage.componentName" -}}
{{- printf "%s-%s" (include "glmimage.fullname" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component }}
{{- end }}

{{/*
Name suffix of the AR Service the gateway dials. ClusterIP and headless Services get different names because
spec.clusterIP is immutable: switching ar.discovery on upgrade then replaces one Service with the other instead of
asking the API server to turn a ClusterIP into "None" (which it refuses).
*/}}
{{- define "glmimage.arServiceComponent" -}}
{{- if eq .Values.ar.discovery "dns" }}ar-headless
{{- else if eq .Values.ar.discovery "service" }}ar
{{- else }}{{ fail (printf "ar.discovery must be service or dns, not %q" .Values.ar.discovery) }}
{{- end }}
{{- end }}

{{/* Fully qualified DNS name of a Service of this release. */}}
{{- define "glmimage.serviceFqdn" -}}
{{- printf "%s.%s.svc.%s" (include "glmimage.componentName" .) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{- define "glmimage.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "glmimage.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels */}}
{{- define "glmimage.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "glmimage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: glmimage
{{- end }}

{{- define "glmimage.componentLabels" -}}
{{ include "glmimage.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "glmimage.selectorLabels" -}}
app.kubernetes.io/name: {{ include "glmimage.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image reference of a role: registry/repository:tag, the tag defaulting to the appVersion. */}}
{{- define "glmimage.image" -}}
{{- $img := index .root.Values.image .role }}
{{- $repo := $img.repository }}
{{- with .root.Values.image.registry }}{{ $repo = printf "%s/%s" (trimSuffix "/" .) $repo }}{{ end }}
{{- printf "%s:%s" $repo (default .root.Chart.AppVersion $img.tag) }}
{{- end }}

{{- define "glmimage.configName" -}}
{{ include "glmimage.fullname" . }}-config
{{- end }}

{{- define "glmimage.apiKeySecretName" -}}
{{- default (printf "%s-api-keys" (include "glmimage.fullname" .)) .Values.apiKeys.existingSecret }}
{{- end }}

{{- define "glmimage.apiKeysEnabled" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.keys }}true{{ end }}
{{- end }}

{{- define "glmimage.adminKeySecretName" -}}
{{- default (printf "%s-admin-keys" (include "glmimage.fullname" .)) .Values.adminKeys.existingSecret }}
{{- end }}

{{- define "glmimage.adminKeysEnabled" -}}
{{- if or .Values.adminKeys.existingSecret .Values.adminKeys.keys }}true{{ end }}
{{- end }}

{{- define "glmimage.internalTokenSecretName" -}}
{{- default (printf "%s-internal-token" (include "glmimage.fullname" .)) .Values.internalToken.existingSecret }}
{{- end }}

{{/* Where the internal token Secret is mounted in the AR, denoiser and gateway containers. */}}
{{- define "glmimage.internalTokenDir" -}}/etc/glmimage/internal{{- end }}

{{/* The flag that points a server at the internal token (a file: the token never appears in the args). */}}
{{- define "glmimage.internalTokenArgs" -}}
{{- if .Values.internalToken.enabled }}
- --internal-token-file={{ include "glmimage.internalTokenDir" . }}/token
{{- end }}
{{- end }}

{{- /* Traces: every container exports to the same collector; no flag (off) when tracing.otlpEndpoint is empty. */ -}}
{{- define "glmimage.tracingArgs" -}}
{{- with .Values.tracing.otlpEndpoint }}
- --otlp-endpoint={{ . }}
{{- end }}
{{- end }}

{{- define "glmimage.internalTokenVolume" -}}
{{- if .Values.internalToken.enabled }}
- name: internal-token
  secret:
    secretName: {{ include "glmimage.internalTokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.internalToken.secretKey }}
        path: token
{{- end }}
{{- end }}

{{- define "glmimage.internalTokenVolumeMount" -}}
{{- if .Values.internalToken.enabled }}
- name: internal-token
  mountPath: {{ include "glmimage.internalTokenDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "glmimage.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "glmimage.fullname" .)) .Values.tls.existingSecret }}
{{- end }}

{{/* Where the TLS Secret is mounted in every pod. */}}
{{- define "glmimage.tlsDir" -}}/etc/glmimage/tls{{- end }}

{{/* Flags of a gRPC server: serve TLS, and require client certificates with mutual TLS. */}}
{{- define "glmimage.serverTlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert={{ include "glmimage.tlsDir" . }}/tls.crt
- --tls-key={{ include "glmimage.tlsDir" . }}/tls.key
{{- if .Values.tls.mutual }}
- --tls-client-ca={{ include "glmimage.tlsDir" . }}/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{/* Pod annotations that roll the pods when settings or secrets the chart renders change. */}}
{{- define "glmimage.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}

{{/*
Probe handler for a gRPC server on grpc.health.v1. Kubelet's native gRPC probe speaks plaintext only, so with TLS
the same check runs in the container over TLS (python and grpcio-health-checking are in every image).
*/}}
{{- define "glmimage.grpcProbeHandler" -}}
{{- if .root.Values.tls.enabled }}
exec:
  command:
    - python
    - -c
    - |
      import sys, grpc
      from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g
      d = "{{ include "glmimage.tlsDir" .root }}/"
      r = lambda n: open(d + n, "rb").read()
      creds = grpc.ssl_channel_credentials(r("ca.crt"){{ if .root.Values.tls.mutual }}, r("tls.key"), r("tls.crt"){{ end }})
      with grpc.secure_channel("localhost:{{ .port }}", creds) as ch:
          s = g.HealthStub(ch).Check(h.HealthCheckRequest(service="{{ .service }}"), timeout=4).status
      sys.exit(0 if s == h.HealthCheckResponse.SERVING else 1)
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service }}
{{- end }}
{{- end }}

{{/* startup, liveness and readiness probes of a gRPC server. */}}
{{- define "glmimage.grpcProbes" -}}
{{- $p := .root.Values.probes }}
startupProbe:
  {{- include "glmimage.grpcProbeHandler" . | trim | nindent 2 }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: 5
livenessProbe:
  {{- include "glmimage.grpcProbeHandler" . | trim | nindent 2 }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
readinessProbe:
  {{- include "glmimage.grpcProbeHandler" . | trim | nindent 2 }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
{{- end }}

{{/* Container securityContext: the chart defaults merged with a role's overrides. */}}
{{- define "glmimage.securityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.securityContext) (default dict .override)) }}
{{- end }}

{{/* Environment every model server shares: settings from the ConfigMap, and caches on the writable volume. */}}
{{- define "glmimage.modelEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: GLMIMAGE_CACHE
  value: /cache/glmimage
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}

{{/* Volumes of a model server pod: weights (read-only), cache, /tmp and the TLS Secret. */}}
{{- define "glmimage.modelVolumes" -}}
{{- $m := .root.Values.model }}
{{- if eq $m.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: models
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if ne $m.source "tiny" }}
{{- fail (printf "model.source must be pvc, hostPath or tiny, not %q" $m.source) }}
{{- end }}
- name: cache
  emptyDir:
    sizeLimit: {{ .cacheSizeLimit }}
- name: tmp
  emptyDir:
    medium: Memory
    sizeLimit: 256Mi
{{- with include "glmimage.tlsVolume" .root | trim }}{{ . | nindent 0 }}{{- end }}
{{- with include "glmimage.internalTokenVolume" .root | trim }}{{ . | nindent 0 }}{{- end }}
{{- end }}

{{- define "glmimage.modelVolumeMounts" -}}
{{- if ne .Values.model.source "tiny" }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
- name: cache
  mountPath: /cache
- name: tmp
  mountPath: /tmp
{{- with include "glmimage.tlsVolumeMount" . | trim }}{{ . | nindent 0 }}{{- end }}
{{- with include "glmimage.internalTokenVolumeMount" . | trim }}{{ . | nindent 0 }}{{- end }}
{{- end }}

{{/* --model-path, unless the tiny test model is wanted. */}}
{{- define "glmimage.modelPathArg" -}}
{{- if ne .Values.model.source "tiny" }}
- --model-path=/models/{{ .Values.model.path }}
{{- end }}
{{- end }}

{{- define "glmimage.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "glmimage.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "glmimage.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "glmimage.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
Pod placement of a role (dict root, component, values): its affinity, with the anti-affinity preset added, and its
topology spread constraints. The chart writes these label selectors itself, from the selector labels, because a
selector on the component alone would also count another release's pods in the namespace (values files cannot
name the release).
*/}}
{{- define "glmimage.placement" -}}
{{- $v := .values }}
{{- $component := .component }}
{{- $own := dict "matchLabels" (include "glmimage.selectorLabels" . | fromYaml) }}
{{- $affinity := deepCopy (default dict $v.affinity) }}
{{- with $v.podAntiAffinityPreset }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" $own }}
{{- $anti := default dict $affinity.podAntiAffinity }}
{{- if eq . "soft" }}
{{- $terms := default list $anti.preferredDuringSchedulingIgnoredDuringExecution }}
{{- $_ := set $anti "preferredDuringSchedulingIgnoredDuringExecution" (append $terms (dict "weight" 100 "podAffinityTerm" $term)) }}
{{- else if eq . "hard" }}
{{- $terms := default list $anti.requiredDuringSchedulingIgnoredDuringExecution }}
{{- $_ := set $anti "requiredDuringSchedulingIgnoredDuringExecution" (append $terms $term) }}
{{- else }}
{{- fail (printf "%s.podAntiAffinityPreset must be \"\", soft or hard, not %q" $component .) }}
{{- end }}
{{- $_ := set $affinity "podAntiAffinity" $anti }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.topologySpreadConstraints }}
topologySpreadConstraints:
{{- range . }}
{{- /* The role's own labels go over whatever matchLabels were given, so the spread counts this role only. */}}
{{- $c := deepCopy . }}
{{- $sel := default dict $c.labelSelector }}
{{- $_ := set $sel "matchLabels" (merge (deepCopy $own.matchLabels) (default dict $sel.matchLabels)) }}
{{- $_ := set $c "labelSelector" $sel }}
  - {{- toYaml $c | nindent 4 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
LoRA adapters (loras.*): a read-only volume at /loras in the denoiser pods only, and --lora-dir=/loras. With
loras.source=none, neither (the tiny model's denoiser then uses its built-in demo adapter).
*/}}
{{- define "glmimage.lorasDir" -}}/loras{{- end }}

{{- define "glmimage.lorasEnabled" -}}
{{- $l := .Values.loras }}
{{- if eq $l.source "none" }}
{{- else if or (eq $l.source "pvc") (eq $l.source "hostPath") }}true
{{- else }}{{ fail (printf "loras.source must be none, pvc or hostPath, not %q" $l.source) }}
{{- end }}
{{- end }}

{{- define "glmimage.loraArgs" -}}
{{- if include "glmimage.lorasEnabled" . }}
- --lora-dir={{ include "glmimage.lorasDir" . }}
{{- end }}
{{- end }}

{{- define "glmimage.loraVolume" -}}
{{- $l := .Values.loras }}
{{- if include "glmimage.lorasEnabled" . }}
{{- if eq $l.source "pvc" }}
{{- if not $l.pvc.claimName }}{{ fail "loras.source=pvc needs loras.pvc.claimName (an existing claim)" }}{{ end }}
- name: loras
  persistentVolumeClaim:
    claimName: {{ $l.pvc.claimName }}
    readOnly: true
{{- else }}
{{- if not $l.hostPath.path }}{{ fail "loras.source=hostPath needs loras.hostPath.path" }}{{ end }}
- name: loras
  hostPath:
    path: {{ $l.hostPath.path }}
    type: {{ $l.hostPath.type }}
{{- end }}
{{- end }}
{{- end }}

{{- define "glmimage.loraVolumeMount" -}}
{{- $l := .Values.loras }}
{{- if include "glmimage.lorasEnabled" . }}
- name: loras
  mountPath: {{ include "glmimage.lorasDir" . }}
  readOnly: true
{{- with $l.subPath }}
{{- if or (hasPrefix "/" .) (has ".." (splitList "/" .)) }}
{{- fail (printf "loras.subPath must be a relative path inside the volume, without '..', not %q" .) }}
{{- end }}
  subPath: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Tenants (tenants.*): the TOML file from a Secret (the chart's from tenants.file, or tenants.existingSecret), mounted
read-only in the gateway pods; --tenants on the gateway and the REST front. The whole directory is mounted (no
subPath), so an edited Secret reaches the file in place and a SIGHUP reloads it without a restart.
*/}}
{{- define "glmimage.tenantsEnabled" -}}
{{- $t := .Values.tenants }}
{{- if and $t.file $t.existingSecret }}{{ fail "give tenants.file or tenants.existingSecret, not both" }}{{ end }}
{{- if or $t.file $t.existingSecret }}true{{ end }}
{{- end }}

{{- define "glmimage.tenantsSecretName" -}}
{{- default (printf "%s-tenants" (include "glmimage.fullname" .)) .Values.tenants.existingSecret }}
{{- end }}

{{- define "glmimage.tenantsDir" -}}/etc/glmimage/tenants{{- end }}

{{- define "glmimage.tenantsArgs" -}}
{{- if include "glmimage.tenantsEnabled" . }}
- --tenants={{ include "glmimage.tenantsDir" . }}/tenants.toml
{{- end }}
{{- end }}

{{- define "glmimage.tenantsVolume" -}}
{{- if include "glmimage.tenantsEnabled" . }}
- name: tenants
  secret:
    secretName: {{ include "glmimage.tenantsSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.tenants.secretKey }}
        path: tenants.toml
{{- end }}
{{- end }}

{{- define "glmimage.tenantsVolumeMount" -}}
{{- if include "glmimage.tenantsEnabled" . }}
- name: tenants
  mountPath: {{ include "glmimage.tenantsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Rolls the gateway pods when anything in the tenants block changes: the file itself, or the revision that stands
for an existing Secret's content (which the chart cannot read). */}}
{{- define "glmimage.tenantsChecksum" -}}
{{- if include "glmimage.tenantsEnabled" . }}
checksum/tenants: {{ toJson .Values.tenants | sha256sum }}
{{- end }}
{{- end }}

{{- define "glmimage.restKeySecretName" -}}
{{- default (printf "%s-rest-key" (include "glmimage.fullname" .)) .Values.tenants.restKey.existingSecret }}
{{- end }}

{{/* The key the REST front presents on its own calls (GetStatus behind /health) when tenants are on. */}}
{{- define "glmimage.restKeyEnv" -}}
{{- $k := .Values.tenants.restKey }}
{{- if and (include "glmimage.tenantsEnabled" .) (or $k.key $k.existingSecret) }}
- name: GLMIMAGE_GATEWAY_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "glmimage.restKeySecretName" . }}
      key: {{ $k.secretKey }}
{{- end }}
{{- end }}

{{/* --quota-store: quota counters shared by every gateway (Redis); none: each gateway counts on its own. */}}
{{- define "glmimage.quotaStoreArgs" -}}
{{- with .Values.quotaStore.url }}
{{- if not (hasPrefix "redis://" .) }}
{{- fail (printf "quotaStore.url must be redis://HOST:PORT/N, not %q" .) }}
{{- end }}
{{- if not (include "glmimage.tenantsEnabled" $) }}
{{- fail "quotaStore.url counts the quotas of a tenants file: set tenants.file or tenants.existingSecret too" }}
{{- end }}
- --quota-store={{ . }}
{{- end }}
{{- end }}

{{/*
Jobs (jobs.*, docs/kubernetes.md#jobs): the gateways' durable job store, the image store, and the two secrets jobs
need (URL signing, shared by the gateway and the REST front; the webhook master secret, the gateway's only). Every
gateway shares one store and one image store, so with several gateway pods the chart insists on PostgreSQL and on
S3 or a ReadWriteMany volume: a pod's own disk would split the jobs (and their images) between the pods.
*/}}
{{- define "glmimage.jobsEnabled" -}}
{{- if .Values.jobs.enabled }}true{{ end }}
{{- end }}

{{- define "glmimage.jobsDbDir" -}}/var/lib/glmimage/jobs{{- end }}
{{- define "glmimage.jobsImagesDir" -}}/var/lib/glmimage/images{{- end }}
{{- define "glmimage.jobsUrlSecretDir" -}}/etc/glmimage/url-secret{{- end }}
{{- define "glmimage.jobsWebhookSecretDir" -}}/etc/glmimage/webhook-secret{{- end }}

{{/* SQLite on the gateway pod's own volume (jobs.db.allowLocal, one gateway): no DSN Secret. */}}
{{- define "glmimage.jobsLocalDb" -}}
{{- if and .Values.jobs.enabled (not .Values.jobs.db.existingSecret) }}true{{ end }}
{{- end }}

{{/* The disk image store (jobs.imageStore empty), served by the REST fronts at signed URLs. */}}
{{- define "glmimage.jobsDiskStore" -}}
{{- if and .Values.jobs.enabled (not .Values.jobs.imageStore) }}true{{ end }}
{{- end }}

{{- define "glmimage.jobsUrlSecretName" -}}
{{- default (printf "%s-url-secret" (include "glmimage.fullname" .)) .Values.jobs.urlSecret.existingSecret }}
{{- end }}

{{- define "glmimage.jobsWebhookSecretName" -}}
{{- default (printf "%s-webhook-secret" (include "glmimage.fullname" .)) .Values.jobs.webhookSecret.existingSecret }}
{{- end }}

{{/*
A number of jobs.* as a flag's value (dict "root" . "name" NAME "min" 0 or 1): refused unless a number at least min.
Helm reads values' numbers as floats, which print as 1.073741824e+09; whole numbers are written as integers.
*/}}
{{- define "glmimage.jobsNumber" -}}
{{- $v := index .root.Values.jobs .name }}
{{- if not (or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v)) }}
{{- fail (printf "jobs.%s must be a number, not %q" .name (toString $v)) }}
{{- end }}
{{- if lt (float64 $v) (float64 .min) }}
{{- fail (printf "jobs.%s must be at least %v, not %v" .name .min $v) }}
{{- end }}
{{- if eq (float64 $v) (float64 (int64 $v)) }}{{ int64 $v }}{{ else }}{{ $v }}{{ end }}
{{- end }}

{{/* Refuses jobs settings that cannot work, naming the values to set. */}}
{{- define "glmimage.jobsCheck" -}}
{{- $j := .Values.jobs }}
{{- $replicas := int .Values.gateway.replicas }}
{{- if $j.enabled }}
{{- if and $j.db.existingSecret $j.db.allowLocal }}
{{- fail "give jobs.db.existingSecret (PostgreSQL) or jobs.db.allowLocal (SQLite on the gateway pod), not both" }}
{{- end }}
{{- if and (not $j.db.existingSecret) (gt $replicas 1) }}
{{- fail (printf "jobs: the %d gateways must share one job store, and SQLite on a pod's disk cannot be shared: set jobs.db.existingSecret to a Secret holding a postgresql:// DSN (key jobs.db.secretKey), or run gateway.replicas=1 with jobs.db.allowLocal=true" $replicas) }}
{{- end }}
{{- if and (not $j.db.existingSecret) (not $j.db.allowLocal) }}
{{- fail "jobs: no job store: set jobs.db.existingSecret to a Secret holding a postgresql:// DSN (key jobs.db.secretKey), or jobs.db.allowLocal=true to keep the jobs in SQLite on the one gateway pod's volume (jobs.db.localVolume.existingClaim; without it an emptyDir, lost with the pod)" }}
{{- end }}
{{- if and $j.db.existingSecret $j.db.localVolume.existingClaim }}
{{- fail "jobs.db.localVolume is SQLite's volume: leave it empty with jobs.db.existingSecret (PostgreSQL)" }}
{{- end }}
{{- if $j.imageStore }}
{{- if not (regexMatch "^s3://[^/]+(/.*)?$" $j.imageStore) }}
{{- fail (printf "jobs.imageStore must be empty (the disk store) or s3://BUCKET/PREFIX, not %q" $j.imageStore) }}
{{- end }}
{{- if $j.imageVolume.existingClaim }}
{{- fail "jobs.imageVolume is the disk image store's volume: leave it empty with an s3:// jobs.imageStore" }}
{{- end }}
{{- else }}
{{- if and (gt $replicas 1) (not $j.imageVolume.existingClaim) }}
{{- fail (printf "jobs: with the disk image store, the REST front of each of the %d gateway pods serves images any gateway stored, so they need one shared volume: set jobs.imageVolume.existingClaim to a ReadWriteMany claim, or jobs.imageStore=s3://BUCKET/PREFIX" $replicas) }}
{{- end }}
{{- if not .Values.gateway.rest.enabled }}
{{- fail "jobs: the disk image store's files are served by the REST front (gateway.rest.enabled=false): enable it, or set jobs.imageStore=s3://BUCKET/PREFIX" }}
{{- end }}
{{- if or $j.s3.endpoint $j.s3.existingSecret $j.s3.region }}
{{- fail "jobs.s3.* configure an S3 image store: set jobs.imageStore=s3://BUCKET/PREFIX too, or leave them empty" }}
{{- end }}
{{- end }}
{{- with $j.publicUrl }}
{{- if not (regexMatch "^https?://[^/?#]+(/[^?#]*)?$" .) }}
{{- fail (printf "jobs.publicUrl must be the REST front's public base, http(s)://HOST[:PORT][/PATH], not %q" .) }}
{{- end }}
{{- end }}
{{- if not (kindIs "slice" $j.webhookAllow) }}
{{- fail "jobs.webhookAllow must be a list of patterns, e.g. [\"*.example.com\", \"https://hooks.example.org:8443\"]" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The gateway's job flags. Off (jobs.enabled=false): --jobs-db=none, so no gateway keeps jobs on its pod's disk (each
its own: a job submitted to one would be unknown to the others).
*/}}
{{- define "glmimage.jobsGatewayArgs" -}}
{{- $j := .Values.jobs }}
{{- if not $j.enabled }}
- --jobs-db=none
{{- else }}
{{- if include "glmimage.jobsLocalDb" . }}
- --jobs-db={{ include "glmimage.jobsDbDir" . }}/jobs.sqlite3
{{- end }}
{{- if $j.imageStore }}
- --image-store={{ $j.imageStore }}
{{- with $j.s3.endpoint }}
- --s3-endpoint={{ . }}
{{- end }}
{{- else }}
- --image-store={{ include "glmimage.jobsImagesDir" . }}
{{- end }}
{{- with $j.publicUrl }}
- --public-url={{ . }}
{{- end }}
- --url-secret-file={{ include "glmimage.jobsUrlSecretDir" . }}/secret
- --webhook-secret-file={{ include "glmimage.jobsWebhookSecretDir" . }}/secret
- --url-ttl={{ include "glmimage.jobsNumber" (dict "root" . "name" "urlTtl" "min" 1) }}
- --job-ttl={{ include "glmimage.jobsNumber" (dict "root" . "name" "ttl" "min" 1) }}
- --job-timeout={{ include "glmimage.jobsNumber" (dict "root" . "name" "timeout" "min" 1) }}
- --job-concurrency={{ include "glmimage.jobsNumber" (dict "root" . "name" "concurrency" "min" 0) }}
- --max-stored-bytes={{ include "glmimage.jobsNumber" (dict "root" . "name" "maxStoredBytes" "min" 0) }}
- --webhook-retry-for={{ include "glmimage.jobsNumber" (dict "root" . "name" "webhookRetryFor" "min" 1) }}
{{- range $j.webhookAllow }}
- {{ printf "--webhook-allow=%s" . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The REST front's, with the disk store only: the store it serves images from, and the secret it checks their URLs
with. An S3 bucket serves its presigned URLs itself, and the front needs neither. */}}
{{- define "glmimage.jobsRestArgs" -}}
{{- if include "glmimage.jobsDiskStore" . }}
- --image-store={{ include "glmimage.jobsImagesDir" . }}
- --url-secret-file={{ include "glmimage.jobsUrlSecretDir" . }}/secret
{{- end }}
{{- end }}

{{/* The DSN (it may hold a password) and the S3 credentials come from Secrets as environment, never as args. */}}
{{- define "glmimage.jobsGatewayEnv" -}}
{{- $j := .Values.jobs }}
{{- if $j.enabled }}
{{- with $j.db.existingSecret }}
- name: GLMIMAGE_JOBS_DB
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $j.db.secretKey }}
{{- end }}
{{- if $j.imageStore }}
{{- with $j.s3.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $j.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $j.s3.secretAccessKeyKey }}
{{- end }}
{{- with $j.s3.region }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "glmimage.jobsVolumes" -}}
{{- $j := .Values.jobs }}
{{- if $j.enabled }}
{{- if include "glmimage.jobsLocalDb" . }}
- name: jobs-db
  {{- with $j.db.localVolume.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ . }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ $j.db.localVolume.sizeLimit }}
  {{- end }}
{{- end }}
{{- if include "glmimage.jobsDiskStore" . }}
- name: job-images
  {{- with $j.imageVolume.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ . }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ $j.imageVolume.sizeLimit }}
  {{- end }}
{{- end }}
- name: url-secret
  secret:
    secretName: {{ include "glmimage.jobsUrlSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ $j.urlSecret.secretKey }}
        path: secret
- name: webhook-secret
  secret:
    secretName: {{ include "glmimage.jobsWebhookSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ $j.webhookSecret.secretKey }}
        path: secret
{{- end }}
{{- end }}

{{- define "glmimage.jobsGatewayVolumeMounts" -}}
{{- if .Values.jobs.enabled }}
{{- if include "glmimage.jobsLocalDb" . }}
- name: jobs-db
  mountPath: {{ include "glmimage.jobsDbDir" . }}
{{- end }}
{{- if include "glmimage.jobsDiskStore" . }}
- name: job-images
  mountPath: {{ include "glmimage.jobsImagesDir" . }}
{{- end }}
- name: url-secret
  mountPath: {{ include "glmimage.jobsUrlSecretDir" . }}
  readOnly: true
- name: webhook-secret
  mountPath: {{ include "glmimage.jobsWebhookSecretDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The REST front reads the images it serves (the gateway writes and deletes them) and never sees the webhook secret. */}}
{{- define "glmimage.jobsRestVolumeMounts" -}}
{{- if include "glmimage.jobsDiskStore" . }}
- name: job-images
  mountPath: {{ include "glmimage.jobsImagesDir" . }}
  readOnly: true
- name: url-secret
  mountPath: {{ include "glmimage.jobsUrlSecretDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Rolls the gateway pods when the jobs block changes (a new revision stands for an edited existing Secret). */}}
{{- define "glmimage.jobsChecksum" -}}
{{- if .Values.jobs.enabled }}
checksum/jobs: {{ toJson .Values.jobs | sha256sum }}
{{- end }}
{{- end }}
