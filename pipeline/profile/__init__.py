"""``trtpipe profile``: what the device does during one load point, as one table, a plot and ``profile.json``.

- GPU (:mod:`pipeline.profile.nsys_run`): the server runs under Nsight Systems with the capture limited to a range of
  executor iterations (TensorRT-LLM's ``TLLM_PROFILE_START_STOP`` with ``nsys profile -c cudaProfilerApi``), one
  ``trtpipe bench`` load point drives it, the report is exported to SQLite and analysed
  (:mod:`pipeline.profile.nsys_sqlite`: any Nsight Systems SQLite export).
- CPU (:mod:`pipeline.profile.cpu`): the CPU engine's own step timeline (:mod:`pipeline.cpu_runtime.timeline`),
  published as Prometheus gauges by the served model and differenced over the bench's measured window.

Both give a :data:`~pipeline.profile.report.Report` (:mod:`pipeline.profile.report`): active %, unit (kernel / step)
count and mean duration, categories, idle gaps, top units.
"""
