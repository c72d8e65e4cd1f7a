"""Triton model-repository templates (data) and trtpipe's python-backend model code.

Layout of this package (shipped as package data, rendered by :mod:`pipeline.triton_repo`):

- ``layouts.yaml``: which models each ``build.engine`` kind puts in a repository, and the fixed
  values (container paths, tokenizer file names) — no such string lives in Python code.
- ``templates/*.pbtxt.j2``: jinja2 templates of every ``config.pbtxt`` (rendered with
  ``StrictUndefined`` and parsed into ``ModelConfig`` so an unknown field fails at generation time).
- ``models/<name>/model.py``: the python-backend models (preprocessing, postprocessing,
  tensorrt_llm_bls, and the CPU ``tensorrt_llm``), plus ``models/_common.py`` and ``detokenize.py``,
  which are copied next to every ``model.py`` so a generated repository is self-contained.
"""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"
MODELS_DIR = PACKAGE_DIR / "models"
LAYOUTS_FILE = PACKAGE_DIR / "layouts.yaml"
