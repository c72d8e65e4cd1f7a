"""Triton Inference Server: generated model configs (:mod:`.model_config`), the server process
(:mod:`.server`) and its process/port/log helpers (:mod:`.process`)."""
