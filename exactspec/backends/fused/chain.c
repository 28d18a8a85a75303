/* A draft model's whole chain in one call (sd_draft_chain): k tokens drafted autoregressively without returning to
 * Python between them. The first pass feeds the lead, the context's tokens the cache lacks (its last at least: the
 * tokens a round accepted, which a separate pass would cost as much again as a draft step), as rows of one pass;
 * each drafted token then is one row through the layers (pass.c's pass_layers, the code sd_pass runs), the
 * final norm, the LM head's product over all its rows (product.c's, as sd_product computes it), and the choice among
 * those rows: the greedy argmax, or the invariant sampler's Gumbel-max over noise the caller made; the chosen row's
 * token embedding is the next row's input, one cache column on. So every key, value and logit is the bits a pass
 * over the lead and then one-row passes write and read (each row is computed as it is alone), and the token each
 * depth chooses is the one Python's choice over those logits gives (exactspec.sampling: argmax; invariant_choice
 * for top-k 0 and top-p 1).
 *
 * The head's rows are a draft vocabulary: row r stands for token ids[r] (ascending) and embed[r] is that token's
 * embedding as the runtime embeds it (a full vocabulary: every id; a draft-grade model's head: the ids it kept). What
 * comes back is small: the k tokens, and per depth the ids the head ranks next (a token tree's alternatives). */
#include "fused.h"

#define MOST_RANKED 16 /* the chosen and its alternatives a depth ranks at most (exactspec's MAX_TREE_WIDTH) */
#define MOST_LEAD 64    /* the most rows the first pass feeds (exactspec's CHAIN_LEAD is fewer) */

/* A head row's logit, or its scaled logit plus noise, and the row: what the members compare. */
typedef struct {
    double value;
    int row;
} Scored;

/* Whether a beats b: the larger value, a NaN above any number (torch.argmax's and torch.topk's order); between
 * equals, the lower row (the members scan their rows upwards, and their shares are merged in row order). */
static int beats(double a, double b) { return a > b || (isnan(a) && !isnan(b)); }

/* Put (value, row) into the ranking `top` of `*count` entries (at most `most`), best first, after any it ties. */
static void rank_in(Scored *top, int *count, int most, double value, int row) {
    int at = *count;
    while (at > 0 && beats(value, top[at - 1].value)) at--;
    if (at >= most) return;
    int last = *count < most ? *count : most - 1;
    memmove(top + at + 1, top + at, (size_t)(last - at) * sizeof(Scored));
    top[at] = (Scored){value, row};
    if (*count < most) ++*count;
}

typedef struct {
    Pass pass;             /* the lead's rows, then one row a depth: x their residual stream */
    Rows rows;             /* the rows' places: lead row r at column start + r, the token drafted at depth d fed at
                            * column start + lead + d - 1, each attending the columns before it and itself */
    int32_t rope[MOST_LEAD], column[MOST_LEAD], n_keys[MOST_LEAD];
    int64_t base[MOST_LEAD];
    int start, lead, k, alternatives, head_rows;
    const int32_t *ids;    /* [head_rows] the token each head row stands for */
    const float *embed;    /* [head_rows, hidden] their embeddings */
    const double *noise;   /* [k, head_rows] Gumbel noise per depth, or NULL: greedy */
    const uint8_t *allowed; /* [head_rows] the rows it may choose (a draft among the tokens a target holds), or NULL */
    float temperature;
    float *normed, *logits; /* [hidden]: the last row after the final norm; [head_rows]: its logits */
    float *hidden_out;     /* [lead + k - 1, hidden]: each fed row's normed state kept, or NULL */
    int32_t *drafted;      /* [k] */
    int32_t *ranked;       /* [k, alternatives] */
    /* each member's results over its share of the head's rows, merged in member order */
    float maxima[MAX_THREADS];
    Scored best[MAX_THREADS];
    Scored top[MAX_THREADS][MOST_RANKED];
    int tops[MAX_THREADS];
} Chain;

/* This member's best row of [b, e) by the choice's value: the logit when greedy; else, as exactspec.sampling's
 * scaled_logits and gumbel_choice compute it, the logit less the row's maximum `most`, divided by the temperature in
 * float32 (kept 0 where the shift is 0), plus the depth's noise in float64. */
static Scored chosen_in(const Chain *c, const double *noise, float most, int b, int e) {
    Scored best = {-INFINITY, -1};
    for (int row = b; row < e; row++) {
        if (c->allowed && !c->allowed[row]) continue;
        double value = c->logits[row];
        if (noise) {
            float shifted = c->logits[row] - most;
            float scaled = shifted == 0.0f ? shifted : shifted / c->temperature;
            value = (double)scaled + noise[row];
        }
        if (best.row < 0 || beats(value, best.value)) best = (Scored){value, row};
    }
    return best;
}

/* Member 0, once the members' results are in: the depth's token and alternatives from them, and the next pass's
 * one row: its input (the chosen row's embedding) and place. */
static void choose(Chain *c, int depth, int threads) {
    Scored best = {0.0, -1}, top[MOST_RANKED];
    int count = 0, most = c->alternatives + 1;
    for (int t = 0; t < threads; t++)
        if (c->best[t].row >= 0 && (best.row < 0 || beats(c->best[t].value, best.value))) best = c->best[t];
    c->drafted[depth] = c->ids[best.row];
    for (int t = 0; t < threads; t++)
        for (int j = 0; j < c->tops[t]; j++) rank_in(top, &count, most, c->top[t][j].value, c->top[t][j].row);
    int32_t *ranked = c->ranked + (int64_t)depth * c->alternatives;
    for (int j = 0, kept = 0; j < count && kept < c->alternatives; j++)
        if (top[j].row != best.row) ranked[kept++] = c->ids[top[j].row];
    int hidden = c->pass.m->hidden;
    memcpy(c->pass.x, c->embed + (int64_t)best.row * hidden, hidden * sizeof(float));
    c->rows.n = 1;
    c->rope[0] = c->column[0] = c->start + c->lead + depth;
    c->n_keys[0] = c->column[0] + 1;
    c->pass.max_keys = c->n_keys[0];
}

/* Member 0, after a pass: its rows' final norms (kept where asked: the lead's rows at depth 0, one row after), the
 * last one's in c->normed, which the head reads. */
static void normed_rows(Chain *c, int depth) {
    const Model *m = c->pass.m;
    int n = c->rows.n, hidden = m->hidden;
    int64_t kept = depth ? c->lead + depth - 1 : 0; /* hidden_out's row of the pass's first */
    for (int r = c->hidden_out ? 0 : n - 1; r < n; r++)
        rms_norm_row(c->pass.x + (int64_t)r * hidden, m->final_norm, hidden, m->eps,
                     c->hidden_out ? c->hidden_out + (kept + r) * hidden : c->normed);
    if (c->hidden_out) memcpy(c->normed, c->hidden_out + (kept + n - 1) * hidden, hidden * sizeof(float));
}

static void chain_job(void *arg, int thread, int threads) {
    if (thread >= threads) return;
    Chain *c = (Chain *)arg;
    const Model *m = c->pass.m;
    int sense = atomic_load(&barrier_sense), b, e;
    share(c->head_rows, 8, thread, threads, &b, &e); /* this member's head rows, as sd_product shares them */
    for (int depth = 0; depth < c->k; depth++) {
        pass_layers(&c->pass, thread, threads, &sense);
        if (thread == 0) normed_rows(c, depth);
        team_barrier(threads, &sense);
        product(&m->lm_head, c->normed, m->hidden, 1, b, e, c->logits, c->head_rows, STORE);
        const double *noise = c->noise ? c->noise + (int64_t)depth * c->head_rows : NULL;
        float most = -INFINITY; /* the logits' maximum, which sampling shifts them by */
        if (noise) {
            for (int row = b; row < e; row++)
                if (!c->allowed || c->allowed[row]) most = fmaxf(most, c->logits[row]);
            c->maxima[thread] = most;
            team_barrier(threads, &sense);
            for (int t = 0; t < threads; t++) most = fmaxf(most, c->maxima[t]);
        }
        c->best[thread] = chosen_in(c, noise, most, b, e);
        c->tops[thread] = 0;
        if (c->alternatives)
            for (int row = b; row < e; row++)
                if (!c->allowed || c->allowed[row])
                    rank_in(c->top[thread], &c->tops[thread], c->alternatives + 1, c->logits[row], row);
        team_barrier(threads, &sense);
        if (thread == 0) choose(c, depth, threads);
        team_barrier(threads, &sense);
    }
}

/* Draft k tokens after a sequence whose cache holds columns 0..start-1: first [lead, hidden], the embeddings of the
 * lead's tokens, is fed at columns start..start+lead-1 in one pass, and each drafted token but the last after it, so
 * columns start..start+lead+k-2 are written. The head (the model's lm_head) has `head_rows` rows, row r standing for
 * token ids[r], embedded as embed[r] [head_rows, hidden]. noise [k, head_rows] (float64) makes each choice the
 * invariant sampler's Gumbel-max at `temperature`; NULL, the argmax. allowed [head_rows], where not NULL, the rows it
 * may choose and rank (the others as if their logits were -inf: a draft model drafting among the tokens another
 * tokenizer holds); at least one must be. drafted [k] gets the tokens; ranked [k, alternatives] per depth the ids of
 * the `alternatives` rows ranked highest by logit, the chosen left out (fewer: -1 after them); hidden_out
 * [lead + k - 1, hidden], where not NULL, each fed row's final hidden state, normed. Returns 0; -1 when scratch could
 * not be had; -2 for arguments it does not take (lead outside 1..MOST_LEAD, k < 1, alternatives past
 * MOST_RANKED - 1, head_rows not the head's). */
int sd_draft_chain(const Model *m, const Cache *cache, const float *first, int lead, int start, int k,
                   const int32_t *ids, const float *embed, int head_rows, const double *noise, float temperature,
                   const uint8_t *allowed, int alternatives, int32_t *drafted, int32_t *ranked, float *hidden_out) {
    int outputs = 0;
    for (const Matrix *part = &m->lm_head; part; part = part->rest) outputs += part->out;
    if (lead < 1 || lead > MOST_LEAD || k < 1 || alternatives < 0 || alternatives >= MOST_RANKED ||
        head_rows != outputs)
        return -2;
    for (int i = 0; i < k * alternatives; i++) ranked[i] = -1;
    Chain *c = calloc(1, sizeof(Chain));
    if (!c) return -1;
    *c = (Chain){.pass = {.m = m, .cache = cache, .rows = &c->rows, .first = 0, .end = m->layers},
                 .start = start, .lead = lead, .k = k, .alternatives = alternatives, .head_rows = head_rows,
                 .ids = ids, .embed = embed, .noise = noise, .temperature = temperature, .allowed = allowed,
                 .hidden_out = hidden_out, .drafted = drafted, .ranked = ranked};
    for (int r = 0; r < lead; r++) {
        c->rope[r] = c->column[r] = start + r;
        c->n_keys[r] = start + r + 1;
    }
    c->rows = (Rows){.n = lead, .rope = c->rope, .base = c->base, .column = c->column, .n_keys = c->n_keys};
    int most_keys = start + lead + k - 1; /* the last fed row's */
    pthread_mutex_lock(&pass_lock);
    size_t layers = pass_floats(m, lead, most_keys), head = (size_t)m->hidden * (lead + 1) + head_rows;
    float *scratch = scratch_of(layers + head);
    int failed = -1;
    if (scratch) {
        pass_scratch(&c->pass, scratch, lead, most_keys);
        c->pass.max_keys = start + lead; /* the keys the lead's last row attends, as sd_pass would size it */
        c->pass.x = scratch + layers;
        c->normed = c->pass.x + (size_t)lead * m->hidden;
        c->logits = c->normed + m->hidden;
        memcpy(c->pass.x, first, (size_t)lead * m->hidden * sizeof(float));
        atomic_store(&scratch_failed, 0);
        run_team(chain_job, c);
        failed = atomic_load(&scratch_failed) ? -1 : 0;
    }
    pthread_mutex_unlock(&pass_lock);
    free(c);
    return failed;
}
