"""exactspec's C kernels (``fused/fused.h`` and its .c files, built as ``exactspec.backends._fused``), as each
CPU runtime uses them.

Two runtimes compute with them: the fused runtime (``fused/``, beside the C files) runs whole passes in one call,
and the lean runtime (``lean/``) runs its products (:class:`RowProduct`) and its attention (:func:`attention`) through
them on the CPU. Each computes every row as it is alone, in an order that depends on that row only: a row's bits are
the same whatever shares its pass, on any x86 CPU with AVX2, whichever kernels the libraries would have dispatched to
(a BLAS's batched products give a row other bits among other rows on some CPUs: docs/exactness.md).

Where the kernels cannot run (not built, a CPU without AVX2/FMA/F16C), :func:`unavailable` says why in one line.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from typing import NamedTuple

import numpy as np
import torch

from exactspec.cores import usable_cores
from exactspec.logs import detail

NEEDED_FLAGS = ("avx2", "fma", "f16c")


class Format(NamedTuple):
    """One of the C kernels' weight formats (fused.h's FORMATS), as exactspec declares it and the library reports it."""

    name: str  # the C enum's
    weights: str  # exactspec's name for the weights it holds
    integer: bool  # multiplied in integers, each row's inputs quantised to bytes per block of 32
    value_bytes: int  # a value's (a float format's), else 0
    block_bytes: int  # a block's of 8 rows x 32 inputs (a blocked format's), else 0
    super_bytes: int  # a super-block's of 8 rows x 256 inputs (a K format's, its blocks inside), else 0
    head_bytes: int = 0  # the head before 8 rows' blocks (a row-scaled format's: the rows' floats), else 0


# The weight formats in fused.h's order: a format's number (Matrix.format) is its place. The library's own table
# (sd_formats) is checked against this one value by value at load (_differing_formats).
FORMATS = (
    # floats, or bytes with a float scale and offset per 32 inputs (int8) or per 16 (int8_group16), multiplied in
    # floats: block_q8x8, block_q8x16
    Format("F16", "float16", False, 2, 0, 0),
    Format("Q8", "int8", False, 0, 320, 0),
    Format("F32", "float32", False, 4, 0, 0),
    Format("BF16", "bfloat16", False, 2, 0, 0),
    Format("Q8H", "int8_group16", False, 0, 384, 0),
    # integer products, times each row's inputs quantised to bytes per block of 32: the byte formats' same bytes;
    # in integer products only, int4 and int5: 4 and 5 bits with a float16 scale and offset per 32 (Q4_0's, Q4_1's,
    # Q5_0's, Q5_1's: block_q4x8, block_q5x8); the K-quants' own integer scales under a float per 256 inputs:
    # int6_k, 6 bits with a scale per 16 and the offset -32 times it (Q6_K's: super_q6x8), and int4_k and int5_k, 4
    # and 5 bits with a scale and a min per 32 (Q4_K's, Q5_K's: super_q4k8, super_q5k8); int3_r, 3 bits with an
    # integer scale and min per 32 under each row's floats (no GGUF type's: a draft-grade copy's; rows_q3r8)
    Format("Q8I", "int8", True, 0, 320, 0),
    Format("Q8HI", "int8_group16", True, 0, 384, 0),
    Format("Q4I", "int4", True, 0, 160, 0),
    Format("Q6I", "int6_k", True, 0, 192, 1696),
    Format("Q4KI", "int4_k", True, 0, 128, 1216),
    Format("Q5I", "int5", True, 0, 192, 0),
    Format("Q5KI", "int5_k", True, 0, 160, 1472),
    Format("Q3RI", "int3_r", True, 0, 112, 0, 64),
)
# the formats' numbers by the weights' name: multiplied in floats, and in integers
FORMAT = {f.weights: number for number, f in enumerate(FORMATS) if not f.integer}
INTEGER_FORMAT = {f.weights: number for number, f in enumerate(FORMATS) if f.integer}
FLOAT_FORMATS = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
TILE_OUTPUTS = 8  # weight rows per repacked block
CHUNK_INPUTS = 8  # inputs per chunk of a block: a float product's inputs come in whole chunks
MAX_HEAD_DIM = 256  # attend keeps one head's output in 32 registers of 8
SILU, GELU_TANH = 0, 1  # fused.h's activations of the feed-forward block's gate
ROPE_MAIN, ROPE_LOCAL, ROPE_NONE = 0, 1, 2  # fused.h's: the RoPE tables a layer's q and k turn by, or none

_p = ctypes.c_void_p


# fused.h's structures, as ctypes declares them; their sizes are checked against the library's at load
class Matrix(ctypes.Structure):
    """A weight matrix [outputs, inputs] as the tiles read it, in one of FORMAT's formats, with its bias or None;
    ``rest``: the address of the Matrix of the rows after these, stored in another format, or None."""

    _fields_ = [("format", ctypes.c_int), ("inputs", ctypes.c_int), ("outputs", ctypes.c_int), ("weight", _p),
                ("bias", _p), ("rest", _p)]

    @property
    def rows(self) -> int:
        """The outputs of this part and the parts after it."""
        return self.outputs + (Matrix.from_address(self.rest).rows if self.rest else 0)


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p), ("attn_out_norm", _p),
                ("ffn_out_norm", _p), ("window", ctypes.c_int), ("rope", ctypes.c_int), ("qkv", Matrix),
                ("out", Matrix), ("gate_up", Matrix),
                ("down", Matrix)]


class Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int), ("hidden", ctypes.c_int), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("inter", ctypes.c_int),
                ("vocab", ctypes.c_int), ("eps", ctypes.c_float), ("activation", ctypes.c_int),
                ("attn_scale", ctypes.c_float), ("attn_softcap", ctypes.c_float), ("layer", ctypes.POINTER(Layer)),
                ("final_norm", _p), ("lm_head", Matrix)]


class Cache(ctypes.Structure):
    _fields_ = [("keys", ctypes.POINTER(_p)), ("values", ctypes.POINTER(_p)), ("head_stride", ctypes.c_int64),
                ("cos", _p), ("sin", _p), ("local_cos", _p), ("local_sin", _p)]


class _Rows(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("rope", _p), ("base", _p), ("column", _p), ("n_keys", _p),
                ("key_cols", _p), ("key_stride", ctypes.c_int)]


class _FormatRow(ctypes.Structure):
    """A row of the library's format table (formats.c's FormatRow)."""

    _fields_ = [("name", ctypes.c_char_p), ("weights", ctypes.c_char_p), ("number", ctypes.c_int),
                ("integer", ctypes.c_int), ("value_bytes", ctypes.c_int), ("block_bytes", ctypes.c_int),
                ("super_bytes", ctypes.c_int), ("head_bytes", ctypes.c_int)]


# the blocked formats' bytes per 8 rows: a block of 32 inputs (bytes, or 4 or 5 bits, with their scales and
# offsets), or for the K formats a super-block of 256 inputs (8 blocks' bits, then their scales)
Q8_BLOCK_BYTES = {f.weights: f.block_bytes for f in FORMATS if f.block_bytes and not f.super_bytes}
HEAD_BYTES = {f.weights: f.head_bytes for f in FORMATS if f.head_bytes}
SUPER_BYTES = {f.weights: f.super_bytes for f in FORMATS if f.super_bytes}
# what sd_struct_sizes reports, in its order (the blocks' sizes are in the format table)
STRUCT_SIZES = {"Model": ctypes.sizeof(Model), "Layer": ctypes.sizeof(Layer), "Cache": ctypes.sizeof(Cache),
                "Rows": ctypes.sizeof(_Rows), "Matrix": ctypes.sizeof(Matrix)}


def group_bytes(name: str, inputs: int) -> int:
    """The bytes of 8 rows of ``inputs`` inputs in a blocked format: their head (a row-scaled format's), then their
    blocks, or their super-blocks."""
    blocks = inputs // 256 * SUPER_BYTES[name] if name in SUPER_BYTES else inputs // 32 * Q8_BLOCK_BYTES[name]
    return HEAD_BYTES.get(name, 0) + blocks


def cpu_lacks() -> list[str]:
    """The instructions the C kernels need that this CPU does not report (Linux's /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        flags = []
    return [flag for flag in NEEDED_FLAGS if flag not in flags]


@functools.cache
def library() -> ctypes.CDLL | str:
    """The built library, or why it cannot be used (a line)."""
    lacking = cpu_lacks()
    if lacking:
        return f"this CPU lacks {', '.join(lacking)}"
    spec = importlib.util.find_spec("exactspec.backends._fused")
    origin = os.environ.get("EXACTSPEC_FUSED_LIBRARY") or (spec.origin if spec is not None else None)
    if not origin:
        return "its C extension was not built at install (reinstall with a C compiler: pip install -e . prints why)"
    try:
        loaded = ctypes.CDLL(origin)
    except OSError as error:
        return f"its C extension does not load ({error})"
    try:
        _declare(loaded)
    except AttributeError as error:  # a library from an older exactspec: a function is missing
        return f"its C extension is out of date ({error}; reinstall exactspec)"
    differing = _differing_structs(loaded)
    if differing:
        return f"its C extension's structures differ from exactspec's ({', '.join(differing)}; reinstall exactspec)"
    differing = _differing_formats(loaded)
    if differing:
        return f"its C extension's weight formats differ from exactspec's ({', '.join(differing)}; reinstall exactspec)"
    return loaded


def _differing_structs(loaded: ctypes.CDLL) -> list[str]:
    """The structures whose size in the library is not what exactspec declares: each as 'name C size/ctypes size'."""
    sizes = (ctypes.c_int64 * len(STRUCT_SIZES))()
    reported = loaded.sd_struct_sizes(sizes, len(STRUCT_SIZES))
    return [f"{name} {size}/{expected}" for (name, expected), size in zip(STRUCT_SIZES.items(), sizes[:reported])
            if size != expected] + (["a structure missing"] if reported < len(STRUCT_SIZES) else [])


def _differing_formats(loaded: ctypes.CDLL) -> list[str]:
    """Where the library's format table (sd_formats) is not FORMATS, value by value: each as 'name field C value/
    exactspec value' (a format's number: its place in the table)."""
    rows = ctypes.POINTER(_FormatRow)()
    count = loaded.sd_formats(ctypes.byref(rows))
    differing = []
    for number, (declared, row) in enumerate(zip(FORMATS, rows[:count])):
        reported = Format(row.name.decode(), row.weights.decode(), bool(row.integer), row.value_bytes,
                          row.block_bytes, row.super_bytes, row.head_bytes)
        differing += [f"{declared.name} {field} {theirs}/{ours}"
                      for field, theirs, ours in zip(("number", *Format._fields), (row.number, *reported),
                                                     (number, *declared)) if theirs != ours]
    return differing + ([f"{count} formats/{len(FORMATS)}"] if count != len(FORMATS) else [])


def unavailable() -> str | None:
    """Why the C kernels cannot run here (a line), or None where they can."""
    loaded = library()
    return loaded if isinstance(loaded, str) else None


class IntegerPeak(NamedTuple):
    """This CPU's integer arithmetic at its peak: multiply-adds of bytes a second on ``threads`` threads at once, by
    ``instruction`` (the integer tiles' widest here)."""

    per_second: float
    threads: int
    instruction: str


def integer_peak(threads: int, seconds: float = 0.3) -> IntegerPeak:
    """Time the integer tiles' widest instruction in a loop of independent sums on ``threads`` threads at once (each
    about ``seconds``): the arithmetic a pass of many rows can reach, as the bandwidth probe is the floor of one."""
    import threading
    import time

    loaded, vnni, rounds = library(), ctypes.c_int(0), 2_000_000
    start = time.perf_counter()  # a first run sizes the timed ones
    loaded.sd_integer_peak(rounds, ctypes.byref(vnni))
    rounds = max(1000, int(rounds * seconds / max(time.perf_counter() - start, 1e-6)))
    done: list[float] = []
    barrier = threading.Barrier(threads)

    def one() -> None:
        barrier.wait()
        done.append(loaded.sd_integer_peak(rounds, ctypes.byref(ctypes.c_int(0))))

    workers = [threading.Thread(target=one) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    return IntegerPeak(sum(done) / elapsed, threads, "vpdpbusd (AVX512-VNNI)" if vnni.value else "maddubs (AVX2)")


@functools.cache
def tiles() -> str:
    """Which tiles the integer products of many rows take here, or why not AMX's (a line: the CPU has none, the
    kernel refused its tile data, a probe faulted, EXACTSPEC_TILES); said once in --verbose."""
    line = library().sd_tiles().decode()
    detail(f"integer products: {line}")
    return line


def use_threads(threads: int | None = None) -> int:
    """Size the kernels' thread team (by default PyTorch's threads, at most the cores this process may run on at
    once: ``cores.usable_cores``); the size it has."""
    global _team_size
    tiles()
    if threads is None or threads != _team_size:
        _team_size = library().sd_set_threads(min(torch.get_num_threads(), usable_cores()) if threads is None
                                              else threads)
    return _team_size


_team_size: int | None = None  # the team's size as last set


class TeamSize:
    """How many of the team's ``most`` threads a runtime's passes run on, chosen by its one-position passes' own
    times as ``-k auto`` chooses a draft's length: the size measured fastest (each size's time a moving average; all
    ``most`` until others are tried), and now and then one pass on a size beside it, whose time that pass sets: every
    ``probe_every`` passes (4 times as seldom while all ``most`` are fastest: a busy machine shows there as a slowed
    pass), and after ``SLOWED_PROBE`` passes where none was tried yet (a process started on a busy machine) or where
    the size in use has slowed to ``SLOWED`` times its fastest since the last try (another process took a core; a
    try sets that mark anew, so a step that slows as the context grows brings a try each time it is 1.5x slower,
    not every few passes).

    On a quiet machine every thread pays (one pass in 256 tries one fewer: about 0.3% of the time); where
    another process keeps a core busy, a team of two meets at its barriers only when both members run, and one
    thread alone was 2.3x faster (the default model: 64 tokens in 0.35 s against 0.81 s; quiet, two threads: 0.24 s).
    Any size gives the same bits: each value is reduced by one thread in one order, whichever thread that is."""

    SLOWED = 1.5
    SLOWED_PROBE = 2

    def __init__(self, most: int, probe_every: int = 64, weight: float = 0.25) -> None:
        self.most = most
        self.probe_every = probe_every
        self.weight = weight
        self.seconds: dict[int, float] = {}  # size -> moving average of a one-position pass's seconds
        self.fastest: dict[int, float] = {}  # size -> its fastest pass since the last try (what a slowing is of)
        self.passes = self.probed = self.probes = 0
        self.size = most

    def best(self) -> int:
        return min(self.seconds, key=self.seconds.get) if self.seconds else self.most

    def choose(self) -> int:
        """The size for the next one-position pass (passes of more positions keep the size the last one chose)."""
        self.passes += 1
        best = self.best()
        beside = [size for size in (best - 1, best + 1) if 1 <= size <= self.most]
        since = self.passes - self.probed
        every = self.probe_every * (4 if best == self.most else 1) if self.probes else self.SLOWED_PROBE
        slowed = best in self.seconds and self.seconds[best] > self.SLOWED * self.fastest[best]
        if beside and (since >= every or (slowed and since >= self.SLOWED_PROBE)):
            self.probed, self.probes = self.passes, self.probes + 1
            if best in self.seconds:
                self.fastest[best] = self.seconds[best]  # slowed from here on is what the next slowing is
            self.size = beside[self.probes % len(beside)]
        else:
            self.size = best
        return self.size

    def observe(self, size: int, seconds: float) -> None:
        """A one-position pass on ``size`` threads took ``seconds``: the size in use moves its average a ``weight``
        of the way; a size tried beside it is set to what the try took (its average is as old as its last try)."""
        previous = self.seconds.get(size)
        tried = previous is None or size != self.best()
        self.seconds[size] = seconds if tried else previous + self.weight * (seconds - previous)
        self.fastest[size] = min(seconds, self.fastest.get(size, seconds))


def _declare(loaded: ctypes.CDLL) -> None:
    loaded.sd_pass.restype = ctypes.c_int
    loaded.sd_pass.argtypes = [_p, _p, ctypes.POINTER(_Rows), _p, ctypes.c_int, ctypes.c_int]
    loaded.sd_final_norm.restype = None
    loaded.sd_final_norm.argtypes = [_p, _p, ctypes.c_int, _p]
    loaded.sd_draft_chain.restype = ctypes.c_int
    loaded.sd_draft_chain.argtypes = [_p, _p, _p, ctypes.c_int, ctypes.c_int, ctypes.c_int, _p, _p, ctypes.c_int,
                                      _p, ctypes.c_float, _p, ctypes.c_int, _p, _p, _p]
    loaded.sd_product.restype = ctypes.c_int
    loaded.sd_product.argtypes = [ctypes.POINTER(Matrix), _p, ctypes.c_int, _p]
    loaded.sd_attention.restype = ctypes.c_int
    loaded.sd_attention.argtypes = [ctypes.POINTER(_Rows), ctypes.c_int, ctypes.c_int, ctypes.c_int, _p, _p, _p,
                                    ctypes.c_int64, _p, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    loaded.sd_struct_sizes.restype = ctypes.c_int
    loaded.sd_struct_sizes.argtypes = [_p, ctypes.c_int]
    loaded.sd_formats.restype = ctypes.c_int
    loaded.sd_formats.argtypes = [ctypes.POINTER(ctypes.POINTER(_FormatRow))]
    loaded.sd_set_threads.restype = ctypes.c_int
    loaded.sd_integer_peak.restype = ctypes.c_double
    loaded.sd_integer_peak.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_int)]
    loaded.sd_set_threads.argtypes = [ctypes.c_int]
    loaded.sd_tiles.restype = ctypes.c_char_p
    loaded.sd_tiles.argtypes = []
    loaded.sd_use_openmp.argtypes = [_p, _p, _p]
    openmp = _torch_openmp()
    if openmp is not None:
        loaded.sd_use_openmp(*openmp)


OPENMP_FUNCTIONS = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")


def _torch_openmp() -> list[ctypes.c_void_p] | None:
    """The functions the C kernels' team (team.c) needs from PyTorch's GNU OpenMP runtime (the one its CPU wheels
    for Linux ship and load), or None: then team.c starts threads of its own."""
    import glob
    import os

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")):
        try:
            openmp = ctypes.CDLL(path)  # already loaded by PyTorch: the same handle, the same threads
            return [ctypes.cast(getattr(openmp, name), _p) for name in OPENMP_FUNCTIONS]
        except (OSError, AttributeError):
            continue
    return None


def repacked(weight: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``weight`` [out, in] as the C kernels' float tiles read it, in ``dtype``: blocks of 8 output rows (the last
    padded with zero rows), each block one chunk of 8 inputs after another, a chunk the 8 rows' 8 values: one
    sequential stream per block. Flat: [ceil(out / 8) * 8 * in]."""
    out, inputs = weight.shape
    padded = torch.zeros(-(-out // TILE_OUTPUTS) * TILE_OUTPUTS, inputs, dtype=dtype)
    padded[:out] = weight
    return padded.view(-1, TILE_OUTPUTS, inputs // CHUNK_INPUTS, CHUNK_INPUTS).transpose(1, 2).contiguous().flatten()


def covers_product(weight: torch.Tensor, precision: str) -> bool:
    """Whether :class:`RowProduct` computes ``x @ weight.T`` in ``precision`` here."""
    return (precision in FLOAT_FORMATS and weight.device.type == "cpu" and weight.shape[1] % CHUNK_INPUTS == 0
            and unavailable() is None)


class MatrixProduct:
    """``x -> x @ W.T + bias`` for a matrix already held as the C kernels read it (its ``Matrix``, whose bytes the
    caller keeps alive), every row computed as it is alone."""

    def __init__(self, struct: Matrix) -> None:
        self.struct = struct
        self.outputs = struct.rows
        self._library = library()
        use_threads()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        x = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.outputs)
        if len(x):
            if self._library.sd_product(ctypes.byref(self.struct), x.data_ptr(), x.shape[0], y.data_ptr()) != 0:
                raise MemoryError("a product could not allocate its quantised rows")
        return y


class RowProduct(MatrixProduct):
    """``x -> x @ weight.T + bias`` on the CPU with the weights held in a float ``precision`` (float32, float16 or
    bfloat16), x and the result float32; every row computed by the C kernels' tiles as it is alone: one accumulator per
    output in the order of the inputs, whatever the row count (:func:`covers_product` says where it runs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> None:
        outputs, inputs = weight.shape
        self.packed = repacked(weight.detach(), FLOAT_FORMATS[precision])
        self.bias = None if bias is None else bias.detach().float().contiguous()
        super().__init__(Matrix(FORMAT[precision], inputs, outputs, self.packed.data_ptr(),
                                None if self.bias is None else self.bias.data_ptr()))


def covers_attention(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`attention` computes heads of ``head_dim`` over a cache of ``dtype`` on ``device`` here."""
    return (device.type == "cpu" and dtype == torch.float32 and head_dim % CHUNK_INPUTS == 0
            and head_dim <= MAX_HEAD_DIM and unavailable() is None)


def rows_struct(arrays: list[np.ndarray], key_cols: np.ndarray | None) -> _Rows:
    """fused.h's Rows over int32 rope, int64 base, int32 column and n_keys arrays (held by the caller), and each row's
    key columns [n, stride] (int32) or None (the first n_keys columns)."""
    stride = 0 if key_cols is None else key_cols.shape[1]
    return _Rows(len(arrays[0]), *(a.ctypes.data for a in arrays),
                 None if key_cols is None else key_cols.ctypes.data, stride)


class RowKeys:
    """Which keys each of a pass's rows attends, as the C kernels read them: made once per pass, read by every layer.
    Row i's sequence starts ``base[i]`` floats from a layer cache's start, and it attends that sequence's first
    ``n_keys[i]`` columns, or those ``key_cols[i]`` lists, in order."""

    def __init__(self, base: np.ndarray, n_keys: np.ndarray, key_cols: np.ndarray | None = None) -> None:
        unused = np.zeros(len(n_keys), dtype=np.int32)  # RoPE positions and cache columns: attention reads neither
        self._arrays = [unused, np.ascontiguousarray(base, dtype=np.int64), unused,
                        np.ascontiguousarray(n_keys, dtype=np.int32)]
        self._key_cols = None if key_cols is None else np.ascontiguousarray(key_cols, dtype=np.int32)
        self.struct = rows_struct(self._arrays, self._key_cols)


class Scoring(NamedTuple):
    """How a layer's queries score their keys, and which they read (fused.h's Scoring): q . k times ``scale`` (0:
    1 / sqrt(head_dim)), capped softly at ``softcap`` (cap tanh(s / cap); 0: not), over the last ``window`` keys
    (0: all)."""

    scale: float = 0.0
    softcap: float = 0.0
    window: int = 0


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: RowKeys, scoring: Scoring | None = None
              ) -> torch.Tensor:  # [n, heads * hd]
    """Each query row's attention over its own keys (``rows``), softmax(q k^T / sqrt(hd)) v, as it is alone; its
    scores and keys as ``scoring`` says (None: as written).

    q [n, heads, hd]; keys and values: one layer's cache, float32, contiguous, [..., kv_heads, capacity, hd] (a
    sequence's, or a pool's with a leading slot axis)."""
    scoring = scoring or Scoring()
    n, heads, hd = q.shape
    kv_heads, capacity = keys.shape[-3], keys.shape[-2]
    q = q.to(torch.float32).contiguous()
    out = torch.empty(n, heads * hd)
    if library().sd_attention(ctypes.byref(rows.struct), heads, kv_heads, hd, q.data_ptr(), keys.data_ptr(),
                              values.data_ptr(), capacity * hd, out.data_ptr(), *scoring) != 0:
        raise MemoryError("the attention kernel could not allocate its scratch")
    return out
