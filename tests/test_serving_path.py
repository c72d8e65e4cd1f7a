"""The serving path as one typed object (issue #45 item 1): ``pipeline.recipe.serving_path``.

Every shipped recipe resolves to a row of the table; a combination off the table is one line naming the field;
a generated repository holds exactly the row's models; the engine stage records its row in its manifest and
``trtpipe serve`` learns a build's frontend from that manifest alone (an engine manifest written before the key
existed reads the same row through the one fallback). The last test is the ratchet on the branches that still decide
a path outside the table (read from the source with ``ast``, ``tests/structure.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from structure import DISPATCH_TABLE, dispatch_branches

from pipeline.core.errors import RecipeError
from pipeline.core.layout import BuildLayout
from pipeline.recipe import load_recipe
from pipeline.recipe.serving_path import (
    PATHS,
    TRTLLM_SERVE,
    path_of_engine,
    serving_path,
)

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
CPU = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
CPU_LLMAPI = REPO / "recipes" / "smollm2_135m_cpu_llmapi.yaml"
TRT = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
PYT = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
TS = [f"serving.frontend={TRTLLM_SERVE}"]
#: one recipe (file, overrides) per row of the table
ROWS = {
    "tensorrt/gpu/triton": (TRT, []),
    "pytorch/gpu/triton": (PYT, []),
    "pytorch/gpu/trtllm-serve": (PYT, TS),
    "cpu/cpu/triton": (CPU, []),
    "pytorch/cpu/triton": (CPU_LLMAPI, []),
    "pytorch/cpu/trtllm-serve": (CPU_LLMAPI, TS),
}
#: the vision rows (modality ``vision``, issue #46): one recipe each
VISION_ROWS = {
    "tensorrt/gpu/triton/vision": (REPO / "recipes" / "llama32_11b_vision_h200_fp8.yaml", []),
    "cpu/cpu/triton/vision": (REPO / "recipes" / "tiny_mllama_cpu.yaml", []),
}

#: branches on the serving path left outside the table (the ratchet: lower them, never raise them). The goal of
#: issue #45: engine-kind comparisons ≤ 3 outside the table, frontend comparisons 0.
MAX_BRANCHES = {"engine_kind": 1, "frontend": 0, "cpu_target": 11}


def test_the_table_is_the_six_real_paths_and_two_vision_rows():
    assert set(PATHS) == set(ROWS) | set(VISION_ROWS)
    for key, path in PATHS.items():
        assert path.key == key and PATHS[path.twin].twin == key and path.on(PATHS[path.twin].target) is PATHS[path.twin]
        assert path.modality == ("vision" if key in VISION_ROWS else "text")
        assert ("multimodal_encoders" in path.repo_models) == (key in VISION_ROWS)
    for key, (recipe_file, sets) in VISION_ROWS.items():  # the text row of the same engine/target/frontend
        assert PATHS[key.removesuffix("/vision")].repo_models == tuple(m for m in PATHS[key].repo_models if m != "multimodal_encoders")


@pytest.mark.parametrize("key", sorted(ROWS))
def test_a_rows_unread_knobs_are_the_knobs_its_recipe_is_refused(key):
    """``unread_knobs`` (derived from the build section's types) names exactly what a recipe of that row may not set:
    each one is refused with a line naming it, and none of them is a field of the row's own build type."""
    recipe_file, sets = ROWS[key]
    unread = PATHS[key].unread_knobs
    assert unread
    for knob in unread:
        with pytest.raises(RecipeError, match=knob.replace(".", r"\.")):
            load_recipe(recipe_file, [*sets, f"{knob}=1"])
    assert not set(unread) & {f"build.{f}" for f in type(load_recipe(recipe_file, sets).build).model_fields}


@pytest.mark.parametrize("key", sorted(VISION_ROWS))
def test_a_vision_recipe_resolves_to_its_vision_row(key):
    recipe_file, sets = VISION_ROWS[key]
    if not recipe_file.is_file():
        pytest.skip(f"{recipe_file.name} is not in this checkout yet")
    assert serving_path(load_recipe(recipe_file, sets)).key == key


def test_the_frontend_names_are_the_recipe_field_choices():
    from typing import get_args

    from pipeline.recipe import ServingSpec
    from pipeline.recipe.serving_path import FRONTENDS

    assert set(get_args(ServingSpec.model_fields["frontend"].annotation)) == set(FRONTENDS)
    assert {p.frontend for p in PATHS.values()} == set(FRONTENDS)


@pytest.mark.parametrize("key", sorted(ROWS))
def test_each_row_is_what_its_recipe_resolves_to(key):
    recipe_file, sets = ROWS[key]
    assert serving_path(load_recipe(recipe_file, sets)).key == key


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_has_a_path(path):
    assert serving_path(load_recipe(path)).key in PATHS


@pytest.mark.parametrize("recipe_file, sets, field", [
    (CPU, ["build.engine=tensorrt"], "build.engine"),
    (TRT, ["build.engine=cpu"], "build.engine"),
    (TRT, TS, "serving.frontend"),
    (CPU, TS, "serving.frontend"),
])
def test_a_combination_off_the_table_is_one_line_naming_the_field(recipe_file, sets, field):
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file, sets)
    assert f" {field}: " in f" {e.value}" and "\n" not in str(e.value)


def test_cli_refuses_a_combination_off_the_table_with_exit_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pipeline.cli", "recipe", "validate", str(TRT), "--set", TS[0]], check=False,
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 2
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if "serving.frontend" in ln]
    assert lines and "trtllm-serve serves only build.engine: pytorch" in lines[0] and "Traceback" not in res.stderr


@pytest.mark.parametrize("key", sorted(ROWS))
def test_the_repository_holds_the_rows_models(key, tmp_path):
    from pipeline.triton_repo.stage import model_configs

    recipe_file, sets = ROWS[key]
    configs = model_configs(load_recipe(recipe_file, sets), tmp_path / "engine", repo_dir=tmp_path / "repo")
    assert sorted(configs) == sorted(PATHS[key].repo_models)


@pytest.fixture(scope="module")
def dry_builds(tmp_path_factory) -> dict[str, Path]:
    """``trtpipe build RECIPE --dry-run --stage engine`` of each row (commands and configs, no weights)."""
    from pipeline.assemble.stage import run

    base = tmp_path_factory.mktemp("paths")
    out = {}
    for key, (recipe_file, sets) in ROWS.items():
        out[key] = base / key.replace("/", "-")
        run(load_recipe(recipe_file, sets), out[key], recipe_dir=recipe_file.parent, until="engine", dry_run=True,
            warn=lambda _m: None)
    return out


def _engine_manifest(build: Path) -> dict:
    return json.loads((BuildLayout(build).engine / "manifest.json").read_text())


@pytest.mark.parametrize("key", sorted(ROWS))
def test_the_engine_stage_records_its_path_and_an_old_manifest_reads_the_same(dry_builds, key):
    manifest = _engine_manifest(dry_builds[key])
    assert manifest["serving_path"] == key and path_of_engine(manifest) is PATHS[key]
    old = {k: v for k, v in manifest.items() if k != "serving_path"}  # written before the key existed
    assert path_of_engine(old) is PATHS[key]


@pytest.mark.parametrize("key", sorted(ROWS))
def test_serve_learns_the_frontend_from_the_manifest_only(dry_builds, key, tmp_path):
    """``trtllm_serve_spec`` follows the manifest's ``serving_path`` alone: a build whose key says Triton is served by
    Triton even with a trtllm_serve.json beside it, and one whose key says trtllm-serve gets its command."""
    import shutil

    from pipeline.serve.compat import ServeTarget
    from pipeline.serve.frontend import trtllm_serve_spec

    build = tmp_path / "b"
    shutil.copytree(dry_builds[key], build)
    layout = BuildLayout(build)
    spec = trtllm_serve_spec(ServeTarget(layout.triton_repo, layout))
    path = PATHS[key]
    assert (spec is not None) == path.trtllm_serve
    if spec is not None:
        assert spec["cpu"] == path.on_cpu and "--host" in spec["argv"] and Path(spec["options"]).is_file()
    manifest = layout.engine / "manifest.json"
    old = {k: v for k, v in json.loads(manifest.read_text()).items() if k != "serving_path"}
    manifest.write_text(json.dumps(old))  # a build made before the engine stage recorded its path
    assert trtllm_serve_spec(ServeTarget(layout.triton_repo, layout)) == spec
    (layout.engine / "trtllm_serve.json").write_text(json.dumps({"argv": ["trtllm-serve", "--host", "h", "--port", "1"]}))
    assert (trtllm_serve_spec(ServeTarget(layout.triton_repo, layout)) is not None) == path.trtllm_serve


def test_an_engine_manifest_of_an_unknown_path_is_refused():
    from pipeline.core.errors import IncompatibleArtifactError

    with pytest.raises(IncompatibleArtifactError, match="serving_path 'tensorrt/cpu/triton'"):
        path_of_engine({"serving_path": "tensorrt/cpu/triton"})


def test_serving_path_is_the_one_dispatch():
    """The ratchet: comparisons on the engine kind, the frontend and "target is CPU" outside
    ``pipeline/recipe/serving_path.py`` (``tests/structure.py``: ``dispatch_branches``) stay at or below
    :data:`MAX_BRANCHES`. The goal (issue #45): engine-kind ≤ 3 and frontend 0 outside the table. Main before the
    table had 28 engine-kind, 12 frontend and 16 cpu-target comparisons; those left are listed in the failure."""
    found = dispatch_branches([REPO / "pipeline"])
    assert (REPO / DISPATCH_TABLE).is_file()
    over = {k: v for k, v in found.items() if len(v) > MAX_BRANCHES[k]}
    assert not over, "read the ServingPath instead of comparing: " + json.dumps(over, indent=1)


def test_the_branch_counter_is_not_vacuous(tmp_path):
    """Each kind of comparison the ratchet counts is found in a module written for the purpose."""
    pkg = tmp_path / "pipeline"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "def f(recipe, spec, install):\n"
        "    a = recipe.build.engine == 'pytorch'\n"
        "    b = spec.frontend != TRTLLM_SERVE\n"
        "    c = recipe.gpu is None or recipe.target.gpu == CPU_TARGET\n"
        "    d = install.kind == 'cpu' or spec.path.trtllm_serve\n"
        "    e = recipe.build.engine in (('cpu', 'pytorch') if d else ('cpu',))\n"
        "    return a, b, c, d, e\n")
    found = {k: len(v) for k, v in dispatch_branches([pkg]).items()}
    assert found == {"engine_kind": 2, "frontend": 1, "cpu_target": 2}
