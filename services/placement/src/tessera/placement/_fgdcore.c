/*
 * The fragmentation-aware policy's inner loop, compiled: the index entries of node classes for one
 * claim shape (engine.Placer._fgd_entry, _fgd_eval, _fragb and _fluid).
 *
 * Why: placement scores each node class that changed for every claim shape asked since, about 30
 * evaluations per claim on openb's mix. In Python one evaluation costs several microseconds of
 * interpreter work around a few multiplications; that, not the messaging, kept the placement
 * service below 2,000 claims/s with the default policy. This file does the same arithmetic in the
 * same order on the same Python memo tables, so its entries are bit for bit those of the Python
 * engine (tests/placement/test_compiled_core.py checks that on openb); whatever is not a plain
 * lookup or sum (a memo miss, the GPU choice, a state's vectors) is handed back to the Python
 * methods that define it. The Python engine stays the reference and runs where this did not build.
 *
 * Floating point: compiled with -ffp-contract=off (no fused multiply-add), so every product and sum
 * is rounded as CPython rounds it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

static PyObject *BY_BUCKET, *NO_FIT;
static Py_ssize_t FCACHE_CAP = 120000;
static PyObject *s_cpu_free, *s_mem_free, *s_cpu_total, *s_devs, *s_cache, *s_id, *s_own_key, *s_kc,
    *s_km, *s_fmemo, *s_gmemo, *s_gcache, *s_svec, *s_mfit, *s_mfl, *s_cpu, *s_hostmem, *s_gshape,
    *s_fgd_own, *s_gpu_probe, *s_gpu_choice, *s_sv, *s_mf, *s_stv, *s_pgpus, *s_state_vec;

/* Everything one call needs from the placer and the claim shape (borrowed unless noted). */
typedef struct {
    PyObject *placer, *d, *gpol, *gshape;
    PyObject *own_key, *fmemo, *gmemo, *gcache, *svec, *mfit; /* new references */
    long long *kc, *km;
    Py_ssize_t nkc, nkm;
    long long cpu, hostmem;
    int fluid;
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

/* A list of ints as a C array (the kinds' CPU or memory thresholds, sorted). */
static int ll_array(PyObject *placer, PyObject *name, long long **out, Py_ssize_t *n) {
    PyObject *seq = PyObject_GetAttr(placer, name), *fast;
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
static PyObject *gvec_build(PyObject *placer, PyObject *G) {
    PyObject *stv = NULL, *gcache = NULL, *pgpus = NULL, *fsv = NULL, *gi = NULL;
    double U = 0.0, *fs = NULL;
    long long *ns = NULL;
    int any = 0;
    if (!PyTuple_Check(G)) {
        PyErr_SetString(PyExc_TypeError, "GPU states must be a tuple");
        return NULL;
    }
    if (!(stv = PyObject_GetAttr(placer, s_stv)) || !(gcache = PyObject_GetAttr(placer, s_gcache))
        || !(pgpus = PyObject_GetAttr(placer, s_pgpus)))
        goto out;
    if (!PyDict_Check(stv) || !PyDict_Check(gcache) || !PyTuple_Check(pgpus)) {
        PyErr_SetString(PyExc_TypeError, "the placer's state vectors must be dicts and a tuple");
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
    return gvec_build(c->placer, G);
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

/* engine.Placer._fragb */
static int fragb(Ctx *c, PyObject *G, Py_ssize_t bc, Py_ssize_t bm, double *out) {
    PyObject *gi = gvec(c, G), *fsv, *key, *sv;
    if (!gi)
        return -1;
    double U = PyFloat_AsDouble(PyTuple_GET_ITEM(gi, 0));
    fsv = PyTuple_GET_ITEM(gi, 1);
    if (fsv == Py_None) {
        Py_DECREF(gi);
        *out = U;
        return PyErr_Occurred() ? -1 : 0;
    }
    key = bucket_pair(bc, bm);
    if (!key) {
        Py_DECREF(gi);
        return -1;
    }
    sv = PyDict_GetItemWithError(c->svec, key);
    if (sv) {
        Py_INCREF(sv);
    } else if (!PyErr_Occurred()) {
        sv = PyObject_CallMethodObjArgs(c->placer, s_sv, PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(key, 1),
                                        NULL);
    }
    Py_DECREF(key);
    if (!sv) {
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
    PyObject *gi = gvec(c, G), *fsv, *key, *mf;
    *out = 0.0;
    if (!gi)
        return -1;
    fsv = PyTuple_GET_ITEM(gi, 1);
    if (fsv == Py_None) {
        Py_DECREF(gi);
        return 0;
    }
    double U = PyFloat_AsDouble(PyTuple_GET_ITEM(gi, 0));
    key = bucket_pair(bc, bm);
    if (!key) {
        Py_DECREF(gi);
        return -1;
    }
    mf = PyDict_GetItemWithError(c->mfit, key);
    if (mf) {
        Py_INCREF(mf);
    } else if (!PyErr_Occurred()) {
        mf = PyObject_CallMethodObjArgs(c->placer, s_mf, PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(key, 1),
                                        NULL);
    }
    Py_DECREF(key);
    if (!mf) {
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
    } else {
        g = PyObject_CallMethodObjArgs(c->placer, s_gpu_probe, gk, devs, b2, m2, c->d, c->gpol, NULL);
        if (!g)
            goto out0;
    }
    if (g == BY_BUCKET) {
        Py_DECREF(g);
        g = PyObject_CallMethodObjArgs(c->placer, s_gpu_choice, devs, b2, m2, c->d, c->gpol, Py_False, NULL);
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
    } else if (PyErr_Occurred() || !(own = PyObject_CallMethodObjArgs(c->placer, s_fgd_own, cls, NULL))) {
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
        delta = q9(PyFloat_AsDouble(PyTuple_GET_ITEM(r, 0)) + fl - before);
        if (!delta)
            goto out;
    } else {
        delta = PyTuple_GET_ITEM(r, 0);
        Py_INCREF(delta);
    }
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
    Py_XDECREF(c->own_key);
    Py_XDECREF(c->fmemo);
    Py_XDECREF(c->gmemo);
    Py_XDECREF(c->gcache);
    Py_XDECREF(c->svec);
    Py_XDECREF(c->mfit);
    PyMem_Free(c->kc);
    PyMem_Free(c->km);
}

static PyObject *entries(PyObject *self, PyObject *args) {
    PyObject *classes, *out, *it, *cls, *mfl;
    Ctx c = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOO!:entries", &c.placer, &classes, &c.d, &c.gpol, &PyList_Type, &out))
        return NULL;
    if (!(c.own_key = PyObject_GetAttr(c.placer, s_own_key)) || !(c.fmemo = PyObject_GetAttr(c.placer, s_fmemo))
        || !(c.gmemo = PyObject_GetAttr(c.placer, s_gmemo)) || !(c.gcache = PyObject_GetAttr(c.placer, s_gcache))
        || !(c.svec = PyObject_GetAttr(c.placer, s_svec)) || !(c.mfit = PyObject_GetAttr(c.placer, s_mfit)))
        goto fail;
    if (!PyDict_Check(c.fmemo) || !PyDict_Check(c.gmemo) || !PyDict_Check(c.gcache) || !PyDict_Check(c.svec)
        || !PyDict_Check(c.mfit)) {
        PyErr_SetString(PyExc_TypeError, "the placer's memo tables must be dicts");
        goto fail;
    }
    if (ll_array(c.placer, s_kc, &c.kc, &c.nkc) < 0 || ll_array(c.placer, s_km, &c.km, &c.nkm) < 0)
        goto fail;
    if (attr_ll(c.d, s_cpu, &c.cpu) < 0 || attr_ll(c.d, s_hostmem, &c.hostmem) < 0)
        goto fail;
    if (!(c.gshape = PyObject_GetAttr(c.d, s_gshape)))
        goto fail;
    Py_DECREF(c.gshape); /* held by d for the call */
    if (!(mfl = PyObject_GetAttr(c.placer, s_mfl)))
        goto fail;
    c.fluid = PyObject_IsTrue(mfl);
    Py_DECREF(mfl);
    if (c.fluid < 0 || !(it = PyObject_GetIter(classes)))
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
    Py_ssize_t cap;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOn:configure", &by_bucket, &no_fit, &cap))
        return NULL;
    Py_INCREF(by_bucket);
    Py_INCREF(no_fit);
    Py_XSETREF(BY_BUCKET, by_bucket);
    Py_XSETREF(NO_FIT, no_fit);
    FCACHE_CAP = cap;
    Py_RETURN_NONE;
}

static PyObject *gvec_py(PyObject *self, PyObject *args) {
    PyObject *placer, *G, *gi, *gcache;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO:gvec", &placer, &G))
        return NULL;
    if (!(gcache = PyObject_GetAttr(placer, s_gcache)))
        return NULL;
    gi = PyDict_Check(gcache) ? PyDict_GetItemWithError(gcache, G) : NULL;
    Py_XINCREF(gi);
    Py_DECREF(gcache);
    if (gi || PyErr_Occurred())
        return gi;
    return gvec_build(placer, G);
}

static PyMethodDef methods[] = {
    {"gvec", gvec_py, METH_VARARGS,
     "gvec(placer, G): engine.Placer._gvec compiled, (free capacity, per kind group usable or None)"},
    {"configure", configure, METH_VARARGS,
     "configure(by_bucket, no_fit, cache_cap): the engine's sentinels and memo size limit"},
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
    INTERN(s_devs, "devs") INTERN(s_cache, "cache") INTERN(s_id, "id") INTERN(s_own_key, "_own_key")
    INTERN(s_kc, "_kc") INTERN(s_km, "_km") INTERN(s_fmemo, "_fmemo") INTERN(s_gmemo, "_gmemo")
    INTERN(s_gcache, "_gcache") INTERN(s_svec, "_svec") INTERN(s_mfit, "_mfit") INTERN(s_mfl, "_mfl")
    INTERN(s_cpu, "cpu") INTERN(s_hostmem, "hostmem") INTERN(s_gshape, "gshape")
    INTERN(s_fgd_own, "_fgd_own") INTERN(s_gpu_probe, "_gpu_probe")
    INTERN(s_gpu_choice, "_gpu_choice") INTERN(s_stv, "_stv") INTERN(s_pgpus, "_pgpus") INTERN(s_state_vec, "_state_vec") INTERN(s_sv, "_sv") INTERN(s_mf, "_mf")
#undef INTERN
    Py_INCREF(Py_None);
    BY_BUCKET = Py_None;
    Py_INCREF(Py_None);
    NO_FIT = Py_None;
    return PyModule_Create(&module);
}
