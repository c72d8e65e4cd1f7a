"""Accuracy evaluation: tasks, scores and statistics of `trtpipe eval` (stage: pipeline.eval.stage; its tables: pipeline.eval.report)."""
