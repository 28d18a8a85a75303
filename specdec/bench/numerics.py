"""How near each runtime's logits are to a float32 reference on the same GGUF file, side by side: specdec's fused
runtime over the file's blocks as stored (with integer products, each row's inputs quantised to bytes per block of
32, and with float products), and llama.cpp's on the same file.

    python -m specdec.bench.numerics --model FILE.gguf [--prompts FILE.jsonl] [--limit 4] [--max-new-tokens 64]

The reference is transformers' float32 module of the file's architecture, its weights as gguf-py de-quantises them
(:func:`reference_module`): written apart from specdec's reader and kernels. For each prompt the reference's greedy
answer is generated; then every runtime scores prompt and answer in one teacher-forced pass, and the table gives the
largest and the mean absolute logit difference from the reference over the answer's positions, and the share of those
positions whose argmax is the reference's. Each runtime's own greedy answer is then compared with the reference's:
the tokens before they first part.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from specdec.bench.prompts import prompt_script_parser, read_prompts

LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj"}
# where an architecture's module names a tensor otherwise: phi3's fused gate and up; gemma's four norms a layer
ARCH_LAYER_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"},
                    "gemma": {"post_attention_norm": "post_attention_layernorm",
                              "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
MODULES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
           "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def reference_module(path):
    """transformers' float32 module of a GGUF's model (each architecture specdec reads from a GGUF), its weights as
    gguf-py de-quantises them: llama's q and k rows put back in the module's order (undoing llama.cpp's converter),
    gemma's norms less the 1 its converter adds, Llama 3's RoPE frequencies (rope_freqs) divided into the module's."""
    import gguf
    import transformers

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    fields = {key: field.contents() for key, field in reader.fields.items() if key.startswith(f"{arch}.")}
    field = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    heads, kv_heads = field("attention.head_count"), field("attention.head_count_kv")
    head_dim = field("attention.key_length", field("embedding_length") // heads)
    names = {t.name for t in reader.tensors}
    config_name, model_name = MODULES[arch]
    extra = {}
    if arch.startswith("gemma"):
        window = field("attention.sliding_window")
        extra = dict(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window,
                     attn_logit_softcapping=field("attn_logit_softcapping"),
                     final_logit_softcapping=field("final_logit_softcapping"))
        if arch == "gemma3":
            extra["rope_parameters"] = {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": float(field("rope.freq_base"))}}
    elif arch == "qwen3":
        extra = dict(head_dim=head_dim)
    elif arch == "phi3":
        extra = dict(sliding_window=field("attention.sliding_window"))
    config = getattr(transformers, config_name)(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=field("embedding_length"),
        intermediate_size=field("feed_forward_length"), num_hidden_layers=field("block_count"),
        num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=field("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=field("context_length"), tie_word_embeddings="output.weight" not in names,
        dtype=torch.float32, **({"rope_theta": float(field("rope.freq_base", 10000.0))} if arch != "gemma3" else {}),
        **extra)
    layer_names = LAYER_NAMES | ARCH_LAYER_NAMES.get("gemma" if arch.startswith("gemma") else arch, {})
    state = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        shape = tuple(int(d) for d in tensor.shape[::-1])
        values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape), dtype=np.float32)
        if parts[0] == "rope_freqs":
            continue
        if arch == "llama" and parts[-2] in ("attn_q", "attn_k"):  # llama.cpp's interleaved halves, undone
            n = heads if parts[-2] == "attn_q" else kv_heads
            values = values.reshape(n, values.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
        if arch.startswith("gemma") and parts[-2].endswith("norm"):  # the module multiplies by 1 + w
            values = values - 1.0
        name = (f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}" if parts[0] == "blk"
                else f"{TOP_NAMES[parts[0]]}.{parts[1]}")
        state[name] = torch.from_numpy(values)
    model = getattr(transformers, model_name)(config).float().eval()
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, f"the module's {missing} were not in the file"
    if config.tie_word_embeddings:
        model.tie_weights()
    if "rope_freqs.weight" in names:  # Llama 3's frequencies, each divided by its factor
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rotary = model.model.rotary_emb
        rotary.inv_freq = rotary.inv_freq / torch.from_numpy(np.array(factors.data, dtype=np.float32))
        rotary.original_inv_freq = rotary.inv_freq
    return model


def runtime_greedy(runtime, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt`` from a runtime, one cached pass a token."""
    runtime.rollback(0)
    logits = runtime.extend(prompt, 1)
    answer = []
    for _ in range(steps):
        answer.append(int(torch.as_tensor(np.asarray(logits))[-1].argmax()))
        logits = runtime.extend(answer[-1:], 1)
    return answer


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def parted_at(answer: list[int], reference: list[int]) -> int:
    """How many tokens ``answer`` shares with ``reference`` before they first part."""
    return next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), min(len(answer), len(reference)))


def main(argv: list[str] | None = None) -> int:
    parser = prompt_script_parser(__doc__.splitlines()[0], limit=4)
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model FILE.gguf is needed (a llama or qwen2 GGUF)")
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.backends.fused import PRODUCTS, FusedRuntime
    from specdec.loading import encode_prompt
    from specdec.models import load_gguf, model_path

    path = model_path(args.model)
    target = load_gguf(path, torch.get_num_threads())
    runtimes = {**{f"fused ({products} products)": FusedRuntime.from_gguf(path, products) for products in PRODUCTS},
                "llama.cpp": target.runtime}
    reference = reference_module(path)

    def score(runtime, ids: list[int]) -> torch.Tensor:
        runtime.rollback(0)
        return torch.as_tensor(np.asarray(runtime.extend(ids, len(ids)))).float()

    rows = {name: {"max": [], "mean": [], "argmax": [], "parted": []} for name in runtimes}
    for prompt in read_prompts(args.prompts, limit=args.limit):
        ids = encode_prompt(target.tokenizer, prompt.text, prompt.chat)
        answer = reference_greedy(reference, ids, args.max_new_tokens)
        with torch.no_grad():
            expected = reference(torch.tensor([ids + answer])).logits[0, len(ids) - 1 : -1].float()
        for name, runtime in runtimes.items():
            got = score(runtime, ids + answer)[len(ids) - 1 : -1]
            difference = (got - expected).abs()
            rows[name]["max"].append(difference.max().item())
            rows[name]["mean"].append(difference.mean().item())
            rows[name]["argmax"].append((got.argmax(-1) == expected.argmax(-1)).float().mean().item())
            rows[name]["parted"].append(parted_at(runtime_greedy(runtime, ids, args.max_new_tokens), answer))
    print(f"{path.name}: {len(rows[next(iter(rows))]['max'])} prompts, {args.max_new_tokens} greedy tokens each, "
          "against transformers' float32 module of the file's weights\n")
    print("| runtime | largest logit difference | mean | argmax agreement | greedy tokens before parting (median) |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {max(row['max']):.2e} | {statistics.mean(row['mean']):.2e} | "
              f"{statistics.mean(row['argmax']):.1%} | {statistics.median(row['parted']):.0f} of "
              f"{args.max_new_tokens} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
