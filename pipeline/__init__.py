"""trtpipe: Hugging Face checkpoint → ModelOpt quantization → TensorRT-LLM engine → Triton → benchmark.

The package is a set of stages (``recipe``, ``quantize``, ``engine``, ``triton_repo``, ``serve``,
``bench``, ``plan``), each a function from a typed config to an artifact directory with a
``manifest.json``. ``pipeline.cli`` is a thin typer shell over them. Heavy libraries (torch,
modelopt, transformers, tensorrt_llm, tritonclient) are imported lazily inside the stages.
"""

__version__ = "0.1.0"
