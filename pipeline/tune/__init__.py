"""``trtpipe tune``: sweep recipe knobs, measure every point for real, and name the best certified configuration.

Modules: :mod:`.spec` (TUNE.yaml schema and loader), :mod:`.points` (a point = the base recipe plus changes;
its id, which stages it rebuilds, whether it changes numerics, its plan), :mod:`.analysis` (objective, SLOs,
speedup intervals, Pareto front, winner or tie), :mod:`.runner` (build → serve → bench → eval per point,
resumable, the modes), :mod:`.report` (tables, plot, report.md, best recipe), :mod:`.tracking` (MLflow).
"""
