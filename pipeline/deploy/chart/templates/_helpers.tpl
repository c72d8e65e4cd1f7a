{{/* trtpipe chart helpers. Rendered by Helm (Go templates + sprig); written for trtpipe, see docs/deploy-k8s.md. */}}

{{- define "trtpipe.fullname" -}}
{{- .Release.Name | trunc 53 | trimSuffix "-" -}}
{{- end -}}

{{- define "trtpipe.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "trtpipe.labels" -}}
{{ include "trtpipe.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
trtpipe.dev/recipe: {{ .Values.model.recipe | quote }}
{{- end -}}

{{/* The Triton rank commands, as TensorRT-LLM's launch_triton_server.py lays them out and
     pipeline.triton.server.triton_command writes them: one tritonserver per rank, `-n 1 … :` between
     ranks when there are several; ranks other than 0 load only triton.loadModels (tensorrt_llm, and
     multimodal_encoders for a vision recipe), rank 0 gets the multimodal CUDA pool on GPU 0 when
     triton.cudaMemoryPoolGpu0Bytes is set (launch_triton_server.py@c2e65b88d852:173-182), and on several nodes
     ranks other than 0 also close their endpoints (only rank 0 serves). Returns a JSON list. */}}
{{- define "trtpipe.rankArgv" -}}
{{- $v := .Values -}}
{{- $world := mul (int $v.parallelism.tp) (int $v.parallelism.pp) -}}
{{- $multiNode := gt (int $v.parallelism.nodes) 1 -}}
{{- $argv := list -}}
{{- range $rank := until (int $world) -}}
{{- if gt $world 1 }}{{ $argv = concat $argv (list "-n" "1") }}{{ end -}}
{{- $prefix := $v.triton.shmRegionPrefix -}}
{{- if gt $world 1 }}{{ $prefix = printf "%s%d_" $prefix $rank }}{{ end -}}
{{- $argv = concat $argv (list $v.triton.binary
      (printf "--model-repository=%s/triton_repo" $v.modelRepository.buildDir)
      (printf "--http-port=%d" (int $v.triton.ports.http))
      (printf "--grpc-port=%d" (int $v.triton.ports.grpc))
      (printf "--metrics-port=%d" (int $v.triton.ports.metrics))
      "--http-address=0.0.0.0" "--grpc-address=0.0.0.0" "--metrics-address=0.0.0.0"
      (printf "--exit-timeout-secs=%d" (int $v.triton.exitTimeoutSecs))
      (printf "--log-verbose=%d" (int $v.triton.logVerbose))) -}}
{{- if ne $rank 0 }}
{{- $argv = append $argv "--model-control-mode=explicit" -}}
{{- range $m := $v.triton.loadModels }}{{ $argv = append $argv (printf "--load-model=%s" $m) }}{{ end -}}
{{- else if $v.triton.cudaMemoryPoolGpu0Bytes }}
{{- $argv = append $argv (printf "--cuda-memory-pool-byte-size=0:%d" (int64 $v.triton.cudaMemoryPoolGpu0Bytes)) -}}
{{- end -}}
{{- $argv = concat $argv (list "--disable-auto-complete-config" (printf "--backend-config=python,shm-region-prefix-name=%s" $prefix)) -}}
{{- $argv = concat $argv (include "trtpipe.restrictedApiArgs" $ | fromJsonArray) -}}
{{- if and $multiNode (ne $rank 0) }}
{{- $argv = concat $argv (list "--allow-http=false" "--allow-grpc=false" "--allow-metrics=false") -}}
{{- end -}}
{{- if lt $rank (sub $world 1) }}{{ $argv = append $argv ":" }}{{ end -}}
{{- end -}}
{{- toJson $argv -}}
{{- end -}}

{{/* Triton's administrative APIs behind a key, as `trtpipe serve` restricts them off loopback
     (pipeline.serve.stage.ServeOptions.restricted_api_args): `--http-restricted-api=<apis>:<header>=<key>` and
     `--grpc-restricted-protocol=…` (server@r26.04 src/command_line_parser.cc). Health, metadata, inference and
     statistics stay open. The key is `$(TRITON_ADMIN_KEY)`, which the kubelet expands from the container's env
     (the Secret below) before the process starts. Returns a JSON list. */}}
{{- define "trtpipe.restrictedApiArgs" -}}
{{- $a := .Values.triton.adminApi -}}
{{- $spec := printf "%s:%s=$(TRITON_ADMIN_KEY)" (join "," $a.apis) $a.header -}}
{{- toJson (list (printf "--http-restricted-api=%s" $spec) (printf "--grpc-restricted-protocol=%s" $spec)) -}}
{{- end -}}

{{- define "trtpipe.adminSecretName" -}}
{{- .Values.triton.adminApi.secret.name | default (printf "%s-triton-admin" (include "trtpipe.fullname" .)) -}}
{{- end -}}

{{/* the admin key from the Secret (required: Triton must not start with its admin APIs open) */}}
{{- define "trtpipe.adminKeyEnv" -}}
- name: TRITON_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "trtpipe.adminSecretName" . }}
      key: {{ .Values.triton.adminApi.secret.key }}
{{- end -}}

{{/* argv of the single-node server container */}}
{{- define "trtpipe.serverArgv" -}}
{{- if .Values.trtllmServe -}}
{{- include "trtpipe.trtllmServeArgv" . -}}
{{- else -}}
{{- $world := mul (int .Values.parallelism.tp) (int .Values.parallelism.pp) -}}
{{- $ranks := include "trtpipe.rankArgv" . | fromJsonArray -}}
{{- if gt $world 1 -}}
{{- toJson (concat (list "mpirun" "--allow-run-as-root") $ranks) -}}
{{- else -}}
{{- toJson $ranks -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* serving.frontend trtllm-serve: the engine stage's trtllm-serve argv (values trtllmServe.argv, written by
     pipeline.deploy.trtllm_serve) with its --port value taken from trtllmServe.port, so that the Service, the
     probes and the process agree. Returns a JSON list. */}}
{{- define "trtpipe.trtllmServeArgv" -}}
{{- $s := .Values.trtllmServe -}}
{{- $argv := list -}}
{{- $prev := "" -}}
{{- range $a := $s.argv -}}
{{- if eq $prev "--port" }}{{ $argv = append $argv (printf "%d" (int $s.port)) }}{{ else }}{{ $argv = append $argv $a }}{{ end -}}
{{- $prev = $a -}}
{{- end -}}
{{- toJson $argv -}}
{{- end -}}

{{/* the server container's name: mpirun's `kubectl exec` agent on a LeaderWorkerSet addresses it */}}
{{- define "trtpipe.containerName" -}}
{{- if .Values.trtllmServe }}trtllm-serve{{ else }}triton{{ end -}}
{{- end -}}

{{- define "trtpipe.httpPort" -}}
{{- if .Values.trtllmServe }}{{ .Values.trtllmServe.port }}{{ else }}{{ .Values.triton.ports.http }}{{ end -}}
{{- end -}}

{{- define "trtpipe.ports" -}}
{{- if .Values.trtllmServe -}}
- name: http
  containerPort: {{ .Values.trtllmServe.port }}
  protocol: TCP
{{- else -}}
- name: http
  containerPort: {{ .Values.triton.ports.http }}
  protocol: TCP
- name: grpc
  containerPort: {{ .Values.triton.ports.grpc }}
  protocol: TCP
- name: metrics
  containerPort: {{ .Values.triton.ports.metrics }}
  protocol: TCP
{{- end -}}
{{- end -}}

{{/* Triton's HTTP health endpoints (server src/http_server.cc: /v2/health/live, /v2/health/ready); trtllm-serve's
     one route, /health: 200 while the LLM is healthy, else 503 (pipeline.deploy.trtllm_serve.HEALTH_PATH) */}}
{{- define "trtpipe.probes" -}}
{{- $ready := "/v2/health/ready" -}}
{{- $live := "/v2/health/live" -}}
{{- with .Values.trtllmServe }}{{ $ready = .healthPath }}{{ $live = .healthPath }}{{ end -}}
startupProbe:
  httpGet:
    path: {{ $ready }}
    port: http
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
readinessProbe:
  httpGet:
    path: {{ $ready }}
    port: http
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
livenessProbe:
  httpGet:
    path: {{ $live }}
    port: http
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
{{- end -}}

{{- define "trtpipe.resources" -}}
{{- $gpu := dict (default "nvidia.com/gpu" .Values.gpu.resource) (toString .Values.gpu.perPod) -}}
requests:
  {{- toYaml (merge (dict) $gpu .Values.resources.requests) | nindent 2 }}
limits:
  {{- toYaml (merge (dict) $gpu .Values.resources.limits) | nindent 2 }}
{{- end -}}

{{/* the volume holding build directories: a PVC, or an emptyDir the object-store init container fills */}}
{{- define "trtpipe.buildsVolume" -}}
- name: builds
{{- if eq .Values.modelRepository.source "objectStore" }}
  emptyDir: {}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelRepository.pvc.claimName }}
{{- end }}
{{- end -}}

{{- define "trtpipe.podVolumes" -}}
{{ include "trtpipe.buildsVolume" . }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- end -}}

{{- define "trtpipe.volumeMounts" -}}
- name: builds
  mountPath: {{ .Values.modelRepository.mountPath }}
  readOnly: true
- name: dshm
  mountPath: /dev/shm
{{- end -}}

{{/* object-store source: copy the build directory into the pod before Triton starts */}}
{{- define "trtpipe.initContainers" -}}
{{- if eq .Values.modelRepository.source "objectStore" -}}
{{- $os := .Values.modelRepository.objectStore -}}
initContainers:
  - name: fetch-build
    image: {{ required "modelRepository.objectStore.image is required with source objectStore" $os.image }}
    command: ["/bin/sh", "-c"]
    args:
      - 'aws s3 sync "$TRTPIPE_BUILD_URI" "$TRTPIPE_BUILD_DIR" ${AWS_ENDPOINT_URL:+--endpoint-url "$AWS_ENDPOINT_URL"}'
    env:
      - name: TRTPIPE_BUILD_URI
        value: {{ required "modelRepository.objectStore.uri is required with source objectStore" $os.uri | quote }}
      - name: TRTPIPE_BUILD_DIR
        value: {{ .Values.modelRepository.buildDir | quote }}
      - name: AWS_ENDPOINT_URL
        value: {{ $os.endpointUrl | quote }}
    {{- if $os.credentialsSecret }}
    envFrom:
      - secretRef:
          name: {{ $os.credentialsSecret }}
    {{- end }}
    volumeMounts:
      - name: builds
        mountPath: {{ .Values.modelRepository.mountPath }}
{{- end -}}
{{- end -}}

{{- define "trtpipe.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
nodeSelector:
  {{- toYaml (merge (dict "nvidia.com/gpu.product" .Values.gpu.product) .Values.nodeSelector) | nindent 2 }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- end -}}

{{- define "trtpipe.image" -}}
{{ printf "%s:%s" .repository .tag | quote }}
{{- end -}}
