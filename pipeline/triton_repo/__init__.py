"""Triton model-repository templates (data) and trtpipe's python-backend model code.

The repository stage (:mod:`.stage`, ``run()``; its result :mod:`.result`) renders them
(:mod:`.render`). Layout of this package (shipped as package data):

- ``layouts.yaml``: the fixed values of a repository (container paths, tokenizer file names) — no such string
  lives in Python code; which models each serving path puts in a repository is
  :data:`pipeline.recipe.serving_path.PATHS`.
- ``templates/*.pbtxt.j2``: jinja2 templates of every ``config.pbtxt`` (rendered with
  ``StrictUndefined`` and parsed into ``ModelConfig`` so an unknown field fails at generation time).
- ``models/<name>/model.py``: the python-backend models (preprocessing, postprocessing,
  tensorrt_llm_bls, the CPU ``tensorrt_llm``, and ``llmapi``: the LLM-API ``tensorrt_llm``), plus ``models/_common.py`` and ``detokenize.py``,
  which are copied next to every ``model.py`` so a generated repository is self-contained.
"""

import functools
from pathlib import Path
from typing import Any

import yaml

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"
MODELS_DIR = PACKAGE_DIR / "models"
LAYOUTS_FILE = PACKAGE_DIR / "layouts.yaml"


@functools.cache
def layouts() -> dict[str, Any]:
    """The parsed ``layouts.yaml`` (the fixed values of a generated repository)."""
    return yaml.safe_load(LAYOUTS_FILE.read_text())


def client_tokenizer_dir(layout: Any) -> Path | None:
    """The tokenizer a client of the build in ``layout`` (a :class:`pipeline.core.layout.BuildLayout`) should
    use, or ``None``.

    In order: the repository's ``preprocessing/tokenizer`` (tensorrt/cpu layouts), the ``tokenizer``
    (else ``model``) directory named in the LLM-API model's ``model.yaml`` (the server loads its
    tokenizer from there), then ``quantize/hf_ckpt``.
    """
    from pipeline.core.layout import LLMAPI_MODEL_YAML, TOKENIZER_FILES

    cands = [layout.triton_repo / layouts()["tokenizer"]["repo_subdir"]]
    model_yaml = layout.triton_repo / LLMAPI_MODEL_YAML
    if model_yaml.is_file():
        try:
            data = yaml.safe_load(model_yaml.read_text())
        except (OSError, yaml.YAMLError):
            data = None
        if isinstance(data, dict):
            cands += [Path(str(data[k])) for k in ("tokenizer", "model") if isinstance(data.get(k), str)]
    cands.append(layout.hf_ckpt)
    return next((c for c in cands if any((c / f).is_file() for f in TOKENIZER_FILES)), None)
