"""CPU inference engine behind the Triton ``tensorrt_llm`` model (see :mod:`.engine`)."""
