/*
 * The fragmentation-aware policy's inner loop, compiled: the index entries of node classes for one
 * claim shape (engine.Placer._fgd_entry with _fgd_own, _fgd_eval, _fragb, _fluid, _gvec, _sv, _mf
 * and, under the fragmentation-aware GPU policy, _gpu_choice).
 *
 * Why: placement scores each node class that changed for every claim shape asked since, about 30
 * evaluations per claim on openb's mix. In Python one evaluation costs several microseconds of
 * interpreter work around a few multiplications; that, not the messaging, kept the placement
 * service below 2,000 claims/s with the default policy. This file does the same arithmetic in the
 * same order on the same Python memo tables, so its entries are bit for bit those of the Python
 * engine (tests/placement/test_compiled_core.py compares them over thousands of mixed claims and
 * releases). What defines the model rather than scoring it (whether a claim fits a GPU state, a GPU
 * state's vectors, the state after a share, GPU choices under other GPU policies) is asked of the
 * Python that defines it. The Python engine stays the reference and runs where this did not build.
 *
 * What the model is measured against and remembers for the current mix (thresholds, kind groups,
 * memo tables) is one object, the placer's `tables` (fragtables.FragTables); this file reads its
 * fields by the names interned at the bottom, and calls back into the placer only for the Python
 * that defines the model.
 *
 * Floating point: compiled with -ffp-contract=off (no fused multiply-add), so every product and sum
 * is rounded as CPython rounds it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

static PyObject *BY_BUCKET, *NO_FIT;
static Py_ssize_t FCACHE_CAP = 120000, CACHE_CAP = 64;
static PyObject *s_cpu_free, *s_mem_free, *s_cpu_total, *s_devs, *s_cache, *s_id, *s_own_key, *s_kc,
    *s_km, *s_fmemo, *s_gmemo, *s_gcache, *s_svec, *s_mfit, *s_mfl, *s_cpu, *s_hostmem, *s_gshape,
    *s_parts, *s_gpu_probe, *s_gpu_choice, *s_stv, *s_pgpus, *s_state_vec,
    *s_fleet, *s_states, *s_after_map, *s_after, *s_fit, *s_fits, *s_gpus, *s_cores, *s_memory_mib,
    *s_memory_percent, *s_free, *s_tables, *s_canon;

/* Everything one call needs from the placer and the claim shape (borrowed unless noted). */
typedef struct {
    PyObject *placer, *d, *gpol, *gshape;
    PyObject *tables; /* the placer's FragTables (new reference): what follows is read from it */
    PyObject *own_key, *fmemo, *gmemo, *gcache, *svec, *mfit, *parts, *mfl; /* new references */
    long long *kc, *km;
    Py_ssize_t nkc, nkm;
    long long cpu, hostmem;
    int fluid;
    /* the GPU choice (fragmentation-aware GPU policy only): */
    int fgd_gpus;                          /* gpu_policy is "fragmentation-aware" */
    PyObject *states, *after, *states_obj; /* DeviceStates.states, ._after, the DeviceStates (new refs) */
    PyObject *fit;                         /* the demand's state id -> fits cache (new ref) */
    long long k, mem_mib, mem_pct, cores;  /* gpus; memory MiB or -1; percent or -1; cores */
} Ctx;

static int as_ll(PyObject *o, long long *out) {
    if (!o)
        return -1;
    *out = PyLong_AsLongLong(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int attr_ll(PyObject *obj, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    int rc = as_ll(v, out);
    Py_XDECREF(v);
    return rc;
}

/* An int attribute that may be None (then `none`). */
static int attr_ll_or(PyObject *obj, PyObject *name, long long none, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    int rc;
    if (!v)
        return -1;
    *out = none;
    rc = v == Py_None ? 0 : as_ll(v, out);
    Py_DECREF(v);
    return rc;
}

/* A list of ints as a C array (the kinds' CPU or memory thresholds, sorted). */
static int ll_array(PyObject *tables, PyObject *name, long long **out, Py_ssize_t *n) {
    PyObject *seq = PyObject_GetAttr(tables, name), *fast;
    if (!seq)
        return -1;
    fast = PySequence_Fast(seq, "thresholds must be a sequence");
    Py_DECREF(seq);
    if (!fast)
        return -1;
    *n = PySequence_Fast_GET_SIZE(fast);
    *out = PyMem_Malloc(sizeof(long long) * (*n ? *n : 1));
    if (!*out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (as_ll(PySequence_Fast_GET_ITEM(fast, i), &(*out)[i]) < 0) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static Py_ssize_t bisect_right(const long long *a, Py_ssize_t n, long long x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < a[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* engine.Placer._gvec: (U, fsv) of GPU states G, the free capacity and per kind group what the
 * group can use (None if none can), computed from the per-state vectors and kept in the cache. */
static PyObject *gvec_build(PyObject *placer, PyObject *tables, PyObject *G) {
    PyObject *stv = NULL, *gcache = NULL, *pgpus = NULL, *fsv = NULL, *gi = NULL;
    double U = 0.0, *fs = NULL;
    long long *ns = NULL;
    int any = 0;
    if (!PyTuple_Check(G)) {
        PyErr_SetString(PyExc_TypeError, "GPU states must be a tuple");
        return NULL;
    }
    if (!(stv = PyObject_GetAttr(tables, s_stv)) || !(gcache = PyObject_GetAttr(tables, s_gcache))
        || !(pgpus = PyObject_GetAttr(tables, s_pgpus)))
        goto out;
    if (!PyDict_Check(stv) || !PyDict_Check(gcache) || !PyTuple_Check(pgpus)) {
        PyErr_SetString(PyExc_TypeError, "the tables' state vectors and capacity must be dicts, group_gpus a tuple");
        goto out;
    }
    Py_ssize_t ng = PyTuple_GET_SIZE(pgpus), n = PyTuple_GET_SIZE(G);
    fs = PyMem_Calloc(ng ? ng : 1, sizeof(double));
    ns = PyMem_Calloc(ng ? ng : 1, sizeof(long long));
    if (!fs || !ns) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *st = PyTuple_GET_ITEM(G, i), *v = PyDict_GetItemWithError(stv, st);
        if (v)
            Py_INCREF(v);
        else if (PyErr_Occurred() || !(v = PyObject_CallMethodObjArgs(placer, s_state_vec, st, NULL)))
            goto out;
        PyObject *fv = PyTuple_GET_ITEM(v, 1), *cv = PyTuple_GET_ITEM(v, 2);
        Py_ssize_t m = PyTuple_GET_SIZE(fv) < ng ? PyTuple_GET_SIZE(fv) : ng;
        U += PyFloat_AsDouble(PyTuple_GET_ITEM(v, 0));
        for (Py_ssize_t j = 0; j < m; j++) {
            fs[j] += PyFloat_AsDouble(PyTuple_GET_ITEM(fv, j));
            ns[j] += PyLong_AsLongLong(PyTuple_GET_ITEM(cv, j));
        }
        Py_DECREF(v);
        if (PyErr_Occurred())
            goto out;
    }
    if (!(fsv = PyTuple_New(ng)))
        goto out;
    for (Py_ssize_t j = 0; j < ng; j++) {
        long long g = PyLong_AsLongLong(PyTuple_GET_ITEM(pgpus, j));
        double f = ns[j] >= g ? fs[j] : 0.0;
        PyObject *x = PyFloat_FromDouble(f);
        if (!x || PyErr_Occurred()) {
            Py_XDECREF(x);
            goto out;
        }
        any |= f != 0.0;
        PyTuple_SET_ITEM(fsv, j, x);
    }
    {
        PyObject *u = PyFloat_FromDouble(U);
        if (!u)
            goto out;
        gi = PyTuple_Pack(2, u, any ? fsv : Py_None);
        Py_DECREF(u);
    }
    if (gi) {
        if (PyDict_GET_SIZE(gcache) >= FCACHE_CAP)
            PyDict_Clear(gcache);
        if (PyDict_SetItem(gcache, G, gi) < 0)
            Py_CLEAR(gi);
    }
out:
    PyMem_Free(fs);
    PyMem_Free(ns);
    Py_XDECREF(fsv);
    Py_XDECREF(stv);
    Py_XDECREF(gcache);
    Py_XDECREF(pgpus);
    return gi;
}

static PyObject *gvec(Ctx *c, PyObject *G) {
    PyObject *gi = PyDict_GetItemWithError(c->gcache, G);
    if (gi) {
        Py_INCREF(gi);
        return gi;
    }
    if (PyErr_Occurred())
        return NULL;
    return gvec_build(c->placer, c->tables, G);
}

/* A tuple of C integers (the memo keys' bucket parts). */
static PyObject *int_tuple(Py_ssize_t n, const Py_ssize_t *v, PyObject *const *head, Py_ssize_t nhead) {
    PyObject *t = PyTuple_New(nhead + n);
    if (!t)
        return NULL;
    for (Py_ssize_t i = 0; i < nhead; i++) {
        Py_INCREF(head[i]);
        PyTuple_SET_ITEM(t, i, head[i]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromSsize_t(v[i]);
        if (!x) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, nhead + i, x);
    }
    return t;
}

static PyObject *bucket_pair(Py_ssize_t a, Py_ssize_t b) {
    Py_ssize_t v[2] = {a, b};
    return int_tuple(2, v, NULL, 0);
}

/* engine.Placer._sv: per kind group, the weight of its members that fit at buckets (bc, bm). */
static PyObject *sv_build(Ctx *c, PyObject *key, Py_ssize_t bc, Py_ssize_t bm) {
    Py_ssize_t ng = PyList_GET_SIZE(c->parts);
    PyObject *sv = PyTuple_New(ng);
    if (!sv)
        return NULL;
    for (Py_ssize_t g = 0; g < ng; g++) {
        PyObject *members = PyTuple_GET_ITEM(PyList_GET_ITEM(c->parts, g), 1), *x;
        double acc = 0.0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(members); i++) {
            PyObject *t = PyList_GET_ITEM(members, i);
            if (bc > PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 0)) && bm > PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1)))
                acc += PyFloat_AsDouble(PyTuple_GET_ITEM(t, 2));
        }
        if (PyErr_Occurred() || !(x = PyFloat_FromDouble(acc))) {
            Py_DECREF(sv);
            return NULL;
        }
        PyTuple_SET_ITEM(sv, g, x);
    }
    if (PyDict_SetItem(c->svec, key, sv) < 0)
        Py_CLEAR(sv);
    return sv;
}

/* engine.Placer._mf: the kinds _fluid counts at (bc, bm), (beta, group, weight, weight / beta). */
static PyObject *mf_build(Ctx *c, PyObject *key, Py_ssize_t bc, Py_ssize_t bm) {
    PyObject *mf = PyList_New(0);
    if (!mf)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(c->mfl); i++) {
        PyObject *t = PyList_GET_ITEM(c->mfl, i); /* (beta, group, cpu bucket, memory bucket, weight) */
        if (!(bc > PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 2)) && bm > PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 3))))
            continue;
        double beta = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 0)), p = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 4));
        PyObject *pb = PyErr_Occurred() ? NULL : PyFloat_FromDouble(p / beta), *e;
        if (!pb) {
            Py_DECREF(mf);
            return NULL;
        }
        e = PyTuple_Pack(4, PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1), PyTuple_GET_ITEM(t, 4), pb);
        Py_DECREF(pb);
        if (!e || PyList_Append(mf, e) < 0) {
            Py_XDECREF(e);
            Py_DECREF(mf);
            return NULL;
        }
        Py_DECREF(e);
    }
    if (PyErr_Occurred() || PyDict_SetItem(c->mfit, key, mf) < 0)
        Py_CLEAR(mf);
    return mf;
}

/* table[(bc, bm)], built by `build` (which stores it) on a miss. New reference. */
static PyObject *per_buckets(Ctx *c, PyObject *table, Py_ssize_t bc, Py_ssize_t bm,
                             PyObject *(*build)(Ctx *, PyObject *, Py_ssize_t, Py_ssize_t)) {
    PyObject *key = bucket_pair(bc, bm), *v;
    if (!key)
        return NULL;
    v = PyDict_GetItemWithError(table, key);
    if (v)
        Py_INCREF(v);
    else if (!PyErr_Occurred())
        v = build(c, key, bc, bm);
    Py_DECREF(key);
    return v;
}

/* engine.Placer._fragb */
static int fragb(Ctx *c, PyObject *G, Py_ssize_t bc, Py_ssize_t bm, double *out) {
    PyObject *gi = gvec(c, G), *fsv, *sv;
    if (!gi)
        return -1;
    double U = PyFloat_AsDouble(PyTuple_GET_ITEM(gi, 0));
    fsv = PyTuple_GET_ITEM(gi, 1);
    if (fsv == Py_None) {
        Py_DECREF(gi);
        *out = U;
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!(sv = per_buckets(c, c->svec, bc, bm, sv_build))) {
        Py_DECREF(gi);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(fsv);
    if (PyTuple_GET_SIZE(sv) < n)
        n = PyTuple_GET_SIZE(sv);
    double dot = 0.0;
    for (Py_ssize_t i = 0; i < n; i++)
        dot += PyFloat_AsDouble(PyTuple_GET_ITEM(fsv, i)) * PyFloat_AsDouble(PyTuple_GET_ITEM(sv, i));
    Py_DECREF(sv);
    Py_DECREF(gi);
    *out = U - dot;
    return PyErr_Occurred() ? -1 : 0;
}

/* engine.Placer._fluid (only called with the host-memory term on) */
static int fluid(Ctx *c, PyObject *G, Py_ssize_t bc, Py_ssize_t bm, long long m, double *out) {
    PyObject *gi = gvec(c, G), *fsv, *mf;
    *out = 0.0;
    if (!gi)
        return -1;
    fsv = PyTuple_GET_ITEM(gi, 1);
    if (fsv == Py_None) {
        Py_DECREF(gi);
        return 0;
    }
    double U = PyFloat_AsDouble(PyTuple_GET_ITEM(gi, 0));
    if (!(mf = per_buckets(c, c->mfit, bc, bm, mf_build))) {
        Py_DECREF(gi);
        return -1;
    }
    double md = (double)m, lim = md / U, frag = 0.0;
    Py_ssize_t n = PyList_GET_SIZE(mf), nf = PyTuple_GET_SIZE(fsv);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(mf, i);
        double beta = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 0));
        if (beta <= lim)
            break;
        Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
        if (j < 0 || j >= nf) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "kind group out of range");
            break;
        }
        double fs = PyFloat_AsDouble(PyTuple_GET_ITEM(fsv, j));
        if (fs * beta > md) {
            double p = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 2)), pb = PyFloat_AsDouble(PyTuple_GET_ITEM(t, 3));
            frag += p * fs - md * pb;
        }
    }
    Py_DECREF(mf);
    Py_DECREF(gi);
    *out = frag;
    return PyErr_Occurred() ? -1 : 0;
}

/* engine._q9: to the nearest 1e-9 with plain IEEE operations, as the Python does it. */
static PyObject *q9(double x) {
    return PyFloat_FromDouble(floor(x * 1e9 + 0.5) / 1e9);
}

/* engine._tied: the score's resolution, engine.TIE_STEPS (keep the two equal). */
#define TIE_STEPS 40.0
static PyObject *tied(double x) {
    return PyFloat_FromDouble(floor(x * TIE_STEPS + 0.5) / TIE_STEPS);
}

/* --- the GPU choice: engine.Placer._gpu_choice / _choose_gpus, fragmentation-aware GPU policy --- */

static PyObject *state_of(Ctx *c, PyObject *sid) { /* borrowed */
    Py_ssize_t i = PyLong_AsSsize_t(sid);
    if (i < 0 || i >= PyList_GET_SIZE(c->states)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_IndexError, "unknown GPU state");
        return NULL;
    }
    return PyList_GET_ITEM(c->states, i);
}

static int state_double(Ctx *c, PyObject *sid, PyObject *name, double *out) {
    PyObject *st = state_of(c, sid), *v;
    if (!st || !(v = PyObject_GetAttr(st, name)))
        return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* Demand.fits on a state id, through the demand's own cache: 1, 0 or -1. */
static int fits(Ctx *c, PyObject *sid) {
    PyObject *r = PyDict_GetItemWithError(c->fit, sid);
    int v;
    if (r)
        return PyObject_IsTrue(r);
    if (PyErr_Occurred())
        return -1;
    PyObject *st = state_of(c, sid);
    if (!st || !(r = PyObject_CallMethodObjArgs(c->d, s_fits, st, NULL)))
        return -1;
    v = PyObject_IsTrue(r);
    Py_DECREF(r);
    return v;
}

/* DeviceStates.after(sid, Demand.mem_req(card memory), cores): a new reference to the state id. */
static PyObject *after_of(Ctx *c, PyObject *sid) {
    long long card, mem;
    PyObject *st = state_of(c, sid), *key, *ns;
    if (!st || attr_ll(st, s_memory_mib, &card) < 0)
        return NULL;
    mem = c->mem_mib >= 0 ? c->mem_mib : c->mem_pct >= 0 ? card * c->mem_pct / 100 : card;
    /* (floor division as Python's //: operands are not negative here) */
    if (!(key = Py_BuildValue("(OLL)", sid, mem, c->cores)))
        return NULL;
    ns = PyDict_GetItemWithError(c->after, key);
    if (ns) {
        Py_INCREF(ns);
    } else if (!PyErr_Occurred()) {
        ns = PyObject_CallMethodObjArgs(c->states_obj, s_after, PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(key, 1),
                                        PyTuple_GET_ITEM(key, 2), NULL);
    }
    Py_DECREF(key);
    return ns;
}

/* A sorted tuple of the state ids in `cur` (a list). */
static PyObject *sorted_tuple(PyObject *cur) {
    PyObject *copy = PyList_GetSlice(cur, 0, PyList_GET_SIZE(cur)), *t;
    if (!copy)
        return NULL;
    if (PyList_Sort(copy) < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    t = PyList_AsTuple(copy);
    Py_DECREF(copy);
    return t;
}

static int fragb(Ctx *c, PyObject *G, Py_ssize_t bc, Py_ssize_t bm, double *out);

/* (positions, states after, GPU left), NO_FIT or, with `probe`, BY_BUCKET. New reference. */
static PyObject *gpu_choice(Ctx *c, PyObject *devs, Py_ssize_t bc2, Py_ssize_t bm2, int probe) {
    Py_ssize_t n = PyTuple_GET_SIZE(devs), nfit = 0, k = (Py_ssize_t)c->k;
    Py_ssize_t *fitting = NULL;
    PyObject *cur = NULL, *positions = NULL, *after = NULL, *result = NULL;
    int distinct = 0;
    if (k <= 0) {
        positions = PyTuple_New(0);
        after = devs;
        Py_INCREF(after);
        goto left;
    }
    if (!(fitting = PyMem_Malloc(sizeof(Py_ssize_t) * (n ? n : 1))))
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        int f = fits(c, PyTuple_GET_ITEM(devs, i));
        if (f < 0)
            goto out;
        if (f) {
            if (nfit && PyObject_RichCompareBool(PyTuple_GET_ITEM(devs, i), PyTuple_GET_ITEM(devs, fitting[0]), Py_NE) == 1)
                distinct = 1;
            fitting[nfit++] = i;
        }
    }
    if (nfit < k) {
        Py_INCREF(NO_FIT);
        result = NO_FIT;
        goto out;
    }
    if (distinct && probe) {
        Py_INCREF(BY_BUCKET);
        result = BY_BUCKET;
        goto out;
    }
    if (!(cur = PySequence_List(devs)) || !(positions = PyTuple_New(k)))
        goto out;
    if (!distinct) { /* identical candidates: the first k, in order */
        for (Py_ssize_t j = 0; j < k; j++) {
            Py_ssize_t i = fitting[j];
            PyObject *ns = after_of(c, PyList_GET_ITEM(cur, i)), *pos;
            if (!ns)
                goto out;
            PyList_SetItem(cur, i, ns);
            if (!(pos = PyLong_FromSsize_t(i)))
                goto out;
            PyTuple_SET_ITEM(positions, j, pos);
        }
    } else { /* one GPU at a time, the one whose trial leaves the least fragmentation */
        for (Py_ssize_t j = 0; j < k; j++) {
            Py_ssize_t best = -1, bi = -1;
            double bf = 0.0, bfree = 0.0;
            PyObject *bns = NULL;
            for (Py_ssize_t a = 0; a < nfit; a++) {
                Py_ssize_t i = fitting[a];
                if (i < 0)
                    continue; /* taken */
                PyObject *sid = PyList_GET_ITEM(cur, i);
                int dup = 0;
                for (Py_ssize_t b = 0; b < a && !dup; b++) { /* the same state tried already */
                    if (fitting[b] >= 0) {
                        int eq = PyObject_RichCompareBool(PyList_GET_ITEM(cur, fitting[b]), sid, Py_EQ);
                        if (eq < 0)
                            goto trial_fail;
                        dup = eq;
                    }
                }
                if (dup)
                    continue;
                PyObject *ns = after_of(c, sid), *trial, *G;
                double fr, free;
                if (!ns)
                    goto trial_fail;
                if (!(trial = PyList_GetSlice(cur, 0, n))) {
                    Py_DECREF(ns);
                    goto trial_fail;
                }
                Py_INCREF(ns);
                PyList_SetItem(trial, i, ns);
                G = sorted_tuple(trial);
                Py_DECREF(trial);
                if (!G || fragb(c, G, bc2, bm2, &fr) < 0 || state_double(c, ns, s_free, &free) < 0) {
                    Py_XDECREF(G);
                    Py_DECREF(ns);
                    goto trial_fail;
                }
                Py_DECREF(G);
                fr = floor(fr * 1e9 + 0.5) / 1e9; /* (engine._q9, as the Python rounds it) */
                int first = best < 0 || fr < bf || (fr == bf && free < bfree);
                if (!first && fr == bf && free == bfree) { /* ties on the state itself (engine) */
                    PyObject *a_st = state_of(c, ns), *b_st = state_of(c, bns), *ak = NULL, *bk = NULL;
                    if (a_st && b_st && (ak = PyObject_GetAttr(a_st, s_canon)) && (bk = PyObject_GetAttr(b_st, s_canon)))
                        first = PyObject_RichCompareBool(ak, bk, Py_LT);
                    Py_XDECREF(ak);
                    Py_XDECREF(bk);
                    if (!a_st || !b_st || !ak || !bk || first < 0) {
                        Py_DECREF(ns);
                        goto trial_fail;
                    }
                }
                if (first) {
                    best = a;
                    bi = i;
                    bf = fr;
                    bfree = free;
                    Py_XSETREF(bns, ns);
                } else {
                    Py_DECREF(ns);
                }
            }
            if (best < 0) {
                PyErr_SetString(PyExc_RuntimeError, "no GPU left to choose");
                goto trial_fail;
            }
            PyList_SetItem(cur, bi, bns); /* steals bns */
            fitting[best] = -1;
            PyObject *pos = PyLong_FromSsize_t(bi);
            if (!pos)
                goto out;
            PyTuple_SET_ITEM(positions, j, pos);
            continue;
        trial_fail:
            Py_XDECREF(bns);
            goto out;
        }
    }
    if (!(after = sorted_tuple(cur)))
        goto out;
left: {
    double left = 0.0, f;
    if (!positions)
        goto out;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(after); i++) {
        if (state_double(c, PyTuple_GET_ITEM(after, i), s_free, &f) < 0)
            goto out;
        left += f;
    }
    PyObject *l = PyFloat_FromDouble(left);
    if (l) {
        result = PyTuple_Pack(3, positions, after, l);
        Py_DECREF(l);
    }
}
out:
    PyMem_Free(fitting);
    Py_XDECREF(cur);
    Py_XDECREF(positions);
    Py_XDECREF(after);
    return result;
}

/* engine.Placer._fgd_eval: (delta, GPU left, positions, states after) or None. New reference. */
static PyObject *fgd_eval(Ctx *c, PyObject *devs, Py_ssize_t bc, Py_ssize_t bc2, Py_ssize_t bm,
                          Py_ssize_t bm2) {
    PyObject *gk = PyTuple_Pack(3, c->gshape, c->gpol, devs), *g, *result = NULL;
    if (!gk)
        return NULL;
    PyObject *b2 = PyLong_FromSsize_t(bc2), *m2 = PyLong_FromSsize_t(bm2);
    if (!b2 || !m2)
        goto out0;
    g = PyDict_GetItemWithError(c->gmemo, gk);
    if (g && g != Py_None) {
        Py_INCREF(g);
    } else if (PyErr_Occurred()) {
        goto out0;
    } else if (c->fgd_gpus) {
        if (!(g = gpu_choice(c, devs, bc2, bm2, 1)))
            goto out0;
        if (PyDict_GET_SIZE(c->gmemo) >= FCACHE_CAP)
            PyDict_Clear(c->gmemo);
        if (PyDict_SetItem(c->gmemo, gk, g) < 0) {
            Py_DECREF(g);
            goto out0;
        }
    } else {
        g = PyObject_CallMethodObjArgs(c->placer, s_gpu_probe, gk, devs, b2, m2, c->d, c->gpol, NULL);
        if (!g)
            goto out0;
    }
    if (g == BY_BUCKET) {
        Py_DECREF(g);
        g = c->fgd_gpus ? gpu_choice(c, devs, bc2, bm2, 0)
                        : PyObject_CallMethodObjArgs(c->placer, s_gpu_choice, devs, b2, m2, c->d, c->gpol, Py_False, NULL);
        if (!g)
            goto out0;
    }
    if (g == NO_FIT) {
        Py_DECREF(g);
        Py_INCREF(Py_None);
        result = Py_None;
        goto out0;
    }
    {
        PyObject *positions = PyTuple_GET_ITEM(g, 0), *after = PyTuple_GET_ITEM(g, 1), *left = PyTuple_GET_ITEM(g, 2);
        double fa, fb;
        if (fragb(c, after, bc2, bm2, &fa) == 0 && fragb(c, devs, bc, bm, &fb) == 0) {
            PyObject *delta = q9(fa - fb);
            if (delta)
                result = PyTuple_Pack(4, delta, left, positions, after);
            Py_XDECREF(delta);
        }
    }
    Py_DECREF(g);
out0:
    Py_XDECREF(b2);
    Py_XDECREF(m2);
    Py_DECREF(gk);
    return result;
}

/* engine.Placer._fgd_own: (CPU bucket, memory bucket, own host-memory term), kept in the class cache. */
static PyObject *own_build(Ctx *c, PyObject *cls, PyObject *cache, PyObject *devs, long long cf, long long mf) {
    Py_ssize_t v[2] = {bisect_right(c->kc, c->nkc, cf), bisect_right(c->km, c->nkm, mf)};
    double fl = 0.0;
    PyObject *own, *x;
    (void)cls;
    if (c->fluid && fluid(c, devs, v[0], v[1], mf, &fl) < 0)
        return NULL;
    if (!(own = int_tuple(2, v, NULL, 0)))
        return NULL;
    if (!(x = PyFloat_FromDouble(fl)) || _PyTuple_Resize(&own, 3) < 0) {
        Py_XDECREF(x);
        Py_XDECREF(own);
        return NULL;
    }
    PyTuple_SET_ITEM(own, 2, x);
    if (PyDict_GET_SIZE(cache) >= CACHE_CAP)
        PyDict_Clear(cache);
    if (PyDict_SetItem(cache, c->own_key, own) < 0)
        Py_CLEAR(own);
    return own;
}

/* engine.Placer._fgd_entry for one class: 1 and *entry set, 0 (does not fit), -1 (error). */
static int entry_of(Ctx *c, PyObject *cls, PyObject **entry) {
    long long cf, mf, ct;
    PyObject *devs = NULL, *cache = NULL, *own = NULL, *key = NULL, *r = NULL, *cid = NULL;
    int rc = -1;
    *entry = NULL;
    if (attr_ll(cls, s_cpu_free, &cf) < 0 || attr_ll(cls, s_mem_free, &mf) < 0)
        return -1;
    if (c->cpu > cf || c->hostmem > mf)
        return 0;
    if (attr_ll(cls, s_cpu_total, &ct) < 0)
        return -1;
    if (!(devs = PyObject_GetAttr(cls, s_devs)) || !(cache = PyObject_GetAttr(cls, s_cache)))
        goto out;
    own = PyDict_GetItemWithError(cache, c->own_key);
    if (own) {
        Py_INCREF(own);
    } else if (PyErr_Occurred() || !(own = own_build(c, cls, cache, devs, cf, mf))) {
        goto out;
    }
    Py_ssize_t bc = PyLong_AsSsize_t(PyTuple_GET_ITEM(own, 0)), bm = PyLong_AsSsize_t(PyTuple_GET_ITEM(own, 1));
    double before = PyFloat_AsDouble(PyTuple_GET_ITEM(own, 2));
    if (PyErr_Occurred())
        goto out;
    Py_ssize_t bc2 = bisect_right(c->kc, c->nkc, cf - c->cpu), bm2 = bisect_right(c->km, c->nkm, mf - c->hostmem);
    {
        Py_ssize_t v[4] = {bc, bc2, bm, bm2};
        PyObject *head[3] = {c->gshape, c->gpol, devs};
        key = int_tuple(4, v, head, 3);
    }
    if (!key)
        goto out;
    r = PyDict_GetItemWithError(c->fmemo, key);
    if (r) {
        Py_INCREF(r);
    } else if (PyErr_Occurred()) {
        goto out;
    } else {
        r = fgd_eval(c, devs, bc, bc2, bm, bm2);
        if (!r)
            goto out;
        if (PyDict_GET_SIZE(c->fmemo) >= FCACHE_CAP)
            PyDict_Clear(c->fmemo);
        if (PyDict_SetItem(c->fmemo, key, r) < 0)
            goto out;
    }
    if (r == Py_None) {
        rc = 0;
        goto out;
    }
    PyObject *delta;
    if (c->fluid) {
        double fl;
        if (fluid(c, PyTuple_GET_ITEM(r, 3), bc2, bm2, mf - c->hostmem, &fl) < 0)
            goto out;
        delta = tied(PyFloat_AsDouble(PyTuple_GET_ITEM(r, 0)) + fl - before);
    } else {
        delta = tied(PyFloat_AsDouble(PyTuple_GET_ITEM(r, 0)));
    }
    if (!delta)
        goto out;
    if (!(cid = PyObject_GetAttr(cls, s_id))) {
        Py_DECREF(delta);
        goto out;
    }
    PyObject *ratio = PyFloat_FromDouble((double)(cf - c->cpu) / (double)(ct ? ct : 1));
    if (ratio) {
        *entry = PyTuple_Pack(6, delta, PyTuple_GET_ITEM(r, 1), ratio, cid, cls, PyTuple_GET_ITEM(r, 2));
        Py_DECREF(ratio);
    }
    Py_DECREF(delta);
    rc = *entry ? 1 : -1;
out:
    Py_XDECREF(devs);
    Py_XDECREF(cache);
    Py_XDECREF(own);
    Py_XDECREF(key);
    Py_XDECREF(r);
    Py_XDECREF(cid);
    return rc;
}

static void ctx_free(Ctx *c) {
    Py_XDECREF(c->states);
    Py_XDECREF(c->after);
    Py_XDECREF(c->states_obj);
    Py_XDECREF(c->fit);
    Py_XDECREF(c->own_key);
    Py_XDECREF(c->fmemo);
    Py_XDECREF(c->gmemo);
    Py_XDECREF(c->gcache);
    Py_XDECREF(c->svec);
    Py_XDECREF(c->mfit);
    Py_XDECREF(c->parts);
    Py_XDECREF(c->mfl);
    Py_XDECREF(c->tables);
    PyMem_Free(c->kc);
    PyMem_Free(c->km);
}

static PyObject *entries(PyObject *self, PyObject *args) {
    PyObject *classes, *out, *it, *cls;
    Ctx c = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOO!:entries", &c.placer, &classes, &c.d, &c.gpol, &PyList_Type, &out))
        return NULL;
    if (!(c.tables = PyObject_GetAttr(c.placer, s_tables)))
        goto fail;
    if (!(c.own_key = PyObject_GetAttr(c.tables, s_own_key)) || !(c.fmemo = PyObject_GetAttr(c.tables, s_fmemo))
        || !(c.gmemo = PyObject_GetAttr(c.tables, s_gmemo)) || !(c.gcache = PyObject_GetAttr(c.tables, s_gcache))
        || !(c.svec = PyObject_GetAttr(c.tables, s_svec)) || !(c.mfit = PyObject_GetAttr(c.tables, s_mfit)))
        goto fail;
    if (!PyDict_Check(c.fmemo) || !PyDict_Check(c.gmemo) || !PyDict_Check(c.gcache) || !PyDict_Check(c.svec)
        || !PyDict_Check(c.mfit)) {
        PyErr_SetString(PyExc_TypeError, "the fragmentation tables' memos must be dicts");
        goto fail;
    }
    if (ll_array(c.tables, s_kc, &c.kc, &c.nkc) < 0 || ll_array(c.tables, s_km, &c.km, &c.nkm) < 0)
        goto fail;
    if (attr_ll(c.d, s_cpu, &c.cpu) < 0 || attr_ll(c.d, s_hostmem, &c.hostmem) < 0)
        goto fail;
    if (!(c.gshape = PyObject_GetAttr(c.d, s_gshape)))
        goto fail;
    Py_DECREF(c.gshape); /* held by d for the call */
    c.fgd_gpus = PyUnicode_Check(c.gpol) && PyUnicode_CompareWithASCIIString(c.gpol, "fragmentation-aware") == 0;
    if (c.fgd_gpus) {
        PyObject *fleet = PyObject_GetAttr(c.placer, s_fleet);
        if (!fleet)
            goto fail;
        c.states_obj = PyObject_GetAttr(fleet, s_states);
        Py_DECREF(fleet);
        if (!c.states_obj || !(c.states = PyObject_GetAttr(c.states_obj, s_states))
            || !(c.after = PyObject_GetAttr(c.states_obj, s_after_map)) || !(c.fit = PyObject_GetAttr(c.d, s_fit)))
            goto fail;
        if (!PyList_Check(c.states) || !PyDict_Check(c.after) || !PyDict_Check(c.fit)) {
            PyErr_SetString(PyExc_TypeError, "device states must be a list, their caches dicts");
            goto fail;
        }
        if (attr_ll(c.d, s_gpus, &c.k) < 0 || attr_ll(c.d, s_cores, &c.cores) < 0)
            goto fail;
        if (attr_ll_or(c.d, s_memory_mib, -1, &c.mem_mib) < 0 || attr_ll_or(c.d, s_memory_percent, -1, &c.mem_pct) < 0)
            goto fail;
    }
    if (!(c.mfl = PyObject_GetAttr(c.tables, s_mfl)) || !(c.parts = PyObject_GetAttr(c.tables, s_parts)))
        goto fail;
    if (!PyList_Check(c.mfl) || !PyList_Check(c.parts)) {
        PyErr_SetString(PyExc_TypeError, "the tables' hungry kinds and kind groups must be lists");
        goto fail;
    }
    c.fluid = PyList_GET_SIZE(c.mfl) > 0;
    if (!(it = PyObject_GetIter(classes)))
        goto fail;
    while ((cls = PyIter_Next(it))) {
        PyObject *e;
        int rc = entry_of(&c, cls, &e);
        Py_DECREF(cls);
        if (rc < 0 || (rc > 0 && PyList_Append(out, e) < 0)) {
            Py_XDECREF(e);
            Py_DECREF(it);
            goto fail;
        }
        Py_XDECREF(e);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        goto fail;
    ctx_free(&c);
    Py_RETURN_NONE;
fail:
    ctx_free(&c);
    return NULL;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *by_bucket, *no_fit;
    Py_ssize_t cap, class_cap;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnn:configure", &by_bucket, &no_fit, &cap, &class_cap))
        return NULL;
    CACHE_CAP = class_cap;
    Py_INCREF(by_bucket);
    Py_INCREF(no_fit);
    Py_XSETREF(BY_BUCKET, by_bucket);
    Py_XSETREF(NO_FIT, no_fit);
    FCACHE_CAP = cap;
    Py_RETURN_NONE;
}

static PyObject *gvec_py(PyObject *self, PyObject *args) {
    PyObject *placer, *G, *gi, *gcache, *tables;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO:gvec", &placer, &G))
        return NULL;
    if (!(tables = PyObject_GetAttr(placer, s_tables)))
        return NULL;
    if (!(gcache = PyObject_GetAttr(tables, s_gcache))) {
        Py_DECREF(tables);
        return NULL;
    }
    gi = PyDict_Check(gcache) ? PyDict_GetItemWithError(gcache, G) : NULL;
    Py_XINCREF(gi);
    Py_DECREF(gcache);
    if (!gi && !PyErr_Occurred())
        gi = gvec_build(placer, tables, G);
    Py_DECREF(tables);
    return gi;
}

static PyMethodDef methods[] = {
    {"gvec", gvec_py, METH_VARARGS,
     "gvec(placer, G): engine.Placer._gvec compiled, (free capacity, per kind group usable or None)"},
    {"configure", configure, METH_VARARGS,
     "configure(by_bucket, no_fit, memo_cap, class_cache_cap): the engine's sentinels and cache size limits"},
    {"entries", entries, METH_VARARGS,
     "entries(placer, classes, demand, gpu_policy, out): append to `out` the fragmentation-aware index "
     "entry of each class that can host `demand` (engine.Placer._fgd_entry, compiled)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fgdcore",
                                    "The fragmentation-aware policy's inner loop, compiled.", -1, methods};

PyMODINIT_FUNC PyInit__fgdcore(void) {
#define INTERN(var, text) \
    if (!(var = PyUnicode_InternFromString(text))) \
        return NULL;
    INTERN(s_cpu_free, "cpu_free") INTERN(s_mem_free, "mem_free") INTERN(s_cpu_total, "cpu_total")
    INTERN(s_devs, "devs") INTERN(s_cache, "cache") INTERN(s_id, "id") INTERN(s_own_key, "own_key")
    /* the fragmentation tables' fields (engine.FragTables) */
    INTERN(s_tables, "tables") INTERN(s_kc, "cpu_steps") INTERN(s_km, "mem_steps") INTERN(s_fmemo, "entry_memo")
    INTERN(s_gmemo, "gpu_memo") INTERN(s_gcache, "capacity") INTERN(s_svec, "group_weights")
    INTERN(s_mfit, "hungry_at") INTERN(s_mfl, "hungry")
    INTERN(s_cpu, "cpu") INTERN(s_hostmem, "hostmem") INTERN(s_gshape, "gshape")
    INTERN(s_parts, "groups") INTERN(s_gpu_probe, "_gpu_probe")
    INTERN(s_gpu_choice, "_gpu_choice") INTERN(s_stv, "state_vectors") INTERN(s_pgpus, "group_gpus") INTERN(s_state_vec, "_state_vec")
    INTERN(s_fleet, "fleet") INTERN(s_states, "states") INTERN(s_after_map, "_after") INTERN(s_after, "after")
    INTERN(s_fit, "_fit") INTERN(s_fits, "fits") INTERN(s_gpus, "gpus") INTERN(s_cores, "cores")
    INTERN(s_memory_mib, "memory_mib") INTERN(s_memory_percent, "memory_percent") INTERN(s_free, "free") INTERN(s_canon, "canon")
#undef INTERN
    Py_INCREF(Py_None);
    BY_BUCKET = Py_None;
    Py_INCREF(Py_None);
    NO_FIT = Py_None;
    return PyModule_Create(&module);
}
