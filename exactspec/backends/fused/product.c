/* A matrix's product with rows of inputs: its blocks of 8 weight rows, each by the tiles this CPU takes (through the
 * tables in fused.h), the outputs shared among the team (sd_product; the pass calls product). */
#include "fused.h"

#define VALUE_BYTES_OF(name, weights, integer, value_bytes, block_bytes, super_bytes, head) [name] = value_bytes,
#define BLOCK_BYTES_OF(name, weights, integer, value_bytes, block_bytes, super_bytes, head) [name] = block_bytes,
#define SUPER_BYTES_OF(name, weights, integer, value_bytes, block_bytes, super_bytes, head) [name] = super_bytes,
#define HEAD_BYTES_OF(name, weights, integer, value_bytes, block_bytes, super_bytes, head) [name] = head,
static const int VALUE_BYTES[] = {FORMATS(VALUE_BYTES_OF)}; /* the float formats' */
static const int BLOCK_BYTES[] = {FORMATS(BLOCK_BYTES_OF)}; /* per 8 rows x 32 */
static const int SUPER_BYTES[] = {FORMATS(SUPER_BYTES_OF)}; /* per 8 rows x 256 inputs, the K formats' */
static const int HEAD_BYTES[] = {FORMATS(HEAD_BYTES_OF)};   /* before 8 rows' blocks, the row-scaled formats' */

static const int GEMM_MOST[] = {[Q8I] = 12, [Q8HI] = 8, [Q4I] = 12, [Q6I] = 8, [Q4KI] = 12, [Q5I] = 12, [Q5KI] = 12, [Q3RI] = 12};
/* The fewest rows the GEMM tiles take, per format: fewer stream the weights from memory, where the row tiles' one
 * stream and their more chains per row were measured faster (a pass over 2 rows of the default model cost 1.5x one
 * through the GEMM tiles, 1.04x through the row tiles; 4 and 5 rows of the 1.5B's nibbles 1.16x and 1.25x one
 * through the row tiles, 1.37x and 1.44x through the GEMM tiles); from these counts on (the bytes' measured on a
 * matrix of the default model's LM head's shape, streamed) the GEMM tiles were as fast or faster, by 1.2-1.5x where
 * arithmetic paces a pass. Both give the same bits. */
static const int GEMM_FROM[] = {[Q8I] = 8, [Q8HI] = 6, [Q4I] = 6, [Q6I] = 6, [Q4KI] = 6, [Q5I] = 6, [Q5KI] = 6, [Q3RI] = 6};

/* out[r][j] for `rows` rows (up to GROUP, or GROUP512 with AVX-512) and the 8 rows of the block at w: in one
 * tile (float weights on AVX-512), else in tiles of `width` rows of the block, one after another. */
static void tile(int format, const void *w, int in, const float *x, int64_t ldx, int rows, float out[GROUP512][8]) {
    if (!BLOCKED(format) && has_avx512) {
        WIDE512[format][rows](w, x, ldx, in, out);
        return;
    }
    float part[GROUP512][8];
    int width = BLOCKED(format) && has_avx512 ? 4 : WIDTH[rows];
    for (int done = 0; done < 8; done += width) {
        if (BLOCKED(format))
            (has_avx512 ? Q8_512[format] : Q8_WIDE[format])[rows](w, done, x, ldx, in, part);
        else
            WIDE[format][rows]((const char *)w + 8 * done * VALUE_BYTES[format], x, ldx, in, part);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < width; j++) out[r][done + j] = part[r][j];
    }
}

/* The bytes of a blocked format's 8 weight rows of `in` inputs: their head (row-scaled formats), then their blocks,
 * or (K formats) super-blocks. */
static int64_t group_bytes(int format, int in) {
    return HEAD_BYTES[format] +
           (SUPER_BYTES[format] ? (int64_t)(in / 256) * SUPER_BYTES[format] : (int64_t)(in / 32) * BLOCK_BYTES[format]);
}

/* Where the block of weight rows o..o+7 (o a multiple of 8) of a matrix with `in` inputs starts. */
static const void *block_at(int format, const void *w, int64_t o, int in) {
    return BLOCKED(format) ? (const void *)((const char *)w + o / 8 * group_bytes(format, in))
                           : (const void *)((const char *)w + o * in * VALUE_BYTES[format]);
}

atomic_int scratch_failed;

/* The OFFSET of the tiles that multiply an integer format here (the 8-bit formats' differs between AVX2 and VNNI). */
static int integer_offset(int format) { return has_vnni ? OFFSET_OF(VNNI, format) : OFFSET_OF(AVX2, format); }

/* The rows x [n, ldx] as the matrix's integer tiles read them (quantised_rows), or NULL: for a float format, or
 * (scratch_failed then set) when they could not be had. */
static const Quantised *inputs_for(const Matrix *m, const float *x, int64_t ldx, int n) {
    if (!INTEGER(m->format)) return NULL;
    const Quantised *xq = quantised_rows(x, ldx, n, m->in, SETS(m->format), integer_offset(m->format));
    if (!xq) atomic_store(&scratch_failed, 1);
    return xq;
}

/* y rows r0..r0+rows-1, outputs o..o+count-1, from a tile's out (stride floats a row), with the bias, stored or
 * added (mode). */
static void put_tile(const float *out, int stride, int r0, int rows, int o, int count, const float *bias, float *y,
                     int64_t ldy, int mode) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < count; j++) {
            float *target = y + (int64_t)(r0 + r) * ldy + o + j;
            float value = out[r * stride + j] + (bias ? bias[o + j] : 0.0f);
            *target = mode == ADD ? *target + value : value;
        }
}

/* The rows of the next group when `left` rows are taken in groups of at most `most`: groups of as even a size as
 * that allows (7 rows as 4 and 3, not 6 and 1: a tile's unpacking and epilogue are shared by its rows). */
static int even_group(int left, int most) {
    int groups = (left + most - 1) / most;
    return (left + groups - 1) / groups;
}

#define GEMM_CHUNK 64 /* rows whose quantised bytes a GEMM's tiles share before the next rows' (they stay in L2) */

/* product_of's pairs of weight blocks (16 outputs) from o0 on AVX512-VNNI, for an integer format, by GEMM tiles
 * of up to GEMM_MOST rows, GEMM_CHUNK rows at a time; the first output it leaves (a last block without its pair)
 * to the row tiles. */
static int integer_gemm(const Matrix *m, const Quantised *xq, int n, int o0, int o1, float *y, int64_t ldy,
                        int mode) {
    int format = m->format, in = m->in, most = GEMM_MOST[format], o = o0;
    int64_t next = group_bytes(format, in); /* from one block of 8 weight rows to the next */
    float out[GEMM_ROWS][16];
    for (int c0 = 0; c0 < n; c0 += GEMM_CHUNK) {
        int c1 = n - c0 < GEMM_CHUNK ? n : c0 + GEMM_CHUNK;
        for (o = o0; o + 8 < o1; o += 16) /* the pair's second block holds a row of the matrix */
            for (int r0 = c0, rows; r0 < c1; r0 += rows) {
                rows = even_group(c1 - r0, most);
                INTEGER_GEMM[format][rows](block_at(format, m->weight, o, in), next, xq, r0, out);
                put_tile(&out[0][0], 16, r0, rows, o, o1 - o < 16 ? o1 - o : 16, m->bias, y, ldy, mode);
            }
    }
    return o;
}

/* The fewest rows AMX's GEMM takes: through the tile model (a test's path), every pass of two rows or more, so that
 * the tests' passes reach it; through the instructions, a prompt's passes (unmeasured: no developer machine has AMX,
 * and each set's sums go through a store to memory before their epilogue). */
#define AMX_FROM (amx_tiles == AMX_MODEL ? 2 : 32)

/* product_of's pairs of weight blocks (16 outputs) from o0 through AMX's GEMM, AMX_ROWS rows at a time, for an
 * integer format; the first output it leaves (a last block without its pair) to the row tiles. */
static int amx_gemm(const Matrix *m, const Quantised *xq, int n, int o0, int o1, float *y, int64_t ldy, int mode) {
    int format = m->format, in = m->in, o = o0;
    int64_t next = group_bytes(format, in);
    float out[AMX_ROWS][16];
    for (o = o0; o + 8 < o1; o += 16)
        for (int r0 = 0, rows; r0 < n; r0 += rows) {
            rows = n - r0 < AMX_ROWS ? n - r0 : AMX_ROWS;
            amx_gemm_tile(format, block_at(format, m->weight, o, in), next, xq, r0, rows, out);
            put_tile(&out[0][0], 16, r0, rows, o, o1 - o < 16 ? o1 - o : 16, m->bias, y, ldy, mode);
        }
    return o;
}

/* y[r, o] = x[r] . W[o] (+ bias) for every row r < n and o in [o0, o1) (o0 a multiple of 8): x [n, ldx], or for an
 * integer format xq, inputs_for's rows of x; y [n, ldy]. A block of weight rows is read from memory once, and
 * stays in L1 while every group of rows reads it. */
static void product_of(const Matrix *m, const float *x, const Quantised *xq, int64_t ldx, int n, int o0, int o1,
                       float *y, int64_t ldy, int mode) {
    int format = m->format, in = m->in;
    const void *w = m->weight;
    float out[GROUP512][8];
    if (INTEGER(format) && !xq) return; /* its rows could not be quantised: the pass fails */
    if (xq && amx_tiles != AMX_NONE && n >= AMX_FROM)
        o0 = amx_gemm(m, xq, n, o0, o1, y, ldy, mode);
    else if (xq && has_vnni && n >= GEMM_FROM[format])
        o0 = integer_gemm(m, xq, n, o0, o1, y, ldy, mode);
    int group = INTEGER(format) || has_avx512 ? GROUP512 : GROUP; /* the most rows a tile takes */
    /* the rows in groups as even as that allows: 5 rows of an integer format in one tile, where 4 and 1 unpacked
     * each weight block twice (a pass of 5 of the 1.5B cost 1.88x one on AVX2, 1.68x in one tile: medians of 4 runs
     * alternated); a row's bits are the same in a tile of any size */
    for (int o = o0; o < o1; o += 8) {
        int count = o1 - o < 8 ? o1 - o : 8; /* a block past the matrix's last row is zero padding */
        for (int r0 = 0, rows; r0 < n; r0 += rows) {
            rows = even_group(n - r0, group);
            if (xq)
                (has_vnni ? INTEGER_VNNI[format] : INTEGER_WIDE[format])[rows](block_at(format, w, o, in), xq, r0, out);
            else
                tile(format, block_at(format, w, o, in), in, x + r0 * ldx, ldx, rows, out);
            put_tile(&out[0][0], 8, r0, rows, o, count, m->bias, y, ldy, mode);
        }
    }
}

/* The rows of a matrix, its parts' together. */
static int outputs_of(const Matrix *m) {
    int outputs = 0;
    for (; m; m = m->rest) outputs += m->out;
    return outputs;
}

/* product_of over outputs o0..o1-1 of a matrix's parts, each part's, the rows quantised for it where its format
 * needs it (and not where this member has none of its outputs). */
void product(const Matrix *m, const float *x, int64_t ldx, int n, int o0, int o1, float *y, int64_t ldy,
             int mode) {
    for (int first = 0; m; first += m->out, m = m->rest) { /* first: the part's first output in the matrix */
        int b = o0 > first ? o0 - first : 0, e = o1 - first < m->out ? o1 - first : m->out;
        if (b < e) product_of(m, x, inputs_for(m, x, ldx, n), ldx, n, b, e, y + first, ldy, mode);
    }
}

typedef struct {
    const Matrix *m;
    const float *x;  /* [n, in] */
    int n;
    float *y;        /* [n, out] */
} Product;

static void product_job(void *arg, int thread, int threads) {
    const Product *p = (const Product *)arg;
    int b, e;
    if (thread >= threads) return;
    share(outputs_of(p->m), 8, thread, threads, &b, &e);
    product(p->m, p->x, p->m->in, p->n, b, e, p->y, outputs_of(p->m), STORE);
}

/* y = x W^T + bias for n rows, the outputs shared among the team. Returns 0, or -1 when scratch could not be had. */
int sd_product(const Matrix *m, const float *x, int n, float *y) {
    Product p = {m, x, n, y};
    pthread_mutex_lock(&pass_lock);
    atomic_store(&scratch_failed, 0);
    run_team(product_job, &p);
    int failed = atomic_load(&scratch_failed);
    pthread_mutex_unlock(&pass_lock);
    return failed ? -1 : 0;
}
