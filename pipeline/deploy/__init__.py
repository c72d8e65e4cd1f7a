"""``trtpipe deploy k8s``: the Kubernetes deployment of one build, as a Helm chart, a Dynamo graph or KServe.

The stage is :func:`pipeline.deploy.stage.run` (typed result :class:`pipeline.deploy.stage.DeployResult`); what
to deploy is :mod:`pipeline.deploy.spec`, the formats :mod:`pipeline.deploy.helm` and
:mod:`pipeline.deploy.manifests`, the schema checks :mod:`pipeline.deploy.validate`, the trtllm-serve frontend
:mod:`pipeline.deploy.trtllm_serve`.
"""
