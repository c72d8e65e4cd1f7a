"""The calibration room: the commands that measure what the planner (:mod:`pipeline.plan`) only calculates.

It sits above the stages — it runs a whole build, serve and bench and reads bench results — so that
:mod:`pipeline.plan` stays a calculator that imports no stage (``tests/test_structure.py`` checks both):

- :mod:`pipeline.calibrate.host`: ``trtpipe plan measure-host`` — this host's rates for the cpu target's
  predictions (:func:`~pipeline.calibrate.host.measure` → :class:`~pipeline.core.hardware.HostSpec`); its served
  probe is built by the build stage (:func:`pipeline.assemble.stage.run`), served by :mod:`pipeline.serve` and benched
  by :mod:`pipeline.bench`.
- :mod:`pipeline.calibrate.measured`: ``trtpipe plan [RECIPE] --against RUN_DIR`` — predicted
  (:func:`pipeline.plan.predict`) vs measured (a ``trtpipe bench`` run's ``bench.json``) per load point
  (:func:`~pipeline.calibrate.measured.compare_run`).
"""
