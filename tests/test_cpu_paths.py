"""The kernel paths that each x86 CPU kind selects, exercised on whichever machine runs the suite.

exactspec's row kernels (``fused/*.c``, through ``native.py``) take AVX-512 tiles where a CPU has AVX-512 (a Zen 4 EPYC,
an Intel Xeon) and AVX2 tiles elsewhere (an AVX2-only EPYC); ``EXACTSPEC_FUSED_AVX2=1`` forces the AVX2 tiles on any
CPU. PyTorch's own kernels (norms, SiLU, the embedding) and its libraries take paths by CPU too:
``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS`` hold them to AVX2. Each path runs
in a fresh process, as each switch is read once at start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from exactspec.backends import native

TESTS = Path(__file__).parent
AVX2_TILES = {"EXACTSPEC_FUSED_AVX2": "1"}
AVX2_LIBRARIES = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
TILE_MODEL = {"EXACTSPEC_TILES": "model"}  # AMX's GEMM on the C model of its tiles, from 2 rows on (tiles_amx.c)
TILE_HARDWARE = {"EXACTSPEC_TILES": "amx"}  # on the instructions, where the CPU has them (and they may run)


def cpu_flags() -> list[str] | None:
    """This CPU's flags as Linux reports them (/proc/cpuinfo), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return None


FLAGS = cpu_flags()
HAS_AMX = FLAGS is not None and {"amx_int8", "amx_tile"} <= set(FLAGS)
# without AVX-512 this CPU's own paths are the AVX2 tiles and the libraries' AVX2 kernels already, and the switches
# change nothing (where its flags are unknown, every path runs)
HAS_AVX512 = FLAGS is None or any(flag.startswith("avx512") for flag in FLAGS)
# the paths other than this CPU's own (the suite runs the invariance tests on that one itself)
PATHS = {
    "AVX2 tiles (an AVX2-only EPYC's)": AVX2_TILES,
    "AVX2 tiles and libraries held to AVX2": {**AVX2_TILES, **AVX2_LIBRARIES},
    "AMX's GEMM through the tile model": TILE_MODEL,
    **({"AMX's GEMM on the instructions": TILE_HARDWARE} if HAS_AMX else {}),
}
AVX2_PATHS = {name for name, env in PATHS.items() if "EXACTSPEC_FUSED_AVX2" in env}
# every test that asserts a row's bits are the same whatever shares its pass, on the lean and the fused runtime, and
# that the invariant sampler's noise at some ids is the whole vocabulary's there (its logarithms, elementwise on every
# kernel the libraries dispatch to)
INVARIANCE_TESTS = [
    "test_sampling.py::test_gumbel_noise_is_a_function_of_the_seed_and_the_position_alone",
    "test_sampling.py::test_a_choice_is_the_whole_noises_choice",
    "test_draft_chain.py::test_chain_noise_is_the_targets_noise_at_the_heads_ids",
    "test_batch_runtime.py::test_a_rows_logits_are_the_same_bit_for_bit_whatever_shares_its_pass",
    "test_llama_runtime.py::test_a_tree_node_computes_what_its_branch_computes_as_a_chain",
    "test_llama_runtime.py::test_logits_match_transformers_for_each_weight_precision",
    "test_fused.py::test_a_rows_logits_are_the_same_bit_for_bit_alone_in_a_pass_in_a_tree_and_beside_other_sequences",
    "test_cpu_paths.py::test_row_kernels_compute_each_row_alone",
    "test_draft_chain.py::test_invariant_chain_in_one_call_is_the_python_chain_bit_for_bit",
    "test_draft_chain.py::test_the_choice_ties_where_pythons_does_at_every_row",
]

# Products in each weight format (the byte formats' in floats and in integers, nibbles and 6 bits in integers) and
# attention over a cache, for rows alone and in passes of several, on teams of one and two threads: a digest of every
# output's bits, whether each row's bits were the same alone, and whether the narrow formats gave their bytes'
# values (4 bits: their bits).
KERNEL_DIGEST = """
import hashlib, numpy as np, torch
from exactspec.backends import native
torch.manual_seed(0)
digest, alone_everywhere = hashlib.sha256(), True
x = torch.randn(70, 512)
from exactspec.backends.fused.stored import byte_grid
products = [native.RowProduct(torch.randn(45, 512), torch.randn(45), precision)
            for precision in ("float32", "float16", "bfloat16")]
grids = []  # held: a product reads their bytes
for group in (32, 16):  # bytes with a scale and offset per group, multiplied in floats and in integers
    grids.append(grid := byte_grid(torch.randint(0, 256, (45, 512), dtype=torch.uint8),
                                   torch.rand(45, 512 // group) / 50, torch.randn(45, 512 // group) / 10))
    products += [native.MatrixProduct(grid.struct(kind)) for kind in ("float", "integer")]
from exactspec.backends.fused.stored import StoredMatrix, packed_k, packed_q8, packed_rows
narrow_as_bytes = True
def halves(t):  # values a float16 holds
    return t.half().float()
for name in ("int4", "int5", "int4_k", "int5_k", "int3_r", "int6_k"):  # 4, 5 bits with float16 scales; a K-quant's
    # integers; 3 bits with integer scales and mins up to 255 under each row's floats (a draft-grade copy's)
    bits, group = int(name[3]), 16 if name == "int6_k" else 32
    q = torch.randint(0, 2**bits, (45, 512), dtype=torch.uint8)
    if name == "int3_r":
        sc, mn = (torch.randint(0, 256, (45, 16), dtype=torch.uint8) for _ in range(2))
        d, dmin = torch.rand(45) / 500, torch.rand(45) / 500
        scale, offset = d[:, None] * sc.float(), -(dmin[:, None] * mn.float())
        packed = packed_rows(q, sc, mn, d, dmin)
    elif not name.endswith("_k"):
        scale, offset = halves(torch.rand(45, 512 // group) / 50), halves(torch.randn(45, 512 // group) / 10)
        packed = packed_q8(q, scale, offset, bits)
    else:  # per 256 inputs a float16 d (and dmin), per group an integer scale (and min)
        d, dmin = halves(torch.rand(45, 2) / 500), halves(torch.rand(45, 2) / 500)
        if bits == 6:
            sc, mn = torch.randint(-128, 128, (45, 32), dtype=torch.int8), None
        else:
            sc, mn = (torch.randint(0, 64, (45, 16), dtype=torch.uint8) for _ in range(2))
        scale = d.repeat_interleave(256 // group, 1) * sc.float()
        offset = -32 * scale if bits == 6 else -(dmin.repeat_interleave(8, 1) * mn.float())
        packed = packed_k(q, sc, mn, d, None if bits == 6 else dmin, bits)
    wide, narrow = byte_grid(q, scale, offset), StoredMatrix(name, 45, 512, packed)
    grids += [wide, narrow]
    as_bytes, product = (native.MatrixProduct(m.struct("integer")) for m in (wide, narrow))
    if bits < 6:  # the same integers and the same float steps as its bytes'
        narrow_as_bytes &= torch.equal(product(x), as_bytes(x))
    else:  # the same integers; the offset -32 d taken in them, exactly, where the bytes' add it in floats: within
        # float32's rounding of a few steps a set over the terms' sizes, sum |w| |x|
        w = (q.float().view(45, -1, group) * scale[..., None] + offset[..., None]).view(45, 512)
        rounding = 16 * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T)
        narrow_as_bytes &= bool(((product(x) - as_bytes(x)).abs() <= rounding).all())
    products.append(product)
# a matrix of two formats (a GGUF's q and k in Q4_K, its v in Q6_K): a part each, each part's rows (and its share of
# the bias) what the part alone gives
scales = [torch.randint(0, 64, (48, 16), dtype=torch.uint8) for _ in range(2)]
floats = [halves(torch.rand(48, 2) / 500) for _ in range(2)]
nibbles = packed_k(torch.randint(0, 16, (48, 512), dtype=torch.uint8), *scales, *floats, 4)
held = {"int4_k": StoredMatrix("int4_k", 48, 512, nibbles), "int6_k": narrow}
bias = torch.randn(93)
joined = StoredMatrix("int4_k", 48, 512, nibbles, bias, rest=StoredMatrix("int6_k", 45, 512, narrow.packed))
alone = [StoredMatrix(name, m.outputs, 512, m.packed, part.contiguous())
         for (name, m), part in zip(held.items(), bias.split([48, 45]))]
product = native.MatrixProduct(joined.struct("integer"))
parts_alone = torch.equal(product(x), torch.cat([native.MatrixProduct(m.struct("integer"))(x) for m in alone], 1))
products.append(product)
for product in products:
    native.use_threads(1)
    alone = torch.cat([product(x[i : i + 1]) for i in range(70)])
    native.use_threads(2)
    for n in (2, 5, 6, 7, 17, 40, 70):  # the row tiles (fewer than 6), the GEMM tiles' groups, 64-row chunks
        together = product(x[:n])
        alone_everywhere &= torch.equal(together, alone[:n])
        digest.update(together.numpy().tobytes())
def attention_alone_and_together(q, keys, values, n_keys, scoring=None, cols=None):
    # each query alone (one row's one head, over its kv head's cache only), and all the rows' heads in one call
    rows = lambda i, j: native.RowKeys(np.zeros(j - i), n_keys[i:j], None if cols is None else cols[i:j])
    ratio = q.shape[1] // keys.shape[0]
    alone = torch.cat([torch.cat([native.attention(q[i : i + 1, h : h + 1], keys[h // ratio : h // ratio + 1],
                                                   values[h // ratio : h // ratio + 1], rows(i, i + 1), scoring)
                                  for h in range(q.shape[1])], dim=1) for i in range(len(q))])
    return alone, native.attention(q, keys, values, rows(0, len(q)), scoring)
# a kv head's queries and a sequence's rows are scored together, each as it is alone: GQA 4/2 and 6/2; a window and
# a soft cap; listed key columns (a tree's); 40,000 keys, where the scratch holds one query's scores at a time
keys, values = torch.randn(2, 40, 16), torch.randn(2, 40, 16)
long_keys, long_values = torch.randn(2, 40000, 16), torch.randn(2, 40000, 16)
cols = np.array([[(7 * c + r) % 40 for c in range(40)] for r in range(9)])
for q, k, v, n_keys, scoring, listed in (
        (torch.randn(9, 4, 16), keys, values, np.arange(30, 39), None, None),
        (torch.randn(21, 6, 16), keys, values, np.arange(19, 40), None, None),
        (torch.randn(9, 6, 16), keys, values, np.arange(30, 39), native.Scoring(window=13, softcap=5.0), None),
        (torch.randn(9, 4, 16), keys, values, np.arange(20, 38, 2), None, cols),
        (torch.randn(3, 6, 16), long_keys, long_values, np.array([39998, 39999, 40000]), None, None)):
    alone, together = attention_alone_and_together(q, k, v, n_keys, scoring, listed)
    alone_everywhere &= torch.equal(together, alone)
    digest.update(together.numpy().tobytes())
print(digest.hexdigest(), alone_everywhere, narrow_as_bytes, parts_alone)
"""


def run_here(arguments: list[str], extra_env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **extra_env}
    return subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=TESTS, check=False)


@pytest.fixture(scope="module")
def own_digest() -> subprocess.CompletedProcess:
    """KERNEL_DIGEST run once on this CPU's own paths, for the two tests that read it."""
    if native.unavailable():
        pytest.skip(native.unavailable())
    return run_here(["-c", KERNEL_DIGEST], {}, 120)


def test_row_kernels_compute_each_row_alone(own_digest):
    """Every weight format's product and the attention give each row the same bits alone and in passes of 2 to 70
    (the row tiles' groups of up to 6 rows, as even as they come, the GEMM tiles' of up to 12 rows by 16 outputs, 64
    rows at a time, and the remainders), and on a team of one thread or two (each output is reduced by one thread);
    the attention scores a kv head's queries of a sequence's rows together, each as it is alone (with a window and a
    soft cap, listed key columns, and keys too many for scratch to hold more than one query's scores); 3-, 4- and 5-bit
    weights give the bits their bytes give, and 6-bit weights their values; a matrix of two formats gives each part's
    rows the bits the part gives alone."""
    run = own_digest
    assert run.returncode == 0 and run.stdout.split()[1:] == ["True"] * 3, run.stdout + run.stderr[-2000:]


def test_the_avx2_tiles_the_avx512_tiles_and_amxs_tile_model_give_the_same_bits(own_digest):
    """A machine with AVX-512 and one with AVX2 only compute the same bits: the AVX-512 tiles do, lane for lane, the
    AVX2 tiles' FMAs (on an AVX2-only machine both runs take the AVX2 tiles). AMX's GEMM, run on the C model of its
    tile registers and TDPBUSD on any CPU, gives them too, in every format and pass width from 2 rows (with the
    AVX2 tiles beside it, and with this CPU's own), and so does it on the instructions where the CPU has them."""
    envs = (AVX2_TILES, TILE_MODEL, {**TILE_MODEL, **AVX2_TILES}) + ((TILE_HARDWARE,) if HAS_AMX else ())
    runs = [own_digest, *(run_here(["-c", KERNEL_DIGEST], env, 300) for env in envs)]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    digests = [run.stdout.split() for run in runs]
    assert all(digest == digests[0] for digest in digests) and digests[0][1:] == ["True"] * 3, digests


def test_the_tiles_taken_are_said_and_amx_is_taken_only_where_it_may_run():
    """``native.tiles()`` says which tiles many rows' integer products take, or why not AMX's: the tile model where
    EXACTSPEC_TILES=model asks for it, none where =off or (AMX's GEMM unmeasured on AMX hardware) where nothing asks;
    with =amx, AMX where CPUID, XCR0, the kernel and a probe allow, else why not; on a CPU without AMX, that."""
    if native.unavailable():
        pytest.skip(native.unavailable())
    said = {name: run_here(["-c", "from exactspec.backends import native; print(native.tiles())"], env, 60)
            for name, env in (("model", TILE_MODEL), ("off", {"EXACTSPEC_TILES": "off"}), ("own", {}),
                              ("amx", {"EXACTSPEC_TILES": "amx"}))}
    assert all(run.returncode == 0 for run in said.values()), [run.stderr[-1000:] for run in said.values()]
    assert said["model"].stdout.strip() == "AMX through the tile model (EXACTSPEC_TILES=model)"
    assert said["off"].stdout.strip() == "AMX not used: EXACTSPEC_TILES=off"
    own, asked = said["own"].stdout.strip(), said["amx"].stdout.strip()
    assert own.startswith("AMX not used") and len(own.splitlines()) == 1
    assert asked == "AMX (amx_int8, EXACTSPEC_TILES=amx)" or asked.startswith("AMX not used: ")
    if not HAS_AMX:
        assert own == asked == "AMX not used: this CPU has no AMX-INT8"


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_the_invariance_tests_pass_on_every_cpu_path(path):
    """The suite's invariance tests, run again on each path other than this CPU's own (the suite runs them on that
    one itself); none may be skipped (the row kernels run on all). On a CPU without AVX-512 the AVX2 paths are its
    own: the suite's run of the tests is theirs."""
    if native.unavailable():
        pytest.skip(native.unavailable())
    if path in AVX2_PATHS and not HAS_AVX512:
        pytest.skip("no AVX-512 on this CPU: the AVX2 paths are its own, on which the suite runs these tests itself")
    run = run_here(["-m", "pytest", "-q", "-p", "no:cacheprovider", *INVARIANCE_TESTS], PATHS[path], 600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "skipped" not in run.stdout.splitlines()[-1], run.stdout[-1000:]


def test_the_weight_formats_are_checked_against_the_librarys_table_value_by_value(monkeypatch):
    """native.FORMATS is the C kernels' own format table (sd_formats) value by value: each format's number, names,
    whether it is multiplied in integers, and its value, block and super-block bytes. A declaration that drifts from
    the library (a byte size, or two formats swapped) is named field by field, and the library is refused in one
    line instead of handed weights its tiles would read otherwise."""
    if native.unavailable():
        pytest.skip(native.unavailable())
    library = native.library()
    assert native._differing_formats(library) == []
    formats = list(native.FORMATS)
    q4 = next(i for i, f in enumerate(formats) if f.name == "Q4I")
    formats[q4] = formats[q4]._replace(block_bytes=formats[q4].block_bytes + 32)
    formats[0], formats[2] = formats[2], formats[0]  # F16 and F32 in each other's place
    monkeypatch.setattr(native, "FORMATS", tuple(formats))
    f32, f16 = formats[0], formats[2]
    bytes4 = native.FORMATS[q4].block_bytes - 32  # the library's
    assert native._differing_formats(library) == [
        "F32 name F16/F32", "F32 weights float16/float32", f"F32 value_bytes {f16.value_bytes}/{f32.value_bytes}",
        "F16 name F32/F16", "F16 weights float32/float16", f"F16 value_bytes {f32.value_bytes}/{f16.value_bytes}",
        f"Q4I block_bytes {bytes4}/{bytes4 + 32}"]
    native.library.cache_clear()  # the check at load refuses it in one line
    try:
        refused = native.library()
        assert isinstance(refused, str) and "\n" not in refused and "weight formats differ" in refused, refused
        assert "Q4I block_bytes" in refused, refused
    finally:
        native.library.cache_clear()
        monkeypatch.undo()
        assert not isinstance(native.library(), str)
