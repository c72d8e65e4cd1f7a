"""The documented ``docker run`` commands work as written (#44 item 2): every variable the container's shell expands
is passed into the container with ``-e``, and every GPU run carries the ``--ulimit`` flags docs/deploy-gpu.md
prescribes for TensorRT-LLM containers."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ULIMITS = ("memlock=-1", "stack=67108864")


def docker_runs() -> list[tuple[str, str]]:
    """``[(file, command)]``: every ``docker run`` in a fenced code block, continuation lines joined."""
    out = []
    for doc in DOCS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(), flags=re.DOTALL):
            for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
                cmd = cmd.strip()
                if cmd.startswith("docker run"):
                    out.append((doc.name, cmd))
    return out


def _options(argv: list[str]) -> tuple[set[str], list[str]]:
    """(names passed with -e/--env, values of --ulimit) of a docker run argv."""
    env, ulimits = set(), []
    for i, a in enumerate(argv):
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if a in ("-e", "--env"):
            env.add(value.split("=")[0])
        elif a.startswith("--env="):
            env.add(a.split("=", 2)[1])
        elif a == "--ulimit":
            ulimits.append(value)
        elif a.startswith("--ulimit="):
            ulimits.append(a.split("=", 1)[1])
    return env, ulimits


def _container_vars(cmd: str) -> set[str]:
    """Variables the container expands: ``\\$VAR`` inside double quotes, ``$VAR`` inside single quotes."""
    names = set(re.findall(r"\\\$\{?(\w+)", cmd))
    for single in re.findall(r"'([^']*)'", cmd):
        names |= set(re.findall(r"\$\{?(\w+)", single))
    return names


def test_the_docs_have_the_one_container_gpu_command():
    runs = docker_runs()
    assert any("README" in f and "--entrypoint bash" in c and "trtpipe serve" in c for f, c in runs), runs
    assert sum("deploy-gpu" in f for f, _ in runs) >= 3


def test_every_variable_used_inside_the_container_is_passed_with_e():
    for doc, cmd in docker_runs():
        env, _ = _options(shlex.split(cmd))
        missing = _container_vars(cmd) - env
        assert not missing, f"{doc}: {sorted(missing)} expanded inside the container but not passed with -e: {cmd}"


def test_a_server_off_loopback_gets_its_admin_key():
    """``serve --host 0.0.0.0`` refuses without an admin key (pipeline/commands/serve.py: --admin-key, envvar
    TRTPIPE_ADMIN_KEY): the key is on the command line (expanded by the host) or passed into the container."""
    for doc, cmd in docker_runs():
        if "--host 0.0.0.0" in cmd:
            env, _ = _options(shlex.split(cmd))
            on_line = re.search(r"--admin-key\s+\"?\$\{?TRTPIPE_ADMIN_KEY", cmd) and "\\$TRTPIPE_ADMIN_KEY" not in cmd
            assert on_line or "TRTPIPE_ADMIN_KEY" in env, f"{doc}: {cmd}"


def test_every_gpu_run_has_the_ulimits():
    for doc, cmd in docker_runs():
        if "--gpus" in cmd:
            _, ulimits = _options(shlex.split(cmd))
            for u in ULIMITS:
                assert u in ulimits, f"{doc}: --ulimit {u} missing: {cmd}"


def test_the_ulimits_checked_are_the_ones_deploy_gpu_prescribes():
    text = (REPO / "docs/deploy-gpu.md").read_text()
    assert "`--ulimit memlock=-1 --ulimit stack=67108864`" in text


# ------------------------------------------------------------------ deploy after the documented set-up (#44 item 6)
def test_deploy_without_its_extra_is_one_line_with_the_exact_install_command(tmp_path):
    """The quickstart installs only `cpu`; `deploy k8s` then names the extra and the command for this install."""
    import os
    import subprocess
    import sys

    block = tmp_path / "block"
    block.mkdir()
    (block / "helm_python.py").write_text("raise ImportError('not installed (test)')\n")
    env = {**os.environ, "PYTHONPATH": f"{block}{os.pathsep}{REPO}", "COLUMNS": "400"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "deploy", "k8s", str(REPO / "recipes/llama31_8b_h200_fp8.yaml"),
                        "--out", str(tmp_path / "o")], check=False, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and len(lines) == 1, p.stderr
    assert "helm_python" in lines[0] and "'deploy' extra" in lines[0]
    exact = f"{shlex.quote(sys.executable)} -m pip install -e {shlex.quote(f'{REPO}[deploy]')}"
    assert lines[0].endswith(exact), lines[0]
    assert not (tmp_path / "o").exists()


def test_the_deploy_extra_holds_what_deploy_imports_and_the_readme_says_how_to_get_it():
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["deploy"]
    names = {re.split(r"[<>=~\[]", d)[0].strip().lower() for d in extra}
    assert {"helm-python-sdk", "kubernetes-validate", "jsonschema", "referencing"} <= names
    readme = (REPO / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| `trtpipe deploy k8s"))
    assert "`deploy` extra" in row and "TRTPIPE_EXTRAS=cpu,deploy ./scripts/quickstart.sh" in row
    quickstart = (REPO / "scripts/quickstart.sh").read_text()
    assert 'TRTPIPE_EXTRAS="${TRTPIPE_EXTRAS:-cpu}"' in quickstart  # the documented override reaches setup.sh


def test_the_readme_lists_every_shipped_recipe():
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in sorted((REPO / "recipes").glob("*.yaml")) if f"`{p.name}`" not in readme]
    assert not missing, missing
