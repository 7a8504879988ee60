/* rtnb.report()'s hot path in C: record one plain report in the rank's buffer.
 *
 * make_report(fallback, namespace, doc) makes rtnb.report itself a builtin: a call
 * with the metrics alone, on a rank, is recorded as below without entering Python
 * (the Python function's frame and checks were half of what a report cost); every
 * other call, and every report that is not the plain case, goes to ``fallback``.
 *
 * add(runtime, metrics) records ``metrics`` as the next step of ``runtime`` and
 * returns 1, or 2 when the caller must still wake the poll thread or stop at this
 * report (the batch's first report, or a stop was requested); it returns 0, having
 * changed nothing, whenever the report is not the plain case, and the Python path
 * (rtnb/worker/_reporting.py, rtnb/core/_reports.py) then records it. The plain case:
 * a dict with exactly the str keys of the buffer's current run of reports (in any
 * order), no "step" key, every value an exact float, int, str or None, and the rank
 * not replaying or holding an upload error (uploads in flight do not stop it).
 *
 * Nothing here runs Python code or releases the GIL (exact str keys, exact values,
 * list appends), so the whole call is atomic with respect to the rank's other
 * threads: the poll thread swaps the buffer out before or after it, never during.
 * It does not take the buffer's lock; while another thread holds it (inside the
 * Python path) it returns 0, and the caller then waits for the lock there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

/* Wider reports (rare) take the Python path. */
#define MAX_WIDTH 64

static PyObject *s_upload_error, *s_replay, *s_reports, *s_step,
    *s_stop_requested, *s_keys, *s_cols, *s_steps, *s_times, *s_lock, *s_locked,
    *s_current, *s_after, *one;

/* Attribute lookups were half of what a report cost (type lookup, then the
 * instance's dict or a slot descriptor, for a dozen names). Once a type is known to
 * be laid out as expected, the runtime's attributes are read from and written to its
 * instance dict (its type defines no descriptor of those names, so that is exactly
 * what getattr/setattr do), and the buffer's from its slots at their offsets. */
static PyTypeObject *runtime_type, *columns_type;
static Py_ssize_t off_keys, off_cols, off_steps, off_times;

static int slot_offset(PyTypeObject *type, PyObject *name, Py_ssize_t *offset) {
    PyObject *descr = _PyType_Lookup(type, name); /* borrowed */
    if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) return 0;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY)) return 0;
    *offset = member->offset;
    return 1;
}

/* 1 when ``type`` is (now) the known runtime type, 0 when it is not laid out so. */
static int known_runtime(PyTypeObject *type) {
    if (type == runtime_type) return 1;
    if (!(type->tp_flags & Py_TPFLAGS_MANAGED_DICT) && type->tp_dictoffset == 0) return 0;
    PyObject *names[] = {s_upload_error, s_replay, s_reports,
                         s_step,   s_stop_requested, s_lock};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (_PyType_Lookup(type, names[i]) != NULL) return 0;
    Py_INCREF(type);
    Py_XSETREF(runtime_type, type);
    return 1;
}

static int known_columns(PyTypeObject *type) {
    if (type == columns_type) return 1;
    Py_ssize_t keys, cols, steps, times;
    if (!slot_offset(type, s_keys, &keys) || !slot_offset(type, s_cols, &cols) ||
        !slot_offset(type, s_steps, &steps) || !slot_offset(type, s_times, &times))
        return 0;
    off_keys = keys, off_cols = cols, off_steps = steps, off_times = times;
    Py_INCREF(type);
    Py_XSETREF(columns_type, type);
    return 1;
}

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

/* Record one plain report: -1 (an exception is set), 0 (not the plain case; nothing
 * changed), 1 (recorded) or 2 (recorded; wake the poll thread or stop here). */
static int record_plain(PyObject *runtime, PyObject *metrics) {
    if (!PyDict_CheckExact(metrics) || !known_runtime(Py_TYPE(runtime))) return 0;
    /* A "step" metric numbers the report itself: the Python path reads it. */
    PyObject *own_step = PyDict_GetItemWithError(metrics, s_step);
    if (own_step != NULL || PyErr_Occurred()) return own_step ? 0 : -1;
    PyObject *attrs = PyObject_GenericGetDict(runtime, NULL);
    if (attrs == NULL) return -1;
    PyObject *step = NULL, *when = NULL;
    PyObject *found[MAX_WIDTH]; /* borrowed from metrics */
    int result = -1;
    /* Another thread inside the Python path (a second reporting thread, the poll
     * thread swapping the buffer) holds the lock: wait for it there. */
    PyObject *lock = PyDict_GetItemWithError(attrs, s_lock);
    if (lock == NULL) goto missing;
    PyObject *held = PyObject_CallMethodNoArgs(lock, s_locked);
    if (held == NULL) goto done;
    Py_DECREF(held);
    if (held != Py_False) goto plain_no;
    /* Borrowed from here on: nothing below runs Python code until the appends. */
    PyObject *upload_error = PyDict_GetItemWithError(attrs, s_upload_error);
    PyObject *replay = upload_error ? PyDict_GetItemWithError(attrs, s_replay) : NULL;
    PyObject *buffer = replay ? PyDict_GetItemWithError(attrs, s_reports) : NULL;
    PyObject *last = buffer ? PyDict_GetItemWithError(attrs, s_step) : NULL;
    if (last == NULL) goto missing;
    if (upload_error != Py_None || replay != Py_False ||
        !PyLong_CheckExact(last) || !known_columns(Py_TYPE(buffer)))
        goto plain_no;
    /* Work waits at this report (a stop, a hold for a control change, a trigger
     * due): the Python path does it, before or after recording as each needs. */
    PyObject *stop = PyDict_GetItemWithError(attrs, s_stop_requested);
    if (stop == NULL) goto missing;
    if (stop != Py_False) goto plain_no;
    PyObject *keys = SLOT(buffer, off_keys), *cols = SLOT(buffer, off_cols),
             *steps = SLOT(buffer, off_steps), *times = SLOT(buffer, off_times);
    if (keys == NULL || cols == NULL || steps == NULL || times == NULL ||
        !PyTuple_CheckExact(keys) || !PyList_CheckExact(cols) || !PyList_CheckExact(steps) ||
        !PyList_CheckExact(times))
        goto plain_no;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (PyDict_GET_SIZE(metrics) != n || n == 0 || n > MAX_WIDTH || PyList_GET_SIZE(cols) != n)
        goto plain_no;
    /* Every value is checked before any is appended: a report is recorded whole. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(key) || !PyList_CheckExact(PyList_GET_ITEM(cols, i)))
            goto plain_no;
        PyObject *value = PyDict_GetItemWithError(metrics, key); /* borrowed */
        if (value == NULL) {
            if (PyErr_Occurred()) goto done;
            goto plain_no; /* a key of the run is missing: another run starts */
        }
        if (!(PyFloat_CheckExact(value) || PyLong_CheckExact(value) ||
              PyUnicode_CheckExact(value) || value == Py_None))
            goto plain_no; /* a tensor or array: read by the Python path, now */
        found[i] = value;
    }
    step = PyNumber_Add(last, one);
    if (step == NULL) goto done;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    when = PyFloat_FromDouble((double)now.tv_sec + (double)now.tv_nsec * 1e-9);
    if (when == NULL) goto done;

    /* From here on the report is recorded whole or the call fails loudly. */
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyList_Append(PyList_GET_ITEM(cols, i), found[i]) < 0) goto done;
    if (PyList_Append(steps, step) < 0 || PyList_Append(times, when) < 0) goto done;
    Py_ssize_t buffered = PyList_GET_SIZE(steps);
    /* The old step is released here: a plain int, so no Python code runs. */
    if (PyDict_SetItem(attrs, s_step, step) < 0) goto done;
    result = buffered == 1 ? 2 : 1;
    goto done;

missing: /* an attribute is not there (yet): the Python path says what is wrong */
    if (PyErr_Occurred()) goto done;
plain_no:
    result = 0;
done:
    Py_XDECREF(step);
    Py_XDECREF(when);
    Py_DECREF(attrs);
    return result;
}

static PyObject *fast_add(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add(runtime, metrics)");
        return NULL;
    }
    int r = record_plain(args[0], args[1]);
    return r < 0 ? NULL : PyLong_FromLong(r);
}

/* What rtnb.report falls back to, and the namespace holding the rank's runtime
 * (rtnb.worker._reporting's globals): one report per process, set by make_report. */
static PyObject *report_fallback, *report_namespace;

/* rtnb.report itself, when this module is built. A call with the metrics alone, on
 * a rank (namespace["_CURRENT"] is its RankReports), is recorded here without a Python
 * frame; any other call is the fallback's. */
static PyObject *report_call(PyObject *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
    (void)self;
    PyObject *fallback = report_fallback;
    if (PyVectorcall_NARGS(nargsf) == 1 && kwnames == NULL) {
        PyObject *runtime = PyDict_GetItemWithError(report_namespace, s_current);
        if (runtime == NULL && PyErr_Occurred()) return NULL;
        if (runtime != NULL && runtime != Py_None) {
            Py_INCREF(runtime);
            int r = record_plain(runtime, args[0]);
            PyObject *after = NULL;
            if (r == 2) after = PyObject_CallMethodNoArgs(runtime, s_after);
            Py_DECREF(runtime);
            if (r < 0 || (r == 2 && after == NULL)) return NULL;
            Py_XDECREF(after);
            if (r > 0) Py_RETURN_NONE;
        }
    }
    return PyObject_Vectorcall(fallback, args, nargsf, kwnames);
}

/* make_report(fallback, namespace, doc): the builtin above, documented by ``doc``
 * (its first line the signature, for inspect and IPython's ``report?``). */
static PyObject *make_report(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(args[1]) || !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "make_report(fallback, namespace: dict, doc: str)");
        return NULL;
    }
    const char *doc = PyUnicode_AsUTF8(args[2]);
    if (doc == NULL) return NULL;
    /* Made once per process and kept for its life, as a builtin's definition is. */
    PyMethodDef *def = PyMem_Calloc(1, sizeof(PyMethodDef));
    char *doc_copy = PyMem_Malloc(strlen(doc) + 1);
    if (def == NULL || doc_copy == NULL) {
        PyMem_Free(def);
        PyMem_Free(doc_copy);
        return PyErr_NoMemory();
    }
    strcpy(doc_copy, doc);
    def->ml_name = "report";
    def->ml_meth = (PyCFunction)(void (*)(void))report_call;
    def->ml_flags = METH_FASTCALL | METH_KEYWORDS;
    def->ml_doc = doc_copy;
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(report_fallback, args[0]);
    Py_XSETREF(report_namespace, args[1]);
    PyObject *name = PyUnicode_FromString("rtnb"); /* its __module__: users call rtnb.report */
    PyObject *func = name ? PyCFunction_NewEx(def, module, name) : NULL;
    Py_XDECREF(name);
    return func;
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))fast_add, METH_FASTCALL,
     "add(runtime, metrics) -> 0 (not the plain case), 1 (recorded) or 2 (recorded; "
     "wake the poll thread or stop here)"},
    {"make_report", (PyCFunction)(void (*)(void))make_report, METH_FASTCALL,
     "make_report(fallback, namespace, doc) -> rtnb.report recording plain reports in C"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_fastreport", "rtnb.report()'s hot path in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastreport(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_upload_error, "_upload_error");
    INTERN(s_replay, "_replay");
    INTERN(s_reports, "_reports");
    INTERN(s_step, "step");
    INTERN(s_stop_requested, "_stop_requested");
    INTERN(s_keys, "_keys");
    INTERN(s_cols, "_cols");
    INTERN(s_steps, "_steps");
    INTERN(s_times, "_times");
    INTERN(s_lock, "_reports_lock");
    INTERN(s_locked, "locked");
    INTERN(s_current, "_CURRENT");
    INTERN(s_after, "after_plain_report");
#undef INTERN
    if ((one = PyLong_FromLong(1)) == NULL) return NULL;
    return PyModule_Create(&module_def);
}
