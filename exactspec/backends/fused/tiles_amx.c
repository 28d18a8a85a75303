/* AMX int8 for the integer formats: one GEMM written against a thin tile API (configure, load, zero, TDPBUSD,
 * store) and two back ends behind it.
 *
 * - The instructions (Intel Xeons from Sapphire Rapids on), where EXACTSPEC_TILES=amx asks for them (until this
 *   GEMM is measured on such a CPU, none is taken by default): taken only where CPUID reports AMX-TILE and AMX-INT8,
 *   XCR0 holds the tile state, the kernel grants tile data (arch_prctl ARCH_REQ_XCOMP_PERM) and a probe's tile
 *   instructions ran in a child process without a fault (cloud VMs exist that advertise AMX and fault: llama.cpp
 *   #13678). Otherwise the next path (VNNI, else AVX2), and sd_tiles says why.
 * - A C model of the tile registers and of TDPBUSD (u8 x s8, four products a dword summed into an int32 of C,
 *   exactly; B in VNNI's layout; the shape rules checked), which every CPU runs under EXACTSPEC_TILES=model, so that
 *   the GEMM's rows are held to the row tiles' bits on every machine, AMX or not (tests/test_cpu_paths.py).
 *
 * One GEMM step multiplies a set of inputs (a block's 32, or 16 for the formats with two sets a block) of two blocks
 * of 8 weight rows (16 outputs, A: 16 rows of u8, each output's bytes in input order) into up to 16 quantised rows
 * (B: a row of B per 4 inputs, each activation row's 4 bytes side by side), giving C[output][row], the integer sums
 * the row tiles compute. Each row then takes them through the row tiles' own epilogue (SET_*: add_set, add_scaled),
 * the same float operations in the same order, so a row's bits are the same here, in a row tile, alone or in a pass
 * of any width. The weights' bits are unpacked by the row tiles' own QUAD_* and laid out for A; the step then waits
 * on one C store per set, so its speed on AMX hardware is unmeasured (no developer machine has AMX), and it is
 * taken from AMX_FROM rows on. */
#include "fused.h"
#include "tiles.h"

#include <cpuid.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define AMX_TARGET "amx-tile,amx-int8,avx2,fma,f16c"

/* ---------------------------------------------------------------- the tile API */

enum { TILE_C, TILE_A, TILE_B }; /* the tiles a step uses: the sums, the weights, the inputs */

typedef struct {
    void (*configure)(int set_inputs); /* A: 16 x set_inputs bytes; B: set_inputs / 4 x 64; C: 16 x 16 int32 */
    void (*load)(int tile, const void *p, int stride);
    void (*zero)(int tile);
    void (*dpbusd)(void); /* C += A . B */
    void (*store)(int tile, void *p, int stride);
    void (*release)(void);
} TileOps;

/* palette 1's configuration: 64 bytes, each tile's rows and bytes a row */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
static_assert(sizeof(TileConfig) == 64, "a tile configuration is 64 bytes");

static TileConfig config_for(int set_inputs) {
    TileConfig config = {.palette = 1};
    config.rows[TILE_C] = AMX_ROWS, config.colsb[TILE_C] = 4 * AMX_ROWS;
    config.rows[TILE_A] = 16, config.colsb[TILE_A] = (uint16_t)set_inputs;
    config.rows[TILE_B] = (uint8_t)(set_inputs / 4), config.colsb[TILE_B] = 4 * AMX_ROWS;
    return config;
}

/* The model: each thread's tile registers, shaped by its configuration; TDPBUSD as the instruction set defines it,
 * on the shapes it allows (a step that breaks them is a bug here: it aborts, as the instruction faults). */
typedef struct {
    uint8_t bytes[16][64];
    int rows, colsb;
} ModelTile;
static _Thread_local ModelTile model_tiles[3];

static void model_configure(int set_inputs) {
    TileConfig config = config_for(set_inputs);
    for (int t = 0; t < 3; t++) {
        model_tiles[t].rows = config.rows[t], model_tiles[t].colsb = config.colsb[t];
        assert(config.rows[t] <= 16 && config.colsb[t] <= 64);
    }
}

static void model_load(int tile, const void *p, int stride) {
    ModelTile *t = &model_tiles[tile];
    memset(t->bytes, 0, sizeof t->bytes);
    for (int r = 0; r < t->rows; r++) memcpy(t->bytes[r], (const char *)p + (int64_t)r * stride, t->colsb);
}

static void model_zero(int tile) { memset(model_tiles[tile].bytes, 0, sizeof model_tiles[tile].bytes); }

static void model_dpbusd(void) {
    ModelTile *c = &model_tiles[TILE_C];
    const ModelTile *a = &model_tiles[TILE_A], *b = &model_tiles[TILE_B];
    if (a->colsb / 4 != b->rows || b->colsb != c->colsb || a->rows != c->rows) abort();
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < c->colsb / 4; n++) {
            int32_t sum;
            memcpy(&sum, &c->bytes[m][4 * n], 4);
            uint32_t total = (uint32_t)sum; /* int32 sums wrap, as the instruction's do (these never reach it) */
            for (int k = 0; k < a->colsb / 4; k++)
                for (int i = 0; i < 4; i++)
                    total += (uint32_t)((int32_t)a->bytes[m][4 * k + i] * (int32_t)(int8_t)b->bytes[k][4 * n + i]);
            sum = (int32_t)total;
            memcpy(&c->bytes[m][4 * n], &sum, 4);
        }
}

static void model_store(int tile, void *p, int stride) {
    const ModelTile *t = &model_tiles[tile];
    for (int r = 0; r < t->rows; r++) memcpy((char *)p + (int64_t)r * stride, t->bytes[r], t->colsb);
}

static void model_release(void) { memset(model_tiles, 0, sizeof model_tiles); }

static const TileOps MODEL = {model_configure, model_load, model_zero, model_dpbusd, model_store, model_release};

/* The instructions: a tile's number is an immediate (the register's name: tmm0 is TILE_C, tmm1 TILE_A, tmm2
 * TILE_B), so each operation picks it by name. */
static_assert(TILE_C == 0 && TILE_A == 1 && TILE_B == 2, "the tiles' registers, as the instructions name them");

__attribute__((target(AMX_TARGET))) static void amx_configure(int set_inputs) {
    TileConfig config = config_for(set_inputs);
    _tile_loadconfig(&config);
}

__attribute__((target(AMX_TARGET))) static void amx_load(int tile, const void *p, int stride) {
    if (tile == TILE_A)
        _tile_loadd(1, p, stride);
    else if (tile == TILE_B)
        _tile_loadd(2, p, stride);
    else
        _tile_loadd(0, p, stride);
}

__attribute__((target(AMX_TARGET))) static void amx_zero(int tile) {
    if (tile == TILE_C)
        _tile_zero(0);
    else if (tile == TILE_A)
        _tile_zero(1);
    else
        _tile_zero(2);
}

__attribute__((target(AMX_TARGET))) static void amx_dpbusd(void) { _tile_dpbusd(0, 1, 2); }

__attribute__((target(AMX_TARGET))) static void amx_store(int tile, void *p, int stride) {
    if (tile == TILE_C)
        _tile_stored(0, p, stride);
    else if (tile == TILE_A)
        _tile_stored(1, p, stride);
    else
        _tile_stored(2, p, stride);
}

__attribute__((target(AMX_TARGET))) static void amx_release(void) { _tile_release(); }

static const TileOps HARDWARE = {amx_configure, amx_load, amx_zero, amx_dpbusd, amx_store, amx_release};

/* ---------------------------------------------------------------- which back end, and why */

int amx_tiles; /* AMX_NONE, AMX_HARDWARE or AMX_MODEL: set with the team's features (read_amx) */
static char amx_why[160] = "not asked yet";

#define XFEATURE_XTILEDATA 18
#define ARCH_REQ_XCOMP_PERM 0x1023

__attribute__((target(AMX_TARGET))) static void probe_tiles(void) {
    amx_configure(32);
    _tile_zero(0);
    _tile_release();
}

/* Whether CPUID reports AMX-INT8 and AMX-TILE (where not, amx_why says so). */
static int advertised(void) {
    unsigned a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25))) return 1;
    snprintf(amx_why, sizeof amx_why, "this CPU has no AMX-INT8");
    return 0;
}

/* Whether the instructions may run here; where not, amx_why says why. */
static int hardware_usable(void) {
    unsigned a, b, c, d;
    if (!advertised()) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) {
        snprintf(amx_why, sizeof amx_why, "the OS saves no extended state (no OSXSAVE)");
        return 0;
    }
    uint32_t low, high;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    if ((low & (3u << 17)) != (3u << 17)) {
        snprintf(amx_why, sizeof amx_why, "the OS does not enable the tile state (XCR0)");
        return 0;
    }
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        snprintf(amx_why, sizeof amx_why, "the kernel refused tile data (arch_prctl ARCH_REQ_XCOMP_PERM)");
        return 0;
    }
    pid_t child = fork(); /* the child runs the probe's tile instructions alone, and nothing that takes a lock */
    if (child == 0) {
        probe_tiles();
        _exit(0);
    }
    int status = 0;
    if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        snprintf(amx_why, sizeof amx_why, "a probe's tile instructions faulted%s",
                 child < 0 ? " (it could not be started)" : "");
        return 0;
    }
    return 1;
}

/* EXACTSPEC_TILES=model: the model on any CPU; =amx: the instructions where they may run; =off or unset: none. The
 * instructions are asked for, not taken by default, until this GEMM is measured on a CPU that has them. */
void read_amx(void) {
    const char *asked = getenv("EXACTSPEC_TILES");
    if (asked && !strcmp(asked, "model")) {
        amx_tiles = AMX_MODEL;
        snprintf(amx_why, sizeof amx_why, "AMX through the tile model (EXACTSPEC_TILES=model)");
    } else if (asked && !strcmp(asked, "off")) {
        amx_tiles = AMX_NONE;
        snprintf(amx_why, sizeof amx_why, "AMX not used: EXACTSPEC_TILES=off");
    } else if (!(asked && !strcmp(asked, "amx")) && advertised()) {
        amx_tiles = AMX_NONE;
        snprintf(amx_why, sizeof amx_why, "AMX not used unless asked (EXACTSPEC_TILES=amx): its GEMM is not "
                                          "measured on AMX hardware yet");
    } else if (asked && !strcmp(asked, "amx") && hardware_usable()) {
        amx_tiles = AMX_HARDWARE;
        snprintf(amx_why, sizeof amx_why, "AMX (amx_int8, EXACTSPEC_TILES=amx)");
    } else {
        amx_tiles = AMX_NONE;
        char why[sizeof amx_why - 16];
        memcpy(why, amx_why, sizeof why - 1);
        why[sizeof why - 1] = 0;
        snprintf(amx_why, sizeof amx_why, "AMX not used: %s", why);
    }
}

/* Which tiles the integer GEMM takes, or why not AMX: a line for --verbose and exactspec.bench.passes. */
const char *sd_tiles(void) {
    read_features();
    return amx_why;
}

/* ---------------------------------------------------------------- the GEMM, written once against the API */

/* Quad g of a block as 32 bytes (8 rows x 4 inputs), row j's at 4j, laid into A: output `first + j`'s 4 bytes at
 * column 4 (g - g0). */
#define INTO_A(a, quad, first, column)                                                                             \
    do {                                                                                                           \
        uint8_t bytes[32];                                                                                         \
        _mm256_storeu_si256((__m256i *)bytes, quad);                                                               \
        for (int j = 0; j < 8; j++) memcpy(&(a)[(first) + j][column], bytes + 4 * j, 4);                           \
    } while (0)

/* out[r][0..15] for `rows` quantised rows from r0 and the 16 outputs of the weight blocks at w and w + next. */
#define TILE_AMX(NAME, BLOCK, SETS, BITS, SCALE)                                                                   \
    __attribute__((target(AVX2_TARGET))) static void NAME##_amx(const TileOps *ops, const void *w, int64_t next,   \
                                                                const Quantised *x, int r0, int rows,              \
                                                                float out[AMX_ROWS][16]) {                         \
        __m256 acc[AMX_ROWS][2];                                                                                   \
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                               \
        uint8_t a[16][32];                                                                                         \
        int8_t in[8][4 * AMX_ROWS];                                                                                \
        int32_t c[16][AMX_ROWS];                                                                                   \
        memset(in, 0, sizeof in); /* the rows past `rows` multiply by 0 */                                         \
        const int8_t *xq = x->q + (int64_t)r0 * 32;                                                                \
        const BLOCK *b = FIRST_##SCALE(BLOCK, w);                                                                  \
        __attribute__((unused)) const SUPER_##SCALE(BLOCK) *s = (const SUPER_##SCALE(BLOCK) *)w;                   \
        ops->configure(32 / SETS);                                                                                 \
        for (int block = 0; block < x->in / 32; block++, xq += (int64_t)x->n * 32) {                               \
            for (int t = 0; t < SETS; t++) {                                                                       \
                const int g0 = t * 8 / SETS, quads = 8 / SETS;                                                     \
                for (int g = g0; g < g0 + quads; g++) {                                                            \
                    INTO_A(a, QUAD_##BITS(b, g), 0, 4 * (g - g0));                                                 \
                    INTO_A(a, QUAD_##BITS(AT_NEXT(b, next), g), 8, 4 * (g - g0));                                  \
                    for (int r = 0; r < rows; r++) memcpy(&in[g - g0][4 * r], xq + 32 * r + 4 * g, 4);           \
                }                                                                                                  \
                ops->load(TILE_A, a, 32);                                                                          \
                ops->load(TILE_B, in, 4 * AMX_ROWS);                                                               \
                ops->zero(TILE_C);                                                                                 \
                ops->dpbusd();                                                                                     \
                ops->store(TILE_C, c, 4 * AMX_ROWS);                                                               \
                const __m256 d = SCALES_##SCALE(b, s, IN_SUPER(block), t);                                         \
                const __m256 d_next = SCALES_##SCALE(AT_NEXT(b, next), AT_NEXT(s, next), IN_SUPER(block), t);      \
                __attribute__((unused)) const __m256 m = OFFSETS_##SCALE(b, s, IN_SUPER(block), t);                \
                __attribute__((unused)) const __m256 m_next =                                                      \
                    OFFSETS_##SCALE(AT_NEXT(b, next), AT_NEXT(s, next), IN_SUPER(block), t);                       \
                for (int r = 0; r < rows; r++) {                                                                   \
                    int32_t sums[16]; /* row r's: column r of C */                                                 \
                    for (int o = 0; o < 16; o++) sums[o] = c[o][r];                                                \
                    __m256i low = _mm256_loadu_si256((const __m256i *)sums),                                       \
                            high = _mm256_loadu_si256((const __m256i *)(sums + 8));                                \
                    if (OFFSET_VNNI_##BITS) { /* the unsigned bytes' offset taken in the sums, as the row tiles */ \
                        __m256i start = _mm256_set1_epi32(x->start[block_of(x, r0 + r, block) * SETS + t]);        \
                        low = _mm256_add_epi32(low, start), high = _mm256_add_epi32(high, start);                  \
                    }                                                                                              \
                    acc[r][0] = SET_##SCALE(acc[r][0], low, d, m, x, r0 + r, block, SETS, t);                      \
                    acc[r][1] = SET_##SCALE(acc[r][1], high, d_next, m_next, x, r0 + r, block, SETS, t);           \
                }                                                                                                  \
            }                                                                                                      \
            NEXT_##SCALE(b, s, block)                                                                              \
        }                                                                                                          \
        ops->release();                                                                                            \
        for (int r = 0; r < rows; r++) {                                                                           \
            _mm256_storeu_ps(out[r], acc[r][0]);                                                                   \
            _mm256_storeu_ps(out[r] + 8, acc[r][1]);                                                               \
        }                                                                                                          \
    }
#define TILES_AMX(NAME, BLOCK, SETS, BITS, SCALE) TILE_AMX(NAME, BLOCK, SETS, BITS, SCALE)
INTEGER_TILES(TILES_AMX)

typedef void (*AmxFn)(const TileOps *, const void *, int64_t, const Quantised *, int, int, float[AMX_ROWS][16]);
static const AmxFn AMX_GEMM[] = {[Q8I] = q8i_amx, [Q8HI] = q8hi_amx, [Q4I] = q4i_amx, [Q6I] = q6i_amx,
                                 [Q4KI] = q4ki_amx, [Q5I] = q5i_amx, [Q5KI] = q5ki_amx, [Q3RI] = q3ri_amx};

/* The GEMM over `rows` (up to AMX_ROWS) quantised rows from r0 and the 16 outputs of the blocks at w and w + next,
 * on this thread, through the back end chosen (amx_tiles: not AMX_NONE). */
void amx_gemm_tile(int format, const void *w, int64_t next, const Quantised *x, int r0, int rows,
                   float out[AMX_ROWS][16]) {
    AMX_GEMM[format](amx_tiles == AMX_HARDWARE ? &HARDWARE : &MODEL, w, next, x, r0, rows, out);
}
