"""Same timed model as ``tensorrt_llm/1/model.py``; this copy's behaviour comes from its config.pbtxt."""

import importlib.util
import os

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tensorrt_llm", "1", "model.py")
_spec = importlib.util.spec_from_file_location("timed_llm_model", _SRC)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
TritonPythonModel = _mod.TritonPythonModel
