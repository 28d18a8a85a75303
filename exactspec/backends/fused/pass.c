/* The pass: the rows through a model's layers in one call (sd_pass), the team meeting between a layer's phases:
 * each row's norm, the qkv product, its norms and RoPE and cache writes, attention, the output product added to
 * the residual stream, the norm, gate and up, the activation, the down product added. pass_layers is the one copy of
 * them: sd_pass runs it once, sd_draft_chain (chain.c) once per drafted token; and the final norm (sd_final_norm),
 * which the fused runtime's LM head and hidden states read, is the chain's too. */
#include "fused.h"

/* The row's sum of squares in 8 lanes, then the lanes as sum8 adds them (and any last n % 8 in order). */
__attribute__((target("avx2,fma,f16c"))) void rms_norm_row(const float *x, const float *weight, int hidden, float eps,
                                                          float *y) {
    __m256 squares = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= hidden; i += 8) squares = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), squares);
    float total = sum8(squares);
    for (; i < hidden; i++) total += x[i] * x[i];
    float scale = 1.0f / sqrtf(total / hidden + eps);
    for (i = 0; i < hidden; i++) y[i] = weight[i] * (x[i] * scale);
}

__attribute__((target("avx2,fma,f16c"))) static void rope_row(float *v, const float *cos, const float *sin,
                                                             int head_dim) {
    int half_dim = head_dim / 2;
    for (int i = 0; i < half_dim; i++) {
        float a = v[i], b = v[i + half_dim];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half_dim] = b * cos[i + half_dim] + a * sin[i + half_dim];
    }
}

/* The feed-forward block's gate, activated, times its up, in 8 lanes: SiLU g / (1 + e^-g), or GELU's tanh form
 * g (1 + tanh u) / 2 with u = sqrt(2 / pi) (g + 0.044715 g^3) and tanh u = 1 - 2 / (e^2u + 1). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 gated8(__m256 g, __m256 up, int activation) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 a;
    if (activation == GELU_TANH) {
        __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                                 _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(g, _mm256_mul_ps(g, g)))));
        __m256 tanh_u = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(exp8(_mm256_add_ps(u, u)), one)));
        a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, tanh_u));
    } else {
        a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    }
    return _mm256_mul_ps(a, up);
}

/* mid[j] = act(gate[j]) up[j] for j in [b, e), 8 at a time (a last part of fewer through the same lanes). */
__attribute__((target("avx2,fma,f16c"))) static void gate_row(const float *gate, const float *up, float *mid, int b,
                                                             int e, int activation) {
    int j = b;
    for (; j + 8 <= e; j += 8)
        _mm256_storeu_ps(mid + j, gated8(_mm256_loadu_ps(gate + j), _mm256_loadu_ps(up + j), activation));
    if (j < e) STORE_PART(mid + j, e - j, gated8(LOAD_PART(gate + j, e - j), LOAD_PART(up + j, e - j), activation));
}

/* Rows' outputs y [n, hidden] of a block added to the residual stream x, each RMS-normed first where `norm` is
 * given (gemma's); the rows this member adds, as the others do theirs. */
__attribute__((target("avx2,fma,f16c"))) static void add_normed(const float *norm, float *y, float *x, int hidden,
                                                               float eps, int n, int thread, int threads) {
    for (int r = thread; r < n; r += threads) {
        float *out = y + (int64_t)r * hidden, *row = x + (int64_t)r * hidden;
        rms_norm_row(out, norm, hidden, eps, out);
        for (int i = 0; i < hidden; i++) row[i] += out[i];
    }
}

/* A block's output product (outputs [b, e) of this member) added to the residual stream p->x; where the block's
 * output is normed first (`norm`), the product goes to p->h and each row is normed, then added, after the team
 * meets. Ends at a barrier. */
static void residual(const Matrix *matrix, const float *norm, const float *input, int ldx, Pass *p, int b, int e,
                     int thread, int threads, int *sense) {
    int n = p->rows->n, hidden = p->m->hidden;
    product(matrix, input, ldx, n, b, e, norm ? p->h : p->x, hidden, norm ? STORE : ADD);
    team_barrier(threads, sense);
    if (!norm) return;
    add_normed(norm, p->h, p->x, hidden, p->m->eps, n, thread, threads);
    team_barrier(threads, sense);
}

void pass_layers(Pass *p, int thread, int threads, int *sense) {
    const Model *m = p->m;
    const Rows *rows = p->rows;
    int n = rows->n, hidden = m->hidden, hd = m->head_dim, inter = m->inter;
    int q_width = m->heads * hd, qkv_width = (m->heads + 2 * m->kv_heads) * hd;
    float *scores = p->scores + (int64_t)thread * p->scores_stride;
    int b, e;
    for (int li = p->first; li < p->end; li++) {
        const Layer *layer = &m->layer[li];
        for (int r = thread; r < n; r += threads)
            rms_norm_row(p->x + (int64_t)r * hidden, layer->input_norm, hidden, m->eps, p->h + (int64_t)r * hidden);
        team_barrier(threads, sense);
        share(qkv_width, 8, thread, threads, &b, &e);
        product(&layer->qkv, p->h, hidden, n, b, e, p->qkv, qkv_width, STORE);
        team_barrier(threads, sense);
        const float *cos_table = layer->rope == ROPE_LOCAL ? p->cache->local_cos : p->cache->cos;
        const float *sin_table = layer->rope == ROPE_LOCAL ? p->cache->local_sin : p->cache->sin;
        for (int r = thread; r < n; r += threads) {
            float *row = p->qkv + (int64_t)r * qkv_width;
            const float *cos = cos_table + (int64_t)rows->rope[r] * hd, *sin = sin_table + (int64_t)rows->rope[r] * hd;
            if (layer->q_norm) /* and k_norm: runtime.py sets both or neither */
                for (int head = 0; head < m->heads + m->kv_heads; head++)
                    rms_norm_row(row + head * hd, head < m->heads ? layer->q_norm : layer->k_norm, hd, m->eps,
                                 row + head * hd);
            if (layer->rope != ROPE_NONE)
                for (int head = 0; head < m->heads + m->kv_heads; head++) rope_row(row + head * hd, cos, sin, hd);
            for (int kv = 0; kv < m->kv_heads; kv++) {
                int64_t at = rows->base[r] + kv * p->cache->head_stride + (int64_t)rows->column[r] * hd;
                memcpy(p->cache->keys[li] + at, row + q_width + kv * hd, hd * sizeof(float));
                memcpy(p->cache->values[li] + at, row + q_width + (m->kv_heads + kv) * hd, hd * sizeof(float));
            }
        }
        team_barrier(threads, sense);
        Scoring how = {m->attn_scale, m->attn_softcap, layer->window};
        attend_rows(rows, p->qkv, qkv_width, p->attended, q_width, p->cache->keys[li], p->cache->values[li],
                    p->cache->head_stride, m->heads, m->kv_heads, hd, &how, scores, p->max_keys, thread, threads);
        team_barrier(threads, sense);
        share(hidden, 8, thread, threads, &b, &e);
        residual(&layer->out, layer->attn_out_norm, p->attended, q_width, p, b, e, thread, threads, sense);
        for (int r = thread; r < n; r += threads)
            rms_norm_row(p->x + (int64_t)r * hidden, layer->post_norm, hidden, m->eps, p->h + (int64_t)r * hidden);
        team_barrier(threads, sense);
        share(inter, 8, thread, threads, &b, &e); /* gate and up for the same units, then SiLU(gate) * up */
        product(&layer->gate_up, p->h, hidden, n, b, e, p->act, 2 * inter, STORE);
        product(&layer->gate_up, p->h, hidden, n, inter + b, inter + e, p->act, 2 * inter, STORE);
        for (int r = 0; r < n; r++) {
            const float *row = p->act + (int64_t)r * 2 * inter;
            gate_row(row, row + inter, p->mid + (int64_t)r * inter, b, e, m->activation);
        }
        team_barrier(threads, sense);
        share(hidden, 8, thread, threads, &b, &e);
        residual(&layer->down, layer->ffn_out_norm, p->mid, inter, p, b, e, thread, threads, sense);
    }
}

static void pass_job(void *arg, int thread, int threads) {
    if (thread >= threads) return;
    int sense = atomic_load(&barrier_sense);
    pass_layers((Pass *)arg, thread, threads, &sense);
}

size_t pass_floats(const Model *m, int n, int max_keys) {
    int qkv_width = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return (size_t)n * (m->hidden + qkv_width + m->heads * m->head_dim + 3 * m->inter) +
           (size_t)team_size * attention_scratch(max_keys);
}

void pass_scratch(Pass *p, float *scratch, int n, int max_keys) {
    const Model *m = p->m;
    p->scores_stride = attention_scratch(max_keys);
    p->max_keys = max_keys;
    p->h = scratch;
    p->qkv = p->h + (size_t)n * m->hidden;
    p->attended = p->qkv + (size_t)n * (m->heads + 2 * m->kv_heads) * m->head_dim;
    p->act = p->attended + (size_t)n * m->heads * m->head_dim;
    p->mid = p->act + (size_t)n * 2 * m->inter;
    p->scores = p->mid + (size_t)n * m->inter;
}

/* The rows through layers [first, end); x [n, hidden] holds their embeddings, then their residual stream. Returns
 * 0, or -1 when scratch could not be had. */
int sd_pass(const Model *m, const Cache *cache, const Rows *rows, float *x, int first, int end) {
    int n = rows->n, max_keys = 1;
    for (int r = 0; r < n; r++)
        if (rows->n_keys[r] > max_keys) max_keys = rows->n_keys[r];
    Pass p = {.m = m, .cache = cache, .rows = rows, .x = x, .first = first, .end = end};
    pthread_mutex_lock(&pass_lock);
    float *scratch = scratch_of(pass_floats(m, n, max_keys));
    if (!scratch) {
        pthread_mutex_unlock(&pass_lock);
        return -1;
    }
    pass_scratch(&p, scratch, n, max_keys);
    atomic_store(&scratch_failed, 0);
    run_team(pass_job, &p);
    int failed = atomic_load(&scratch_failed);
    pthread_mutex_unlock(&pass_lock);
    return failed ? -1 : 0;
}

/* y [n, hidden] = the model's final norm of the rows x [n, hidden] (y may be x): what the fused runtime's LM head and
 * its kept hidden states read, normed as the chain (chain.c) norms its rows. */
void sd_final_norm(const Model *m, const float *x, int n, float *y) {
    for (int r = 0; r < n; r++)
        rms_norm_row(x + (int64_t)r * m->hidden, m->final_norm, m->hidden, m->eps, y + (int64_t)r * m->hidden);
}
