"""Engine builders, one per ``build.engine``: :mod:`.tensorrt` (``trtllm-build``), :mod:`.pytorch`
(LLM-API configuration) and :mod:`.cpu` (the CPU engine directory), plus :mod:`.contract` (the
TensorRT-LLM contract as data). The engine stage, :mod:`pipeline.engine.stage`, dispatches to them.
"""
