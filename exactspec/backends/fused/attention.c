/* Each row's attention over its own keys, as it is alone: in a pass (pass.c calls attend_rows) and for the lean
 * runtime one layer at a time (sd_attention), so its rows too are the same bits in any pass on any CPU. */
#include "fused.h"

/* q's dot products with 8 keys of hd floats, in 8 lanes: each key's 8 lanes of products, then the 8 added across
 * in one tree for all 8 ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): a key's sum is the same in any group. */
__attribute__((target("avx2,fma,f16c"))) static __m256 dots8(const float *q, const float *const key[8], int hd) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[j] + i), acc[j]);
    }
    __m256 pairs[4], quads[2];
    for (int j = 0; j < 4; j++) pairs[j] = _mm256_hadd_ps(acc[2 * j], acc[2 * j + 1]);
    for (int j = 0; j < 2; j++) quads[j] = _mm256_hadd_ps(pairs[2 * j], pairs[2 * j + 1]);
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

/* Queries that read the same keys (one kv head's columns, in the same order): a row's heads that share a kv head,
 * of rows that share a sequence. Query i reads keys [first[i], count[i]). */
#define MAX_QUERIES 48        /* queries scored together: their keys and values are read once for all of them */
#define QUERY_SCORES 65536    /* floats of scores a member holds for them (one query's, where its keys are more) */
#define VALUE_BLOCK 32        /* keys whose values every query adds before the next block's (they stay in L1) */
typedef struct {
    const float *q[MAX_QUERIES];
    float *out[MAX_QUERIES];
    int first[MAX_QUERIES], count[MAX_QUERIES];
    int n;
} Queries;

/* sum[0..8 vectors) += s[t] values[t][0..8 vectors) for t in [b, e), in t's order (values: hd floats a key, or
 * the columns `cols` lists). Inlined with a constant `vectors`, the sums stay in registers (a loop over hd's
 * vectors kept them in memory, each add waiting on the store before it). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void add_values(float *sum, const float *s,
                                                                                     const float *values,
                                                                                     const int32_t *cols, int hd,
                                                                                     int b, int e, int vectors) {
    __m256 acc[8];
    for (int j = 0; j < vectors; j++) acc[j] = _mm256_loadu_ps(sum + 8 * j);
    for (int t = b; t < e; t++) {
        const float *v = values + (int64_t)(cols ? cols[t] : t) * hd;
        __m256 weight = _mm256_set1_ps(s[t]);
        for (int j = 0; j < vectors; j++) acc[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * j), acc[j]);
    }
    for (int j = 0; j < vectors; j++) _mm256_storeu_ps(sum + 8 * j, acc[j]);
}

/* Each query's attention: softmax(q . k * scale) over its keys (columns first..count-1, or those `cols` lists), in
 * their order, then the weighted sum of the values, in the same order; the same operations for each as if it were
 * alone, so the same bits in any company. A group of 8 keys is read once for every query (a key's dot product is
 * the same in any group: dots8), and a block of values once for every query, whose sums wait in `sums` between
 * blocks (a store and a load: the bits are kept). keys and values: the kv head's columns, hd floats each; scores
 * [n, stride]; sums [n, hd]. */
__attribute__((target("avx2,fma,f16c"))) static void attend(const Queries *qs, const float *keys, const float *values,
                                                           int hd, const int32_t *cols, const Scoring *how,
                                                           float *scores, int64_t stride, float *sums) {
    float scale = how->scale != 0.0f ? how->scale : 1.0f / sqrtf((float)hd), top[MAX_QUERIES], total[MAX_QUERIES];
    static const float nothing[MAX_HEAD_DIM]; /* the keys past the last of a group of 8 */
    int lo = qs->count[0], hi = 0;
    for (int i = 0; i < qs->n; i++) {
        top[i] = -INFINITY;
        total[i] = 0.0f;
        if (qs->first[i] < lo) lo = qs->first[i];
        if (qs->count[i] > hi) hi = qs->count[i];
    }
    __m256 tops[MAX_QUERIES]; /* the scores' greatest, lane by lane, of groups read whole */
    for (int i = 0; i < qs->n; i++) tops[i] = _mm256_set1_ps(-INFINITY);
    for (int t = lo; t < hi; t += 8) {
        const float *key[8];
        for (int j = 0; j < 8; j++) key[j] = t + j < hi ? keys + (int64_t)(cols ? cols[t + j] : t + j) * hd : nothing;
        for (int i = 0; i < qs->n; i++) {
            int b = qs->first[i] > t ? qs->first[i] : t, e = qs->count[i] < t + 8 ? qs->count[i] : t + 8;
            if (b >= e) continue;
            float *s = scores + i * stride;
            __m256 eight = _mm256_mul_ps(dots8(qs->q[i], key, hd), _mm256_set1_ps(scale));
            if (b == t && e == t + 8 && how->softcap == 0.0f) { /* the whole group, as it is */
                _mm256_storeu_ps(s + t, eight);
                tops[i] = _mm256_max_ps(eight, tops[i]); /* a NaN score is passed over, as below */
                continue;
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, eight);
            for (int u = b; u < e; u++) {
                s[u] = how->softcap != 0.0f ? how->softcap * tanhf(lanes[u - t] / how->softcap) : lanes[u - t];
                if (s[u] > top[i]) top[i] = s[u];
            }
        }
    }
    for (int i = 0; i < qs->n; i++) { /* the greatest is the same whatever order finds it */
        float lanes[8];
        _mm256_storeu_ps(lanes, tops[i]);
        for (int j = 0; j < 8; j++)
            if (lanes[j] > top[i]) top[i] = lanes[j];
    }
    for (int i = 0; i < qs->n; i++) {
        float *s = scores + i * stride;
        int t = qs->first[i], count = qs->count[i];
        for (; t + 8 <= count; t += 8)
            _mm256_storeu_ps(s + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(top[i]))));
        if (t < count)
            STORE_PART(s + t, count - t, exp8(_mm256_sub_ps(LOAD_PART(s + t, count - t), _mm256_set1_ps(top[i]))));
        memset(sums + (int64_t)i * hd, 0, hd * sizeof(float));
    }
    for (int t = lo; t < hi; t++) /* each query's total in its keys' order; the queries' sums interleaved */
        for (int i = 0; i < qs->n; i++)
            if (qs->first[i] <= t && t < qs->count[i]) total[i] += scores[i * stride + t];
    for (int block = lo; block < hi; block += VALUE_BLOCK) {
        for (int i = 0; i < qs->n; i++) {
            int b = qs->first[i] > block ? qs->first[i] : block;
            int e = qs->count[i] < block + VALUE_BLOCK ? qs->count[i] : block + VALUE_BLOCK;
            if (b >= e) continue;
            const float *s = scores + i * stride;
            float *sum = sums + (int64_t)i * hd;
            int o = 0;
            for (; o + 64 <= hd; o += 64) add_values(sum + o, s, values + o, cols, hd, b, e, 8);
            for (; o + 32 <= hd; o += 32) add_values(sum + o, s, values + o, cols, hd, b, e, 4);
            for (; o < hd; o += 8) add_values(sum + o, s, values + o, cols, hd, b, e, 1);
        }
    }
    for (int i = 0; i < qs->n; i++)
        for (int j = 0; j < hd / 8; j++)
            _mm256_storeu_ps(qs->out[i] + 8 * j,
                             _mm256_div_ps(_mm256_loadu_ps(sums + (int64_t)i * hd + 8 * j), _mm256_set1_ps(total[i])));
}

/* A query's scores in scratch, for at most `max_keys` keys: their floats, rounded up to 16. */
static int64_t scores_stride(int max_keys) { return (max_keys + 15) / 16 * 16; }

/* The floats a member holds for its queries' scores: QUERY_SCORES, or one query's where its keys are more. */
static int64_t scores_room(int max_keys) {
    return scores_stride(max_keys) > QUERY_SCORES ? scores_stride(max_keys) : QUERY_SCORES;
}

/* The floats of scratch a member needs for attend over at most `max_keys` keys a query: scores, then sums. */
int64_t attention_scratch(int max_keys) { return scores_room(max_keys) + (int64_t)MAX_QUERIES * MAX_HEAD_DIM; }

/* The row after the last of the group from row r0: up to `most` rows of one sequence, one after another. */
static int group_end(const Rows *rows, int r0, int most) {
    int r1 = r0 + 1;
    while (r1 < rows->n && r1 - r0 < most && rows->base[r1] == rows->base[r0]) r1++;
    return r1;
}

/* This member's share of the rows' attention in one layer's cache (keys, values: its base; head_stride floats from
 * a kv head to the next). Row r's queries are heads x hd floats at q + r q_stride, its outputs go to out + r
 * out_stride. The work comes in items of queries that read the same keys (attend): the heads of one kv head (or a
 * part of them, where the items would be too few for the team) of up to as many rows of one sequence as scratch
 * holds (a row alone where it lists its key columns). Items are dealt round the team. */
void attend_rows(const Rows *rows, const float *q, int64_t q_stride, float *out, int64_t out_stride,
                 const float *keys, const float *values, int64_t head_stride, int heads, int kv_heads, int hd,
                 const Scoring *how, float *scratch, int max_keys, int thread, int threads) {
    int n = rows->n, ratio = heads / kv_heads;
    int64_t stride = scores_stride(max_keys), room = scores_room(max_keys);
    int per_item = room / stride < MAX_QUERIES ? (int)(room / stride) : MAX_QUERIES; /* at least 1 */
    int group_rows = rows->key_cols ? 1 : per_item / ratio > 0 ? per_item / ratio : 1;
    int parts = (ratio + per_item - 1) / per_item;
    int groups = 0;
    for (int r0 = 0; r0 < n; r0 = group_end(rows, r0, group_rows)) groups++;
    while (parts < ratio && groups * kv_heads * parts < 2 * threads) parts++;
    float *sums = scratch + room;
    int item = 0;
    for (int r0 = 0, r1; r0 < n; r0 = r1) {
        r1 = group_end(rows, r0, group_rows);
        for (int kv = 0; kv < kv_heads; kv++)
            for (int part = 0; part < parts; part++, item++) {
                if (item % threads != thread) continue;
                Queries qs = {.n = 0};
                for (int r = r0; r < r1; r++)
                    for (int head = kv * ratio + part * ratio / parts; head < kv * ratio + (part + 1) * ratio / parts;
                         head++) {
                        int count = rows->n_keys[r];
                        qs.q[qs.n] = q + r * q_stride + head * hd;
                        qs.out[qs.n] = out + r * out_stride + head * hd;
                        qs.count[qs.n] = count;
                        qs.first[qs.n++] = how->window > 0 && count > how->window ? count - how->window : 0;
                    }
                int64_t offset = rows->base[r0] + kv * head_stride;
                const int32_t *cols = rows->key_cols ? rows->key_cols + (int64_t)r0 * rows->key_stride : NULL;
                attend(&qs, keys + offset, values + offset, hd, cols, how, scratch, stride, sums);
            }
    }
}

typedef struct {
    const Rows *rows;             /* each row's keys: base, n_keys, key_cols */
    int heads, kv_heads, head_dim;
    Scoring how;
    const float *q;               /* [n, heads * head_dim] */
    const float *keys, *values;   /* one layer's cache base */
    int64_t head_stride;          /* floats from one kv head to the next */
    float *out;                   /* [n, heads * head_dim] */
    float *scratch;               /* [threads, attention_scratch(max_keys)] */
    int max_keys;                 /* the most keys a row attends */
} Attention;

static void attention_job(void *arg, int thread, int threads) {
    const Attention *a = (const Attention *)arg;
    if (thread >= threads) return;
    int64_t width = (int64_t)a->heads * a->head_dim;
    attend_rows(a->rows, a->q, width, a->out, width, a->keys, a->values, a->head_stride, a->heads, a->kv_heads,
                a->head_dim, &a->how, a->scratch + thread * attention_scratch(a->max_keys), a->max_keys, thread,
                threads);
}

/* Each row's attention over its own keys in one layer's cache (the keys and values already written), its scores
 * scaled by `scale` (0: 1 / sqrt(head_dim)), capped softly at `softcap` (0: not), over its last `window` keys (0:
 * all); 0, or -1 when scratch could not be had. */
int sd_attention(const Rows *rows, int heads, int kv_heads, int head_dim, const float *q, const float *keys,
                 const float *values, int64_t head_stride, float *out, float scale, float softcap, int window) {
    int max_keys = 1;
    for (int r = 0; r < rows->n; r++)
        if (rows->n_keys[r] > max_keys) max_keys = rows->n_keys[r];
    Attention a = {rows, heads, kv_heads, head_dim, {scale, softcap, window}, q, keys, values, head_stride, out, NULL,
                   max_keys};
    pthread_mutex_lock(&pass_lock);
    a.scratch = scratch_of((size_t)team_size * attention_scratch(max_keys));
    if (a.scratch) run_team(attention_job, &a);
    pthread_mutex_unlock(&pass_lock);
    return a.scratch ? 0 : -1;
}
