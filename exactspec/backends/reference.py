"""The reference the numerics tests and ``python -m exactspec.bench.numerics`` hold exactspec's runtimes against:
transformers' float32 module of a GGUF's architecture, its weights as gguf-py de-quantises them
(:func:`reference_module`).

Written apart from exactspec's reader (``gguf_file.py``), its family code (``family.py``) and its kernels, and importing
nothing of exactspec: a misreading there shows as a difference here. It lies in ``backends/`` so that both the library's
``bench/`` and the tests may import it.

To cover another architecture: its module's classes in MODULES; any tensor its module names otherwise in
ARCH_LAYER_NAMES; the config fields that differ from llama's in :func:`_architecture_config`; and where llama.cpp's
converter changed the weights (q and k rows interleaved, norms shifted by 1), that undone in :func:`_module_values`.
"""

from __future__ import annotations

import numpy as np
import torch

LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj"}
# where an architecture's module names a tensor otherwise: phi3's fused gate and up; gemma's four norms a layer
ARCH_LAYER_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"},
                    "gemma": {"post_attention_norm": "post_attention_layernorm",
                              "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# each architecture's transformers config and module classes
MODULES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
           "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
           "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM")}
# whose q and k rows llama.cpp's converter interleaves for its rotary layout (adjacent pairs, not halves)
INTERLEAVED_QK = ("llama", "smollm3")


def reference_module(path):
    """transformers' float32 module of a GGUF's model (each architecture exactspec reads from a GGUF), its weights as
    gguf-py de-quantises them: llama's (and smollm3's) q and k rows put back in the module's order (undoing llama.cpp's
    converter), gemma's norms less the 1 its converter adds, Llama 3's RoPE frequencies (rope_freqs) divided into the
    module's."""
    import gguf
    import transformers

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    fields = {key[len(arch) + 1 :]: field.contents() for key, field in reader.fields.items()
              if key.startswith(f"{arch}.")}
    names = {t.name for t in reader.tensors}
    # the file's special tokens: a module's defaults may lie past a small vocabulary (smollm3's are Llama 3's)
    special = {f"{name}_token_id": reader.fields[f"tokenizer.ggml.{key}_token_id"].contents()
               for name, key in (("pad", "padding"), ("bos", "bos"), ("eos", "eos"))
               if f"tokenizer.ggml.{key}_token_id" in reader.fields}
    config_name, model_name = MODULES[arch]
    heads = fields["attention.head_count"]
    config = getattr(transformers, config_name)(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=fields["embedding_length"],
        intermediate_size=fields["feed_forward_length"], num_hidden_layers=fields["block_count"],
        num_attention_heads=heads, num_key_value_heads=fields.get("attention.head_count_kv", heads),
        rms_norm_eps=fields["attention.layer_norm_rms_epsilon"], max_position_embeddings=fields["context_length"],
        tie_word_embeddings="output.weight" not in names, dtype=torch.float32, **special,
        **_architecture_config(arch, fields))
    layer_names = LAYER_NAMES | ARCH_LAYER_NAMES.get("gemma" if arch.startswith("gemma") else arch, {})
    state = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "rope_freqs":
            continue
        name = (f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}" if parts[0] == "blk"
                else f"{TOP_NAMES[parts[0]]}.{parts[1]}")
        state[name] = torch.from_numpy(_module_values(gguf, tensor, arch, config))
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


def _architecture_config(arch: str, fields: dict) -> dict:
    """The config arguments of ``arch``'s module beyond llama's, from the file's ``arch.*`` fields (keys without the
    prefix): a head's width, gemma's scale, window and caps, gemma 3's two RoPE bases, phi3's window. smollm3's NoPE
    layers are its config's default (every 4th), as llama.cpp's are."""
    head_dim = fields.get("attention.key_length", fields["embedding_length"] // fields["attention.head_count"])
    rope_theta = {"rope_theta": float(fields.get("rope.freq_base", 10000.0))}
    if arch.startswith("gemma"):
        extra = dict(head_dim=head_dim, query_pre_attn_scalar=head_dim,
                     sliding_window=fields.get("attention.sliding_window"),
                     attn_logit_softcapping=fields.get("attn_logit_softcapping"),
                     final_logit_softcapping=fields.get("final_logit_softcapping"))
        if arch == "gemma3":
            return extra | {"rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": rope_theta["rope_theta"]}}}
        return extra | rope_theta
    if arch == "qwen3":
        return rope_theta | {"head_dim": head_dim}
    if arch == "phi3":
        return rope_theta | {"sliding_window": fields.get("attention.sliding_window")}
    return rope_theta


def _module_values(gguf, tensor, arch: str, config) -> np.ndarray:  # float32, the module's shape
    """A GGUF tensor de-quantised by gguf-py, as the module holds it: q and k rows de-interleaved where llama.cpp's
    converter interleaved them (INTERLEAVED_QK), gemma's norms less the 1 its converter adds."""
    part = tensor.name.split(".")[-2]
    shape = tuple(int(d) for d in tensor.shape[::-1])
    values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape), dtype=np.float32)
    if arch in INTERLEAVED_QK and part in ("attn_q", "attn_k"):  # llama.cpp's interleaved halves, undone
        n = config.num_attention_heads if part == "attn_q" else config.num_key_value_heads
        values = values.reshape(n, values.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
    if arch.startswith("gemma") and part.endswith("norm"):  # the module multiplies by 1 + w
        values = values - 1.0
    return values
