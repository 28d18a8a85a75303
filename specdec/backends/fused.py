"""specdec's fused CPU runtime: a llama-family pass in one call into ``fused.c`` (built at install as ``_fused``).

:class:`FusedRuntime` is the lean runtime (``llama.py``: its cache, rollback, trees, shallow passes, hidden states)
with every layer, and the LM head, computed by the C pass: float16 weights read once per pass whatever the row
count, one persistent thread team, norms, RoPE and attention fused around the products, and each row computed as it
is alone (batch-invariant by construction, see ``fused.c``). The server's pool (``batch.py``) runs its rows
through the same call.

Where it cannot run (not built, a CPU without AVX2/FMA/F16C, a model it does not cover), :func:`unavailable` says
why in one line, and ``--backend auto`` passes it by.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import numpy as np
import torch

from specdec.backends.base import FeatureSource, ShallowRunner, TreeScorer  # noqa: F401  (the protocols it keeps)
from specdec.backends.linear import PassPrecisions
from specdec.backends.llama import LlamaRuntime, _tree_reading, supports

MAX_HEAD_DIM = 128  # fused.c's attention keeps one head's output in 16 registers of 8
NEEDED_FLAGS = ("avx2", "fma", "f16c")
PRECISION = "float16"  # the weights' precision; activations, norms, attention and the cache are float32


class FusedUnavailable(RuntimeError):
    """The fused runtime cannot run here, or not this model; the message says why in one line."""


_p = ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", _p), ("qkv_bias", _p), ("out", _p),
                ("gate_up", _p), ("down", _p)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int), ("hidden", ctypes.c_int), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("inter", ctypes.c_int),
                ("vocab", ctypes.c_int), ("eps", ctypes.c_float), ("layer", ctypes.POINTER(_Layer)),
                ("final_norm", _p), ("lm_head", _p)]


class _Cache(ctypes.Structure):
    _fields_ = [("keys", ctypes.POINTER(_p)), ("values", ctypes.POINTER(_p)), ("head_stride", ctypes.c_int64),
                ("cos", _p), ("sin", _p)]


class _Rows(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("rope", _p), ("base", _p), ("column", _p), ("n_keys", _p),
                ("key_cols", _p), ("key_stride", ctypes.c_int)]


def cpu_lacks() -> list[str]:
    """The instructions fused.c needs that this CPU does not report (Linux's /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        flags = []
    return [flag for flag in NEEDED_FLAGS if flag not in flags]


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The built library, or why it cannot be used (a line)."""
    lacking = cpu_lacks()
    if lacking:
        return f"this CPU lacks {', '.join(lacking)}"
    spec = importlib.util.find_spec("specdec.backends._fused")
    if spec is None or not spec.origin:
        return "its C extension was not built at install (reinstall with a C compiler: pip install -e . prints why)"
    try:
        library = ctypes.CDLL(spec.origin)
    except OSError as error:
        return f"its C extension does not load ({error})"
    library.sd_pass.restype = ctypes.c_int
    library.sd_pass.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Cache), ctypes.POINTER(_Rows), _p,
                                ctypes.c_int, ctypes.c_int]
    library.sd_head.restype = None
    library.sd_head.argtypes = [ctypes.POINTER(_Model), _p, ctypes.c_int, _p]
    library.sd_set_threads.restype = ctypes.c_int
    library.sd_set_threads.argtypes = [ctypes.c_int]
    return library


def unavailable(model=None) -> str | None:
    """Why the fused runtime cannot run ``model`` (or anything, for None) here; None where it can."""
    library = _library()
    if isinstance(library, str):
        return library
    if model is None:
        return None
    if next(model.parameters()).device.type != "cpu":
        return "it runs on the CPU only"
    if not supports(model):
        return f"it runs llama, mistral and qwen2 models with default RoPE, not {model.config.model_type}"
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = (config.hidden_size, head_dim, config.intermediate_size)
    if any(size % 8 for size in sizes) or head_dim > MAX_HEAD_DIM:
        return f"its sizes (hidden, head, intermediate: {sizes}) are not multiples of 8 up to a head of {MAX_HEAD_DIM}"
    layer = model.model.layers[0]
    if any(m.bias is not None for m in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                        layer.mlp.down_proj, model.get_output_embeddings())):
        return "its output, feed-forward or LM head projections have biases"
    return None


def repacked(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [ceil(out / 8) * 8 * in] float16
    """``weight`` as fused.c reads it: blocks of 8 output rows (the last padded with zero rows), each block one
    chunk of 8 inputs after another, a chunk the 8 rows' 8 values: one sequential stream per block."""
    out, inputs = weight.shape
    padded = torch.zeros(-(-out // 8) * 8, inputs, dtype=torch.float16)
    padded[:out] = weight
    return padded.view(-1, 8, inputs // 8, 8).transpose(1, 2).contiguous().flatten()


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class _PassCache:
    """What fused.c reads of a cache: per-layer key and value bases, the stride between kv heads, RoPE tables. Holds
    the tensors it points into."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], head_stride: int, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        self.tensors = (keys, values, cos, sin)
        pointers = _p * len(keys)
        self._keys, self._values = pointers(*[_address(k) for k in keys]), pointers(*[_address(v) for v in values])
        self.struct = _Cache(self._keys, self._values, head_stride, _address(cos), _address(sin))


class FusedRuntime(LlamaRuntime):
    """The CausalLM protocol for llama-family models, every pass one call into fused.c (float16 weights)."""

    fused = True  # the server's pool (batch.py) runs its passes through run_rows

    def __init__(self, model) -> None:
        reason = unavailable(model)
        if reason is not None:
            raise FusedUnavailable(f"the fused runtime cannot run this model: {reason}")
        self._library = _library()
        self.threads = self._library.sd_set_threads(torch.get_num_threads())
        super().__init__(model, PassPrecisions.uniform(PRECISION))
        self._pass_cache: _PassCache | None = None

    def _build_weights(self, model, precisions: PassPrecisions) -> dict:
        """The C model over float16 copies of the weights (kept here, as fused.c points into them)."""
        config = model.config
        keep = self._kept = []

        def held(tensor: torch.Tensor | None, dtype: torch.dtype) -> int | None:
            if tensor is None:
                return None
            tensor = tensor.detach().to(dtype).contiguous()
            keep.append(tensor)
            return tensor.data_ptr()

        def weight(tensor: torch.Tensor) -> int:
            return held(repacked(tensor.detach()), torch.float16)

        layers = (_Layer * len(model.model.layers))()
        for struct, layer in zip(layers, model.model.layers):
            attention, mlp = layer.self_attn, layer.mlp
            projections = (attention.q_proj, attention.k_proj, attention.v_proj)
            bias = None if all(p.bias is None for p in projections) else torch.cat(
                [p.bias if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in projections])
            struct.input_norm = held(layer.input_layernorm.weight, torch.float32)
            struct.post_norm = held(layer.post_attention_layernorm.weight, torch.float32)
            struct.qkv = weight(torch.cat([p.weight for p in projections]))
            struct.qkv_bias = held(bias, torch.float32)
            struct.out = weight(attention.o_proj.weight)
            struct.gate_up = weight(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            struct.down = weight(mlp.down_proj.weight)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._layer_structs = layers
        self._model = _Model(len(layers), config.hidden_size, config.num_attention_heads,
                             config.num_key_value_heads, head_dim, config.intermediate_size,
                             model.get_output_embeddings().weight.shape[0], config.rms_norm_eps, layers,
                             held(model.model.norm.weight, torch.float32),
                             weight(model.get_output_embeddings().weight))
        stub = [None] * len(layers)  # weights_for's layers: only their count is read (num_layers)
        return {PRECISION: (stub, self._lm_head)}

    def _resize(self, capacity: int) -> None:
        super()._resize(capacity)
        self._pass_cache = None  # the cache's tensors moved

    def _cache(self) -> _PassCache:
        if self._pass_cache is None:
            self._pass_cache = _PassCache(self._keys, self._values, self._capacity * self.head_dim, self._cos,
                                          self._sin)
        return self._pass_cache

    def _layers(self, x: torch.Tensor, first: int, end: int, start: int, positions: slice | torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        n = x.shape[0]
        columns = np.arange(start, start + n, dtype=np.int32)
        if isinstance(positions, torch.Tensor):  # a tree: each node reads the cache, then its ancestors
            reading, allowed = _tree_reading(mask, start, self.device)
            rope = positions.numpy().astype(np.int32)
            n_keys = allowed.sum(-1).flatten().numpy().astype(np.int32)
            key_cols = np.ascontiguousarray(reading.numpy().astype(np.int32))
        else:
            rope, n_keys, key_cols = columns, columns + 1, None
        return self.run_rows(x, first, end, self._cache(), rope, np.zeros(n, dtype=np.int64), columns, n_keys,
                             key_cols)

    def run_rows(self, x: torch.Tensor, first: int, end: int, cache: _PassCache, rope: np.ndarray,
                 base: np.ndarray, columns: np.ndarray, n_keys: np.ndarray, key_cols: np.ndarray | None = None,
                 ) -> torch.Tensor:  # [n, hidden]
        """Rows x [n, hidden] through layers first..end-1 in one C pass; the residual stream after them (a new
        tensor). Row i sits at RoPE position ``rope[i]``; its key and value are written at cache column
        ``columns[i]`` of the sequence that starts ``base[i]`` floats from each layer cache's base; it attends the
        first ``n_keys[i]`` columns there, or those ``key_cols[i]`` lists, in that order."""
        x = x.to(torch.float32).contiguous().clone()
        arrays = [np.ascontiguousarray(a) for a in (rope.astype(np.int32), base.astype(np.int64),
                                                    columns.astype(np.int32), n_keys.astype(np.int32))]
        stride = 0 if key_cols is None else key_cols.shape[1]
        rows = _Rows(x.shape[0], *(a.ctypes.data for a in arrays),
                     None if key_cols is None else key_cols.ctypes.data, stride)
        if self._library.sd_pass(ctypes.byref(self._model), ctypes.byref(cache.struct), ctypes.byref(rows),
                                 x.data_ptr(), first, end) != 0:
            raise MemoryError("the fused pass could not allocate its scratch")
        return x

    def _lm_head(self, normed: torch.Tensor) -> torch.Tensor:  # [m, hidden] -> [m, vocab]
        normed = normed.to(torch.float32).contiguous()
        logits = torch.empty(normed.shape[0], self.vocab_size)
        if len(normed):
            self._library.sd_head(ctypes.byref(self._model), normed.data_ptr(), normed.shape[0], logits.data_ptr())
        return logits
