/* The host route's writes in one call: an engine's step on a CPU pool (attnpool.update.host).
 *
 * On a CPU an engine's metadata build runs between two forwards, on caches the forward has
 * just evicted: what the build costs follows how much code it walks, far more than how many
 * bytes it writes. The general path walks dispatched torch ops per field; this walks one C
 * function per step, which checks every value first and writes only
 * when all are good, so a rejected step leaves the pool as it was (the caller then takes the
 * general path, whose input pass raises the precise error).
 *
 * Every pointer is an int32 buffer of the pool (whose layout the config names) or an int32
 * input of the caller, rows contiguous; the bytes written are the general path's, field by
 * field (tests/update/test_host_route.py compares the whole arena). The module's other C
 * files: slots.c (the step's view, rebound) and tensors.c (what a tensor is), lane.h.
 */
#include "lane.h"
#include <string.h>

/* The static part of a phase's lane (a bytes object of int64 values, made once per phase). */
enum {
    C_MAX_BS, C_MAX_PAGES, C_MAX_LEN, C_PAGE, C_PAD_LEN, C_PAD_PAGE, C_PAD_COLS,
    C_CS, C_CU, C_PT, C_PT_STRIDE,
    C_CU_Q, C_POS, C_POS_SIZE, C_Q_TOTAL,
    C_W_CS, C_W_CU, C_W_PT, C_W_PT_STRIDE, C_W_CAP, C_WINDOW,
    C_SPAN_LO, C_SPAN_HI,
    /* the bound step's rebind (phase_step): the view class's slot offsets of max_seqlen_q,
     * max_seqlen_k and window, and the window part's key bound; 0 until HostLane.first has
     * checked them on a view of the class (the bound step then declines every call) */
    C_OFF_Q, C_OFF_K, C_OFF_W, C_WINDOW_K,
    C_COUNT
};

/* Query row i's length: q holds lengths (offsets == 0) or packed query offsets, flash-attn's
 * cu_seqlens_q (offsets == 1: row i's queries are q[i] .. q[i + 1] - 1). */
static inline int64_t qlen(const int32_t *q, int offsets, int64_t i) {
    return offsets ? (int64_t)q[i + 1] - (int64_t)q[i] : (int64_t)q[i];
}

static int outside(int64_t p, const int64_t *c) {
    return p < c[C_SPAN_LO] || p >= c[C_SPAN_HI];
}

/* Rows of one paged part: lengths, the first w page columns, padded rows, the cumsum. */
static void rows(const int32_t *lens, int64_t n, int64_t bs, const int32_t *table,
                 int64_t ts, int64_t w, int32_t *cs, int32_t *cu, int32_t *pt, int64_t pts,
                 int32_t pad_len, int32_t pad_page, int64_t pad_cols) {
    int64_t acc = 0;
    cu[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        cs[i] = lens[i];
        acc += lens[i];
        cu[i + 1] = (int32_t)acc;
        memcpy(pt + i * pts, table + i * ts, (size_t)w * sizeof(int32_t));
    }
    for (int64_t i = n; i < bs; i++) {
        cs[i] = pad_len;
        acc += pad_len;
        cu[i + 1] = (int32_t)acc;
        for (int64_t k = 0; k < pad_cols; k++) pt[i * pts + k] = pad_page;
    }
}

/* The window part: row i of length L with q queries starts at column
 * floor(max(0, L - q - W + 1) / P) of its table row and reads min(L - shift, cap * P) tokens
 * from the cap columns from there (column numbers clamped into the table). */
static void window(const int64_t *c, const int32_t *lens, const int32_t *q, int offsets, int64_t n,
                   int64_t bs, const int32_t *table, int64_t ts, int64_t cols) {
    int32_t *cs = (int32_t *)(intptr_t)c[C_W_CS], *cu = (int32_t *)(intptr_t)c[C_W_CU];
    int32_t *pt = (int32_t *)(intptr_t)c[C_W_PT];
    int64_t pts = c[C_W_PT_STRIDE], cap = c[C_W_CAP], p = c[C_PAGE], size = c[C_WINDOW];
    int64_t acc = 0;
    cu[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t len = lens[i], first = len - (q ? qlen(q, offsets, i) : 1) - (size - 1);
        int64_t start = first > 0 ? first / p : 0, real = len - start * p;
        if (real > cap * p) real = cap * p;
        if (real < 0) real = 0;
        cs[i] = (int32_t)real;
        acc += real;
        cu[i + 1] = (int32_t)acc;
        for (int64_t k = 0; k < cap; k++) {
            int64_t col = start + k < cols - 1 ? start + k : cols - 1;
            pt[i * pts + k] = table[i * ts + col];
        }
    }
    for (int64_t i = n; i < bs; i++) {
        cs[i] = (int32_t)c[C_PAD_LEN];
        acc += c[C_PAD_LEN];
        cu[i + 1] = (int32_t)acc;
        for (int64_t k = 0; k < c[C_PAD_COLS]; k++) pt[i * pts + k] = (int32_t)c[C_PAD_PAGE];
    }
}

/* The step on the inputs' addresses and sizes: the step's view, or (max_seqlen_q,
 * max_seqlen_k) when base is None, or None (a value the lane does not take: nothing
 * written). qp == 0: a decode step (one query per row); else an extend step's query lengths.
 * The bounds are the phase's: the longest real row (a padded batch: at least the pad length;
 * an extend step's padded batch: its first padded row takes the query slack up to T). base:
 * the phase's sliced view of bs rows, rebound with the bounds (off: see rebind). */
static PyObject *run_step(const int64_t *c, int64_t lp, int64_t n, int64_t bs, int64_t qp,
                          int offsets,
                          int64_t tp, int64_t ts, int64_t trows, int64_t tcols, PyObject *base,
                          const Py_ssize_t *off, long long window_k) {
    if (n < 1 || n > bs || bs > c[C_MAX_BS] || trows < n || tcols < c[C_MAX_PAGES]
        || ts < tcols || !outside(lp, c) || !outside(tp, c) || (qp && !outside(qp, c)))
        Py_RETURN_NONE;
    const int32_t *lens = (const int32_t *)(intptr_t)lp, *q = (const int32_t *)(intptr_t)qp;
    const int32_t *table = (const int32_t *)(intptr_t)tp;
    int64_t longest = 0, max_q = 1, total = n, max_len = c[C_MAX_LEN];
    for (int64_t i = 0; i < n; i++) {
        int64_t len = lens[i];
        if (len < 1 || len > max_len) Py_RETURN_NONE;
        if (len > longest) longest = len;
    }
    if (q) {
        total = 0;
        max_q = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t e = qlen(q, offsets, i);
            if (e < 1 || e > max_len || e > lens[i]) Py_RETURN_NONE;
            total += e;
            if (e > max_q) max_q = e;
        }
        if (total > c[C_Q_TOTAL]) Py_RETURN_NONE;
    }
    /* --- every value checked: writes start here --- */
    int64_t p = c[C_PAGE], w = (longest + p - 1) / p;
    if (w > c[C_MAX_PAGES]) w = c[C_MAX_PAGES];
    rows(lens, n, bs, table, ts, w, (int32_t *)(intptr_t)c[C_CS], (int32_t *)(intptr_t)c[C_CU],
         (int32_t *)(intptr_t)c[C_PT], c[C_PT_STRIDE], (int32_t)c[C_PAD_LEN],
         (int32_t)c[C_PAD_PAGE], c[C_PAD_COLS]);
    if (c[C_WINDOW] > 0) window(c, lens, q, offsets, n, bs, table, ts, tcols);
    if (q) {
        int32_t *cu_q = (int32_t *)(intptr_t)c[C_CU_Q], *pos = (int32_t *)(intptr_t)c[C_POS];
        int64_t acc = 0, t = 0;
        cu_q[0] = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t e = qlen(q, offsets, i), start = lens[i] - e;
            for (int64_t j = 0; j < e; j++) pos[t++] = (int32_t)(start + j);
            acc += e;
            cu_q[i + 1] = (int32_t)acc;
        }
        int64_t pad = acc > c[C_Q_TOTAL] ? acc : c[C_Q_TOTAL];
        for (int64_t i = n; i < bs; i++) cu_q[i + 1] = (int32_t)pad;
        if (t < c[C_POS_SIZE]) memset(pos + t, 0, (size_t)(c[C_POS_SIZE] - t) * sizeof(int32_t));
    }
    int64_t bound_q = max_q, bound_k = longest;
    if (n < bs) {
        if (bound_k < c[C_PAD_LEN]) bound_k = c[C_PAD_LEN];
        if (q && bound_q < c[C_Q_TOTAL] - total) bound_q = c[C_Q_TOTAL] - total;
    }
    if (base == Py_None) return Py_BuildValue("(LL)", (long long)bound_q, (long long)bound_k);
    PyObject *bq = PyLong_FromLongLong(bound_q), *bk = PyLong_FromLongLong(bound_k), *view = NULL;
    if (bq != NULL && bk != NULL) view = lane_rebind_view(base, off, bq, bk, window_k);
    Py_XDECREF(bq);
    Py_XDECREF(bk);
    return view;
}

/* The step (run_step) on the engine's host tensors themselves, read here: taken when every
 * tensor is an int32 CPU torch.Tensor with contiguous rows (q_lens: None for decode, else as
 * many rows as seq_lens) and bs an int; else None, nothing written (as for every value
 * run_step does not take). */
static PyObject *tensors_step(const int64_t *c, PyObject *lens, PyObject *table, PyObject *q,
                              int offsets, PyObject *bs_obj, PyObject *base,
                              const Py_ssize_t *off, long long window_k) {
    if (!PyLong_CheckExact(bs_obj)) Py_RETURN_NONE;
    int overflow = 0;
    long long bs = PyLong_AsLongLongAndOverflow(bs_obj, &overflow);
    if (overflow || (bs == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int64_t lp, n, one, unit, tp, trows, tcols, ts, qp = 0, qn, r;
    if ((r = lane_host_tensor(lens, 1, &lp, &n, &one, &unit)) <= 0
        || (r = lane_host_tensor(table, 2, &tp, &trows, &tcols, &ts)) <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    if (q != Py_None) {
        if ((r = lane_host_tensor(q, 1, &qp, &qn, &one, &unit)) <= 0)
            return r < 0 ? NULL : Py_NewRef(Py_None);
        if (offsets ? qn < n + 1 : qn != n) Py_RETURN_NONE;
    }
    return run_step(c, lp, n, bs, qp, offsets, tp, ts, trows, tcols, base, off, window_k);
}

static int is_config(PyObject *config) {
    return PyBytes_Check(config)
        && PyBytes_GET_SIZE(config) == (Py_ssize_t)(C_COUNT * sizeof(int64_t));
}

/* step_tensors(config, seq_lens, block_table, q, bs, base, offsets, window_k, q_offsets): one
 * step (tensors_step) on the phase's sliced view base (None: the bounds instead of a view); q
 * holds query lengths, or packed query offsets when q_offsets is True. */
static PyObject *step_tensors(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9 || !is_config(args[0])) {
        PyErr_SetString(PyExc_TypeError, "step_tensors(config, seq_lens, block_table, q, "
                                         "bs, base, offsets, window_k, q_offsets)");
        return NULL;
    }
    Py_ssize_t off[3];
    long long window_k;
    if (lane_view_offsets(args[5], args[6], args[7], off, &window_k) < 0) return NULL;
    return tensors_step((const int64_t *)PyBytes_AS_STRING(args[0]), args[1], args[2], args[3],
                        args[8] == Py_True, args[4], args[5], off, window_k);
}

/* A phase's bound step (attnpool.phases.host_lane.HostLane.bind): the state list's items.
 * (The rebind's offsets sit in the config, checked once: a step reads them from the config
 * it reads anyway, on a cold cache one object less to reach.) */
enum {
    S_CONFIG, S_VALIDATE, S_SLICED, S_CLASS, S_OWN, S_GENS, S_REGIONS, S_TAG, S_FALLBACK,
    S_FALLBACK_OFFSETS, S_COUNT
};

/* attnpool.arena.Arena.mark(regions, tag, rows), here: the arena's next generation (its
 * counter), and the record (tag, generation, rows) as the owner of each region. 0, or -1
 * with an error set. */
static int mark(PyObject *own, PyObject *gens, PyObject *regions, PyObject *tag,
                PyObject *rows) {
    if (!PyDict_CheckExact(own) || !PyTuple_Check(regions) || Py_TYPE(gens)->tp_iternext == NULL) {
        PyErr_SetString(PyExc_TypeError, "mark: a dict, a counter and a tuple of regions");
        return -1;
    }
    PyObject *gen = Py_TYPE(gens)->tp_iternext(gens), *rec = NULL;
    int ok = gen != NULL && (rec = PyTuple_Pack(3, tag, gen, rows)) != NULL;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(regions); i++)
        ok = PyDict_SetItem(own, PyTuple_GET_ITEM(regions, i), rec) == 0;
    if (gen == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "mark: the generations ran out");
    Py_XDECREF(gen);
    Py_XDECREF(rec);
    return ok ? 0 : -1;
}

/* phase_step(state, bs, seq_lens, [q_lens,] block_table): a phase's host_step in one call.
 * The state's fallback (the phase's own host_step, which ends on the general path) in
 * validation mode, for a call the step does not take (nothing written) and for a size whose
 * sliced view the rebind does not serve yet; else the step on that view, recorded in the
 * arena as the phase's write. offsets: the queries are packed offsets (phase_step_offsets). */
static PyObject *step_of_phase(PyObject *const *args, Py_ssize_t nargs, int offsets) {
    if ((offsets ? nargs != 5 : (nargs != 4 && nargs != 5)) || !PyList_CheckExact(args[0])
        || PyList_GET_SIZE(args[0]) != S_COUNT || !is_config(PyList_GET_ITEM(args[0], S_CONFIG))) {
        PyErr_SetString(PyExc_TypeError, offsets
                        ? "phase_step_offsets(state, bs, seq_lens, cu_seqlens_q, block_table)"
                        : "phase_step(state, bs, seq_lens, [q_lens,] block_table)");
        return NULL;
    }
    /* (the state's items, borrowed: nothing on the way runs Python code that could change
     * the list, which only HostLane.first and HostLane.validating set; the fallback's call
     * is the last use of them) */
    PyObject *const *item = ((PyListObject *)args[0])->ob_item, *base = NULL, *got = NULL;
    if (item[S_VALIDATE] != Py_False) goto fallback;
    if (item[S_CLASS] != Py_None && PyLong_CheckExact(args[1])) {
        base = PyDict_GetItemWithError(item[S_SLICED], args[1]);
        if (base == NULL && PyErr_Occurred()) goto done;
        Py_XINCREF(base);
    }
    if (base == NULL || (PyObject *)Py_TYPE(base) != item[S_CLASS]) goto fallback;
    const int64_t *c = (const int64_t *)PyBytes_AS_STRING(item[S_CONFIG]);
    /* (checked against the class by HostLane.first, through rebind; the class is base's) */
    const Py_ssize_t off[3] = {(Py_ssize_t)c[C_OFF_Q], (Py_ssize_t)c[C_OFF_K],
                               (Py_ssize_t)c[C_OFF_W]};
    if (off[0] < (Py_ssize_t)sizeof(PyObject)) goto fallback;
    got = tensors_step(c, args[2], args[nargs - 1], nargs == 5 ? args[3] : Py_None, offsets,
                       args[1], base, off, (long long)c[C_WINDOW_K]);
    if (got == Py_None) {
        Py_CLEAR(got);
        goto fallback;
    }
    if (got != NULL && mark(item[S_OWN], item[S_GENS], item[S_REGIONS], item[S_TAG], args[1]) < 0)
        Py_CLEAR(got);
    goto done;
fallback:
    got = PyObject_Vectorcall(item[offsets ? S_FALLBACK_OFFSETS : S_FALLBACK], args + 1,
                              (size_t)(nargs - 1), NULL);
done:
    Py_XDECREF(base);
    return got;
}

static PyObject *phase_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return step_of_phase(args, nargs, 0);
}

/* phase_step_offsets(state, bs, seq_lens, cu_seqlens_q, block_table): phase_step with the
 * queries as packed offsets ([>= n + 1] rows), the state's offsets fallback. */
static PyObject *phase_step_offsets(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return step_of_phase(args, nargs, 1);
}

static PyMethodDef methods[] = {
    {"step_tensors", (PyCFunction)(void (*)(void))step_tensors, METH_FASTCALL,
     "One checked step of a CPU pool's host lane, on the engine's int32 CPU tensors."},
    {"phase_step", (PyCFunction)(void (*)(void))phase_step, METH_FASTCALL,
     "A phase's host_step in one call: the step on its sliced view, recorded in the arena."},
    {"phase_step_offsets", (PyCFunction)(void (*)(void))phase_step_offsets, METH_FASTCALL,
     "phase_step with the queries as packed offsets (cu_seqlens_q)."},
    {"setup", (PyCFunction)(void (*)(void))lane_setup, METH_FASTCALL,
     "Name torch.Tensor and torch.int32 to the step."},
    {"slot_offset", lane_slot_offset, METH_O, "The byte offset of a __slots__ field."},
    {"rebind", (PyCFunction)(void (*)(void))lane_rebind, METH_FASTCALL,
     "A view with new host bounds (attnpool.phases._views.rebound's fields)."},
    {"with_slots", (PyCFunction)(void (*)(void))lane_with_slots, METH_FASTCALL,
     "A copy of a __slots__ object with some slots set (offsets from slot_offset)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lane", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__lane(void) { return PyModule_Create(&module); }
