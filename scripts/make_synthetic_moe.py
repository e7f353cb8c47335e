"""Build the synthetic Qwen3-MoE benchmark model (issue 27): random weights, realistic proportions.

    .venv/bin/python scripts/make_synthetic_moe.py [--out ~/.cache/helios-synthetic/qwen3moe-a0.2b]
        [--seed 0] [--counts-only] [--force]

What it does, each step skipped when its output is already there (``--force`` redoes them all):

1. A transformers ``Qwen3MoeConfig``: 16 layers, hidden 1024, 16 query / 4 KV heads of 128, 32
   experts of 512, top-4 (renormalised), every layer sparse, the Qwen2 vocabulary (151,936), tied
   embeddings. About 1.05B parameters in all, 0.19B of them used per token outside the embedding
   table (the counts are printed; ``--counts-only`` stops there).
2. Random weights, seeded per tensor (a SHA-256 of the seed and the tensor's name, so the values do
   not depend on the order tensors are visited in): normal, std 0.02, for the matrices, except the
   two that write into the residual stream: attention ``o_proj`` std 0.005 and the experts'
   ``down_proj`` std 0.08; 1 for the RMSNorm weights. Saved with ``save_pretrained`` as bf16
   safetensors. With 0.02 everywhere the attention branch drowns the expert branch and every
   position's hidden state tends to the same context average: 32 positions of a prompt chose only
   4-17 of the 32 experts per layer and greedy decoding repeated one token. With the two scales
   above they choose 18-32 (like a trained MoE, whose 32-stream decode touches nearly every expert)
   and 24 greedy tokens are 24 different ones (transformers' bf16 forward of the HF folder).
3. A real Qwen2 tokenizer beside them, rebuilt from the vocabulary, merges and special tokens of the
   Qwen2.5-Coder GGUF Helios downloads (``tokenizer.json``, ``tokenizer_config.json`` with its chat
   template, ``generation_config.json``): byte-level BPE with Qwen2's split pattern and NFC, which
   llama.cpp's converter recognises as the ``qwen2`` pre-tokenizer.
4. llama.cpp's own ``convert_hf_to_gguf.py`` to a BF16 GGUF, then its ``llama-quantize`` to
   Q4_K_M (the matrices' column counts, 1024 and 512 and 2048, are multiples of 256, so no k-quant
   falls back to a legacy type).
5. ``manifest.json`` in the output folder: the config, the parameter counts, the time of each step,
   each file's size and SHA-256, the llama.cpp build, and the commands to serve the file with Helios
   and llama-server and to run the side-by-side benchmark (also printed).

Needs the llama.cpp tree and build of ``shared/bench/peers/llama_server.sh setup`` (``--llama-src``,
``--llama-build``); builds the ``llama-quantize`` target there when it is missing. Measured: 3.6-5.5
minutes on 2 shared cores, peak RSS 3.5 GB, 4.8 GB of disk at the peak and 2.7 GB at the end (the
HF folder and the Q4_K_M file; the BF16 GGUF is deleted unless ``--keep-bf16``). A rebuild with the same
seed gave the same bytes: safetensors, BF16 and Q4_K_M GGUF (the SHA-256s in the manifest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HOME = Path.home()
DEFAULT_OUT = HOME / ".cache" / "helios-synthetic" / "qwen3moe-a0.2b"
DEFAULT_TOKENIZER_GGUF = HOME / ".cache" / "helios" / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_LLAMA_SRC = HOME / ".cache" / "helios-peers" / "llama-src" / "vendor" / "llama.cpp"
DEFAULT_LLAMA_BUILD = HOME / ".cache" / "helios-peers" / "llama-build"
NAME = "synthetic-qwen3moe-1b-a0.2b"

# Qwen2's pre-tokenizer split (the same pattern as helios/loaders/tokenizer.py's "qwen2").
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_NORMAL, GGUF_CONTROL, GGUF_USER_DEFINED = 1, 3, 4


# -- 1. the config and its parameter counts -------------------------------------------------------

def model_config(args: argparse.Namespace, vocab_size: int, bos_id: int, eos_id: int) -> Any:
    from transformers import Qwen3MoeConfig

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,  # a dense MLP's width; unused, every layer is sparse
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=args.std,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        architectures=["Qwen3MoeForCausalLM"],
    )
    return Qwen3MoeConfig(**fields)


def parameter_counts(c: Any) -> dict[str, int]:
    """From the config alone: what the model holds and what one token's forward pass uses."""
    hidden, heads, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attention = hidden * heads * hd * 2 + hidden * kv * hd * 2 + 2 * hd  # q, o; k, v; q/k norms
    expert = 3 * hidden * c.moe_intermediate_size  # gate, up, down
    experts = c.num_experts
    router = experts * hidden
    norms = 2 * hidden
    embedding = c.vocab_size * hidden
    head = 0 if c.tie_word_embeddings else embedding
    layer_shared = attention + router + norms
    total = embedding + head + hidden + c.num_hidden_layers * (layer_shared + experts * expert)
    active_body = c.num_hidden_layers * (layer_shared + c.num_experts_per_tok * expert) + hidden
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding - head,
        "experts": c.num_hidden_layers * experts * expert,
        "active_non_embedding": active_body,
        "active_with_head": active_body + embedding,  # the (tied) output head is a full matmul per token
    }


def print_counts(counts: Mapping[str, int]) -> None:
    print("parameters:")
    for key, value in counts.items():
        print(f"  {key:22s} {value:>14,d}  ({value / 1e9:.3f}B)")


# -- 2. random weights -----------------------------------------------------------------------------

def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def tensor_std(name: str, args: argparse.Namespace) -> float:
    if name.endswith("self_attn.o_proj.weight"):
        return float(args.attn_out_std)
    if "experts" in name and "down_proj" in name:
        return float(args.expert_down_std)
    return float(args.std)


def build_hf_model(config: Any, args: argparse.Namespace, out: Path) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device="cpu")  # allocates every parameter anew: tie the head to the embedding again
    model.tie_weights()
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise SystemExit("the output head is not tied to the embedding")
    generator = torch.Generator()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            generator.manual_seed(tensor_seed(args.seed, name))
            values = torch.empty(param.shape, dtype=torch.float32)
            values.normal_(0.0, tensor_std(name, args), generator=generator)
            param.copy_(values)
            del values
    numel = sum(p.numel() for p in model.parameters())  # tied: the embedding is counted once
    expected = parameter_counts(config)["total"]
    if numel != expected:
        raise SystemExit(f"the model has {numel:,} parameters, the count from its config says {expected:,}")
    model.save_pretrained(out, safe_serialization=True)


# -- 3. the tokenizer --------------------------------------------------------------------------------

def save_tokenizer(gguf_path: Path, out: Path) -> dict[str, Any]:
    """A Hugging Face tokenizer folder from a Qwen2 GGUF's tokenizer metadata; returns the ids."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    from helios.loaders.gguf_reader import read_gguf

    meta = read_gguf(gguf_path).metadata
    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "qwen2":
        raise SystemExit(f"{gguf_path}: not a Qwen2 byte-level BPE tokenizer")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta["tokenizer.ggml.token_type"])
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)) if kind == GGUF_NORMAL}
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise SystemExit("the GGUF's normal tokens are not the ids 0..n-1")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    added: dict[str, dict[str, Any]] = {}
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (GGUF_CONTROL, GGUF_USER_DEFINED):
            continue  # the [PADn] fillers up to the embedding's rows stay out of the vocabulary
        special = kind == GGUF_CONTROL
        token = AddedToken(text, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(text) != i:
            raise SystemExit(f"added token {text!r} got id {tok.token_to_id(text)}, not {i}")
        added[str(i)] = {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": special}
    tok.save(str(out / "tokenizer.json"))

    bos_id = int(meta["tokenizer.ggml.bos_token_id"])
    eos_id = int(meta["tokenizer.ggml.eos_token_id"])
    pad_id = int(meta.get("tokenizer.ggml.padding_token_id", bos_id))
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "bos_token": None,  # Qwen2 prepends nothing
        "eos_token": tokens[eos_id],
        "pad_token": tokens[pad_id],
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 32768,
        "added_tokens_decoder": added,
        "chat_template": meta["tokenizer.chat_template"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "pad_token_id": pad_id,
                  "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return {"vocab_size": len(tokens), "bos": bos_id, "eos": eos_id}


# -- 4. llama.cpp's converter and quantizer ---------------------------------------------------------------

def run(cmd: list[str], log: Path, env: Mapping[str, str] | None = None) -> float:
    print("+ " + " ".join(cmd), flush=True)
    start = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=None if env is None else dict(env))
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"exit status {proc.returncode}; the end of {log}:\n" + "\n".join(tail))
    return time.monotonic() - start


def ensure_quantize(build: Path, threads: int) -> Path:
    binary = build / "bin" / "llama-quantize"
    if not binary.exists():
        if not (build / "CMakeCache.txt").exists():
            raise SystemExit(f"no llama.cpp build at {build}: run shared/bench/peers/llama_server.sh setup")
        run(["cmake", "--build", str(build), "--target", "llama-quantize", "-j", str(threads)],
            build / "llama-quantize-build.log")
    return binary


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def llama_version(build: Path) -> str:
    try:
        proc = subprocess.run([str(build / "bin" / "llama-server"), "--version"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return "; ".join(line for line in lines if line.startswith(("version", "built")))


# -- 5. the commands --------------------------------------------------------------------------------

def commands(gguf: Path, build: Path) -> dict[str, str]:
    return {
        "llama_server": f"{build}/bin/llama-server -m {gguf} -a synthetic-moe --host 127.0.0.1 --port 8083 "
                        "-c 32768 -np 32 -t 2 -tb 2 --kv-unified",
        "helios": f"helios serve {gguf} --port 8011 --no-access-log",
        "bench_decode": "helios bench --url http://127.0.0.1:8011 --baseline-url http://127.0.0.1:8083 "
                        "--streams 1,8,32 --max-tokens 128",
        "bench_ttfb": "helios bench --url http://127.0.0.1:8011 --baseline-url http://127.0.0.1:8083 "
                      "--workload ttfb",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="std of the normal matrices")
    parser.add_argument("--attn-out-std", type=float, default=0.005, help="std of attention's o_proj")
    parser.add_argument("--expert-down-std", type=float, default=0.08, help="std of the experts' down_proj")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--tokenizer-gguf", type=Path, default=DEFAULT_TOKENIZER_GGUF,
                        help="a Qwen2/2.5 GGUF whose tokenizer the model gets")
    parser.add_argument("--llama-src", type=Path, default=DEFAULT_LLAMA_SRC)
    parser.add_argument("--llama-build", type=Path, default=DEFAULT_LLAMA_BUILD)
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--keep-bf16", action="store_true", help="keep the BF16 GGUF (2.1 GB)")
    parser.add_argument("--counts-only", action="store_true", help="print the parameter counts and stop")
    parser.add_argument("--force", action="store_true", help="redo every step")
    args = parser.parse_args(argv)

    out: Path = args.out.expanduser()
    hf_dir = out / "hf"
    bf16_gguf = out / f"{NAME}-BF16.gguf"
    quant_gguf = out / f"{NAME}-{args.quant}.gguf"
    if args.force and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    from helios.loaders.gguf_reader import read_gguf

    tok_meta = read_gguf(args.tokenizer_gguf).metadata
    config = model_config(args, len(tok_meta["tokenizer.ggml.tokens"]),
                          int(tok_meta["tokenizer.ggml.bos_token_id"]), int(tok_meta["tokenizer.ggml.eos_token_id"]))
    counts = parameter_counts(config)
    print_counts(counts)
    if args.counts_only:
        return

    if not (hf_dir / "model.safetensors").exists() and not (hf_dir / "model.safetensors.index.json").exists():
        hf_dir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        build_hf_model(config, args, hf_dir)
        save_tokenizer(args.tokenizer_gguf, hf_dir)
        timings["hf_folder_s"] = round(time.monotonic() - start, 1)
        print(f"HF folder: {hf_dir} ({timings['hf_folder_s']} s)", flush=True)

    if not quant_gguf.exists():
        if not bf16_gguf.exists():
            env = dict(os.environ)
            env.pop("NO_LOCAL_GGUF", None)  # the converter then uses its own gguf-py, not the venv's
            timings["convert_s"] = round(run(
                [sys.executable, str(args.llama_src / "convert_hf_to_gguf.py"), str(hf_dir),
                 "--outtype", "bf16", "--outfile", str(bf16_gguf), "--model-name", NAME], out / "convert.log", env), 1)
        quantize = ensure_quantize(args.llama_build, args.threads)
        timings["quantize_s"] = round(run(
            [str(quantize), str(bf16_gguf), str(quant_gguf), args.quant, str(args.threads)],
            out / "quantize.log"), 1)

    cmds = commands(quant_gguf, args.llama_build)
    manifest_path = out / "manifest.json"
    previous = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    files: dict[str, dict[str, Any]] = dict(previous.get("files", {}))  # the BF16 file's entry outlives it
    for path in (hf_dir / "model.safetensors", bf16_gguf, quant_gguf):
        if path.exists():
            files[path.name] = {"path": str(path), "bytes": path.stat().st_size, "sha256": sha256(path),
                                "kept": path != bf16_gguf or args.keep_bf16}
    manifest = {
        "name": NAME,
        "seed": args.seed,
        "std": {"matrices": args.std, "attn_o_proj": args.attn_out_std, "experts_down_proj": args.expert_down_std,
                "norms": 1.0},
        "config": json.loads(config.to_json_string()),
        "parameters": counts,
        "timings": {**previous.get("timings", {}), **timings},
        "files": files,
        "llama_cpp": llama_version(args.llama_build),
        "tokenizer_from": str(args.tokenizer_gguf),
        "commands": cmds,
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    if bf16_gguf.exists() and not args.keep_bf16:
        bf16_gguf.unlink()

    print(f"\nmanifest: {manifest_path}")
    for name, info in files.items():
        print(f"{name}: {info['bytes']:,} bytes ({info['bytes'] / 2**20:.1f} MiB), sha256 {info['sha256']}")
    print("timings (s): " + ", ".join(f"{k} {v}" for k, v in manifest["timings"].items()))
    print("\n# serve the same file with both servers (2 threads each, as in docs/benchmarks.md):")
    print(cmds["llama_server"])
    print(cmds["helios"])
    print("# then, side by side:")
    print(cmds["bench_decode"])
    print(cmds["bench_ttfb"])


if __name__ == "__main__":
    main()
