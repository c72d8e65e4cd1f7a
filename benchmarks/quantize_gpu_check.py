"""The quantize stage (real ModelOpt) on a CUDA GPU against the same recipe on CPU: a device check, not a test.

    TOKENIZER_DIR=DIR python benchmarks/quantize_gpu_check.py WORK_DIR [RESULT_JSON | --cpu-only]

Random-weight models made offline from configs (no hub): tiny Llama-3.1 and Qwen2.5 shapes (hidden 256, 2 layers)
and Llama-3.2-1B's shape (with ``GQ_8B=1`` only Llama-3.1-8B's, FP8, GPU only), each with the tokenizer in ``TOKENIZER_DIR`` (default ``.devcarry/tok``; e.g. a CPU
build's ``engine/`` holds SmolLM2's). Each case runs ``pipeline.quantize.stage.run`` in its own process: on the GPU,
then (tiny shapes) with ``CUDA_VISIBLE_DEVICES=""``. Prints and writes per case the wall time (s), the stage's own
timings, the device and calibration dtype the manifest records, peak CUDA memory (MiB, torch's allocator) and RSS
(GiB), the checkpoint geometry check (pipeline/trtllm/checkpoint.py) and, GPU against CPU, the largest relative difference
of the TensorRT-LLM checkpoint's scaling factors, and that checkpoint's tensor bytes by kind (linear weights, scales,
embedding, lm_head, norms: what ``trtpipe plan``'s ``memory.weights`` predicts). Needs torch with CUDA, nvidia-modelopt and trtpipe's own
dependencies (pydantic, PyYAML, transformers); the quality figures of random weights mean nothing.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
OUT = Path(sys.argv[1])
CPU_ONLY = "--cpu-only" in sys.argv
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, max_position_embeddings=16384, rms_norm_eps=1e-5)
MODELS = {"llama31": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING, "head_dim": 64}),
          # Llama-3.2-1B's shape (random weights): a size where GPU time and memory mean something
          "llama32_1b": ("LlamaConfig", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                                         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                                         "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
                                         "rope_scaling": {**LLAMA3_SCALING, "factor": 32.0}}),
          # Llama-3.1-8B's shape (recipes/llama31_8b_h200_fp8.yaml's model), made in bfloat16 on the GPU
          "llama31_8b": ("LlamaConfig", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                         "vocab_size": 128256, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING,
                                         "max_position_embeddings": 131072}),
          "qwen25": ("Qwen2Config", {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True})}
CASES = [("llama31_8b", "fp8", "bfloat16")] if os.environ.get("GQ_8B") else [("llama31", "fp8", "bfloat16"), ("llama31", "int4_awq", "bfloat16"), ("qwen25", "fp8", "bfloat16"),
         ("llama31", "fp8", "float32"), ("llama32_1b", "fp8", "bfloat16"), ("llama32_1b", "int4_awq", "bfloat16")]


def make_models(root: Path) -> dict[str, Path]:
    import torch
    import transformers

    out = {}
    for name, (cls, extra) in MODELS.items():
        if os.environ.get("GQ_MODEL") not in (None, name):
            continue
        path = root / name
        if not (path / "config.json").exists():
            torch.manual_seed(0)
            cfg = getattr(transformers, cls)(**{**TINY, **extra})
            if name == "llama31_8b":  # 32 GB in float32 on the host: made in bfloat16 on the GPU instead
                with torch.device("cuda"):
                    big = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
                big.save_pretrained(path)
                del big
                torch.cuda.empty_cache()
            else:
                transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(path)
            for f in Path(os.environ.get("TOKENIZER_DIR", HERE.parent / ".devcarry" / "tok")).iterdir():
                shutil.copy2(f, path / f.name)
        out[name] = path
    return out


def one(model: str, qformat: str, dtype: str, root: Path) -> dict:
    import torch

    from pipeline.core.layout import BuildLayout
    from pipeline.quantize import stage as quantize
    from pipeline.recipe import load_recipe
    from pipeline.trtllm.checkpoint import check_checkpoint_config

    os.environ["GQ_MODEL"] = model
    t0 = time.perf_counter()
    src = make_models(root.parent / "models")[model]
    made_s = time.perf_counter() - t0
    work = root / f"{model}_{qformat}_{dtype}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = {"model": {"source": str(src), "dtype": dtype}, "target": {"gpu": "cpu"},
            "quantization": {"qformat": qformat, "awq_block_size": 64, "kv_cache_dtype": "fp8",
                             "calibration": {"dataset": "embedded", "size": 16, "max_seq_length": 128, "batch_size": 4,
                                             "eval_samples": 4}},
            "build": {"engine": "cpu", "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 512},
            "bench": {"scenarios": [{"isl": 16, "osl": 16}]}}
    (work / "r.yaml").write_text(yaml.safe_dump(data))
    recipe = load_recipe(work / "r.yaml")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    res = quantize.run(recipe, BuildLayout(work / "b"), recipe_dir=work)
    wall = time.perf_counter() - t
    ckpt = json.loads((res.trtllm_ckpt / "config.json").read_text())
    hf = json.loads((src / "config.json").read_text())
    rep = check_checkpoint_config(dict(ckpt), hf, has_lm_head=None)
    from safetensors.torch import load_file

    scales = {}
    nbytes: dict[str, int] = {}  # the TensorRT-LLM checkpoint's tensor bytes by kind (what the planner predicts)
    for f in sorted(res.trtllm_ckpt.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if "scaling_factor" in k or k.endswith("scale"):
                kind = "scales"
                if v.numel() <= 4096:
                    scales[k] = v.float().flatten().tolist()
            elif "vocab_embedding" in k:
                kind = "embedding"
            elif k.startswith("lm_head"):
                kind = "lm_head"
            elif v.dim() == 1:
                kind = "norms_and_biases"
            else:
                kind = "linear"
            nbytes[kind] = nbytes.get(kind, 0) + v.numel() * v.element_size()
    m = res.manifest
    return {"model": model, "qformat": qformat, "dtype": dtype, "wall_s": round(wall, 2), "model_made_s": round(made_s, 1),
            "stage_timings": m.get("timings_s"), "calib_dtype": m.get("calib_dtype"), "peak_rss_gib": round(m.get("peak_rss_bytes", 0) / 2**30, 2),
            "device": m.get("device"), "quality": m.get("quality"),
            "peak_cuda_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None,
            "geometry_problems": rep.problems, "geometry_checked": len(rep.checked),
            "rotary_base": ckpt.get("rotary_base"), "rotary_scaling": ckpt.get("rotary_scaling"),
            "quant": ckpt.get("quantization"), "ckpt_tensor_bytes": nbytes, "scales": scales}


def compare(a: dict, b: dict) -> dict:
    keys = sorted(set(a["scales"]) & set(b["scales"]))
    worst, n = 0.0, 0
    for k in keys:
        for x, y in zip(a["scales"][k], b["scales"][k]):
            n += 1
            if max(abs(x), abs(y)) > 0:
                worst = max(worst, abs(x - y) / max(abs(x), abs(y)))
    return {"tensors": len(keys), "values": n, "only_gpu": len(set(a["scales"]) - set(b["scales"])),
            "only_cpu": len(set(b["scales"]) - set(a["scales"])), "max_rel_diff": worst}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 2 and sys.argv[2] == "--case":
        model, qformat, dtype = sys.argv[3:6]
        r = one(model, qformat, dtype, OUT / ("cpu" if not __import__("torch").cuda.is_available() else "gpu"))
        print(json.dumps(r))
        return
    import torch

    print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", flush=True)
    results = []
    for model, qformat, dtype in CASES:
        row = {}
        for where in (["cpu"] if CPU_ONLY else ["gpu"] if model in ("llama32_1b", "llama31_8b") else ["gpu", "cpu"]):
            env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if where == "cpu" else {})}
            try:
                p = subprocess.run([sys.executable, __file__, str(OUT), "--case", model, qformat, dtype], env=env,
                                   capture_output=True, text=True, timeout=380 if model == "llama31_8b" else 240)
            except subprocess.TimeoutExpired:
                row[where] = {"error": "timeout"}
                print(where, model, qformat, dtype, row[where], flush=True)
                continue
            if p.returncode != 0:
                row[where] = {"error": (p.stdout + p.stderr)[-3000:]}
            else:
                row[where] = json.loads(p.stdout.strip().splitlines()[-1])
            r = row[where]
            print(where, model, qformat, dtype, {k: r.get(k) for k in ("wall_s", "device", "peak_cuda_mib",
                  "geometry_problems", "rotary_base", "calib_dtype", "stage_timings", "peak_rss_gib", "ckpt_tensor_bytes", "quality", "error")}, flush=True)
        if "gpu" in row and "scales" in row.get("gpu", {}) and "scales" in row.get("cpu", {}):
            c = compare(row["gpu"], row["cpu"])
            print("  scales gpu vs cpu:", c, flush=True)
            row["compare"] = c
        for r in row.values():
            if isinstance(r, dict):
                r.pop("scales", None)
        results.append(row)
    (OUT / "gpu_quant.json").write_text(json.dumps(results, indent=1))
    if len(sys.argv) > 2 and sys.argv[2] not in ("--cpu-only",):
        shutil.copy2(OUT / "gpu_quant.json", sys.argv[2])


if __name__ == "__main__":
    main()
