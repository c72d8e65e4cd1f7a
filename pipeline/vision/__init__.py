"""Vision-language models (issues #46 and #47): the foundations of the vision encoder stage.

- :mod:`pipeline.vision.geometry`: the arithmetic rules (mllama encoder length, Qwen2-VL image tokens), one place;
- :mod:`pipeline.vision.images`: images made locally (scikit-image's bundled samples, seeded synthetic ones);
- :mod:`pipeline.vision.tiny_mllama`: a tiny random mllama built from a config, saved as an HF checkpoint;
- :mod:`pipeline.vision.onnx_export`: vision model + projector → ONNX, checked, and run by onnxruntime against PyTorch;
- :mod:`pipeline.vision.trt_build`: the TensorRT build script a GPU host runs on that ONNX file.

Only :mod:`~pipeline.vision.geometry` is import-light (no torch); the others import torch/transformers/onnx lazily
or at module level and are meant for the stage that needs them. See ``docs/vision.md``.
"""
