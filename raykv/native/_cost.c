/* raykv.native._cost: the routing cost model's decision loop (raykv.routing.policy.decide_at) in C.
 *
 * A routing decision scores every candidate worker (queue + what it would prefill or pull + the
 * duplicate price), drops those past the load guard and takes the cheapest, ties broken by the
 * caller's RNG. In Python this loop, run cold between requests, was most of a decision's time.
 *
 * decide(num_tokens, workers, loads, matches, weights, prices, rng, decision_type[, charges]) ->
 * Decision or None. `workers` and `loads` are lists of one length (loads: floats or ints), `matches` a dict
 * worker -> RouteMatch (tuples of 6: worker, blocks, gpu, host, disk, predicted; ints),
 * `weights` the tuple (w_gpu, w_host, w_disk, w_predicted, tokens_per_block, prefill_cost,
 * imbalance_factor, allow_pulls), `prices` (duplicate, pull, slack), `rng` an object with
 * choice(list) (called only for a tie), `decision_type` the Decision NamedTuple class, `charges`
 * None or the tuple (totals, scale, holder, excess): a dict worker -> float and a float, a worker
 * or None and a float, adding scale x totals[worker] (0 when absent), plus excess for holder, to a
 * candidate's cost after the load guard judged `loads`. It returns
 * what decide_at returns, float for float (the same operations in the same order, in doubles; the
 * extension is built without floating-point contraction), or None when an argument is not of
 * these exact kinds (the caller then runs the Python loop, which raises what it raises).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#define MAX_WORKERS 4096

typedef struct {
    double wg, wh, wd, wp, tpb, pc, factor;
    long tpb_int;
    int pulls;
} Weights;

static int read_weights(PyObject *w, Weights *out) {
    if (!PyTuple_CheckExact(w) || PyTuple_GET_SIZE(w) != 8) return -1;
    double *d[] = {&out->wg, &out->wh, &out->wd, &out->wp};
    for (int k = 0; k < 4; k++) {
        *d[k] = PyFloat_AsDouble(PyTuple_GET_ITEM(w, k));
        if (*d[k] == -1.0 && PyErr_Occurred()) return -1;
    }
    out->tpb_int = PyLong_AsLong(PyTuple_GET_ITEM(w, 4));
    out->pc = PyFloat_AsDouble(PyTuple_GET_ITEM(w, 5));
    out->factor = PyFloat_AsDouble(PyTuple_GET_ITEM(w, 6));
    out->pulls = PyObject_IsTrue(PyTuple_GET_ITEM(w, 7));
    if (PyErr_Occurred() || out->pulls < 0) return -1;
    out->tpb = (double)out->tpb_int;
    return 0;
}

/* A match's 5 ints (blocks, gpu, host, disk, predicted); -1 when it is not a 6-tuple of ints. */
static int read_match(PyObject *m, long v[5]) {
    if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 6) return -1;
    for (int k = 0; k < 5; k++) {
        PyObject *x = PyTuple_GET_ITEM(m, k + 1);
        if (!PyLong_CheckExact(x)) return -1;
        v[k] = PyLong_AsLong(x);
        if (v[k] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* The worker holding the longest prefix (the first such in the dict's order) and its length. */
static int best_of(PyObject *matches, PyObject **holder, long *blocks) {
    Py_ssize_t pos = 0;
    PyObject *k, *m;
    *holder = NULL;
    *blocks = 0;
    while (PyDict_Next(matches, &pos, &k, &m)) {
        long v[5];
        if (read_match(m, v) < 0) return -1;
        if (v[0] > *blocks) *holder = k, *blocks = v[0];
    }
    return 0;
}

static int same(PyObject *a, PyObject *b) { return a == b ? 1 : b ? PyObject_RichCompareBool(a, b, Py_EQ) : 0; }

typedef struct {
    PyObject *totals; /* dict worker -> float, or NULL: no charges */
    double scale, excess;
    PyObject *holder; /* charged the excess (NULL: none) */
} Charges;

/* The charges tuple (totals, scale, holder, excess), or None: 0, or -1 (fall back). */
static int read_charges(PyObject *c, Charges *out) {
    out->totals = out->holder = NULL;
    out->scale = out->excess = 0.0;
    if (c == Py_None) return 0;
    if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 4 || !PyDict_CheckExact(PyTuple_GET_ITEM(c, 0))) return -1;
    out->totals = PyTuple_GET_ITEM(c, 0);
    out->scale = PyFloat_AsDouble(PyTuple_GET_ITEM(c, 1));
    out->holder = PyTuple_GET_ITEM(c, 2) == Py_None ? NULL : PyTuple_GET_ITEM(c, 2);
    out->excess = PyFloat_AsDouble(PyTuple_GET_ITEM(c, 3));
    return PyErr_Occurred() ? -1 : 0;
}

/* What `charges` adds to `worker`'s cost: 0, or -1 (fall back). */
static int charge_of(const Charges *c, PyObject *worker, double *out) {
    PyObject *t = PyDict_GetItemWithError(c->totals, worker);
    if (!t && PyErr_Occurred()) return -1;
    if (t && !PyFloat_CheckExact(t)) return -1;
    double charge = c->scale * (t ? PyFloat_AS_DOUBLE(t) : 0.0);
    int is_holder = same(worker, c->holder);
    if (is_holder < 0) return -1;
    if (is_holder) charge += c->excess;
    *out = charge;
    return 0;
}

typedef struct {
    PyObject *costs;  /* list of (worker, cost) */
    double low;
    int kept;         /* the best holder passed the guard */
} Scored;

/* Score every candidate under the guard's limit (decide_at's loop). 0, or -1 (fall back). */
static int score(long num_tokens, PyObject *workers, const double *loads, PyObject *matches, const Weights *w,
                 double extra, double limit, PyObject *holder, long best, const Charges *ch, Scored *out) {
    Py_ssize_t n = PyList_GET_SIZE(workers);
    long left_none = num_tokens - w->tpb_int * best;
    out->low = INFINITY;
    out->kept = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (loads[i] > limit) continue;
        PyObject *worker = PyList_GET_ITEM(workers, i);
        int is_best = same(worker, holder);
        if (is_best < 0) return -1;
        out->kept |= is_best;
        PyObject *m = PyDict_GetItemWithError(matches, worker);
        if (!m && PyErr_Occurred()) return -1;
        double left;
        long more;
        if (!m) {
            left = (double)left_none;
            more = best;
        } else {
            long v[5];
            if (read_match(m, v) < 0) return -1;
            left = (double)num_tokens -
                   w->tpb * (w->wg * (double)v[1] + w->wh * (double)v[2] + w->wd * (double)v[3] + w->wp * (double)v[4]);
            more = best > v[0] ? best - v[0] : 0;
            left -= (double)(w->tpb_int * more);
        }
        double cost = (left > 0 ? w->pc * left : 0.0) + extra * (double)more + loads[i];
        if (ch->totals) {
            double charge;
            if (charge_of(ch, worker, &charge) < 0) return -1;
            cost += charge;
        }
        PyObject *c = Py_BuildValue("(Od)", worker, cost);
        if (!c || PyList_Append(out->costs, c) < 0) {
            Py_XDECREF(c);
            return -1;
        }
        Py_DECREF(c);
        if (cost < out->low) out->low = cost;
    }
    return 0;
}

/* The winner among `costs` within 1e-9 of the lowest (rng.choice for a tie): a new reference. */
static PyObject *winner(PyObject *costs, double low, PyObject *rng) {
    double top = low + 1e-9;
    PyObject *ties = PyList_New(0);
    if (!ties) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(costs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PyList_GET_ITEM(costs, i);
        if (PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(c, 1)) <= top && PyList_Append(ties, c) < 0) {
            Py_DECREF(ties);
            return NULL;
        }
    }
    PyObject *out = PyList_GET_SIZE(ties) == 1 ? Py_NewRef(PyList_GET_ITEM(ties, 0))
                                               : PyObject_CallMethod(rng, "choice", "O", ties);
    Py_DECREF(ties);
    return out;
}

static PyObject *build(PyTypeObject *type, PyObject *won, PyObject *costs, PyObject *from, long pull, long dup,
                       long own) {
    PyObject *items = PyList_AsTuple(costs);
    if (!items) return NULL;
    PyObject *d = type->tp_alloc(type, 7);
    if (!d) {
        Py_DECREF(items);
        return NULL;
    }
    PyObject *vals[7] = {Py_NewRef(PyTuple_GET_ITEM(won, 0)), Py_NewRef(PyTuple_GET_ITEM(won, 1)),
                         PyLong_FromLong(own), Py_NewRef(from), PyLong_FromLong(pull), items, PyLong_FromLong(dup)};
    for (int k = 0; k < 7; k++) {
        if (!vals[k]) {
            for (int j = k; j < 7; j++) Py_XDECREF(vals[j]);
            Py_DECREF(d);
            return NULL;
        }
        PyTuple_SET_ITEM(d, k, vals[k]);
    }
    return d;
}

static PyObject *decide(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 && nargs != 9) return PyErr_Format(PyExc_TypeError, "decide() takes 8 or 9 arguments");
    PyObject *workers = args[1], *loadlist = args[2], *matches = args[3], *prices = args[5], *rng = args[6];
    PyTypeObject *type = (PyTypeObject *)args[7];
    if (!PyLong_CheckExact(args[0]) || !PyList_CheckExact(workers) || !PyList_CheckExact(loadlist) ||
        !PyDict_CheckExact(matches) || !PyTuple_Check(prices) || PyTuple_GET_SIZE(prices) != 3 ||
        !PyType_Check(args[7]) || !PyType_IsSubtype(type, &PyTuple_Type))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(workers);
    if (n < 1 || n > MAX_WORKERS || PyList_GET_SIZE(loadlist) != n) Py_RETURN_NONE;
    Weights w;
    Charges ch;
    double loads[MAX_WORKERS], floor = INFINITY;
    long num_tokens = PyLong_AsLong(args[0]);
    double dup = PyFloat_AsDouble(PyTuple_GET_ITEM(prices, 0)), pull = PyFloat_AsDouble(PyTuple_GET_ITEM(prices, 1));
    double slack = PyFloat_AsDouble(PyTuple_GET_ITEM(prices, 2));
    if (PyErr_Occurred() || read_weights(args[4], &w) < 0 || read_charges(nargs == 9 ? args[8] : Py_None, &ch) < 0)
        goto fallback;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(loadlist, i);
        if (!PyFloat_CheckExact(x) && !PyLong_CheckExact(x)) Py_RETURN_NONE;
        loads[i] = PyFloat_AsDouble(x);
        if (loads[i] == -1.0 && PyErr_Occurred()) goto fallback;
        if (isnan(loads[i])) Py_RETURN_NONE;
        if (loads[i] < floor) floor = loads[i];
    }
    double guard = w.factor * floor + slack, limit = floor > guard ? floor : guard;
    PyObject *holder;
    long best;
    if (best_of(matches, &holder, &best) < 0) goto fallback;
    double extra = w.tpb * (w.pulls ? w.pc * pull : w.pc + dup);
    Scored s = {PyList_New(0), 0, 0};
    if (!s.costs) return NULL;
    if (score(num_tokens, workers, loads, matches, &w, extra, limit, holder, best, &ch, &s) < 0 ||
        !PyList_GET_SIZE(s.costs)) {
        Py_DECREF(s.costs);
        goto fallback;
    }
    PyObject *won = winner(s.costs, s.low, rng), *out = NULL;
    if (!won) goto done;
    PyObject *m = PyDict_GetItemWithError(matches, PyTuple_GET_ITEM(won, 0));
    long v[5] = {0};
    int is_best = same(PyTuple_GET_ITEM(won, 0), holder);
    if ((m == NULL && PyErr_Occurred()) || is_best < 0 || (m && read_match(m, v) < 0)) goto done;
    long own = v[0], more = best > own && !is_best ? best - own : 0;
    if (w.pulls)
        out = build(type, won, s.costs, more && holder ? holder : Py_None, more, 0, own);
    else
        out = build(type, won, s.costs, Py_None, 0, s.kept ? more : 0, own);
done:
    Py_XDECREF(won);
    Py_DECREF(s.costs);
    return out;
fallback:
    PyErr_Clear();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decide", (PyCFunction)(void (*)(void))decide, METH_FASTCALL,
     "decide(num_tokens, workers, loads, matches, weights, prices, rng, decision_type[, charges]) -> Decision or "
     "None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "raykv.native._cost", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cost(void) { return PyModule_Create(&module); }
