"""Snippets shared by the dry-run scripts (``quantize_command.sh``, ``trtllm_build.sh``, ``tokenizer_command.sh``):
the chain a user runs top to bottom in the container, each script reading what the previous one wrote."""

from __future__ import annotations

import shlex


def save_tokenizer(model: str, dest: str, *, trust_remote_code: bool) -> str:
    """A bash line that writes ``model``'s tokenizer files (transformers ``save_pretrained``) into ``dest``.

    Args:
        model: a HF hub id or local checkpoint directory (shell-quoted here).
        dest: the directory to write; may hold a ``${VAR}`` expanded by bash (quoted with double quotes).
        trust_remote_code: transformers' flag, as the recipe's ``model.trust_remote_code``.
    """
    code = ("import sys; from transformers import AutoTokenizer; "
            f"AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code={bool(trust_remote_code)}).save_pretrained(sys.argv[2])")
    return f'python3 -c {shlex.quote(code)} {shlex.quote(model)} "{dest}"'
