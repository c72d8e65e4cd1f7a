"""Accuracy evaluation: tasks, scores and statistics of `trtpipe eval` (stage: pipeline.stages.eval)."""
