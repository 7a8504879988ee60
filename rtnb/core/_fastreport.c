/* rtnb.report()'s hot path in C: record one plain report in the rank's buffer.
 *
 * add(runtime, metrics) records ``metrics`` as the next step of ``runtime`` and
 * returns 1, or 2 when the caller must still wake the poll thread or stop at this
 * report (the batch's first report, or a stop was requested); it returns 0, having
 * changed nothing, whenever the report is not the plain case, and the Python path
 * (rtnb/worker/_runtime.py, rtnb/core/_reports.py) then records it. The plain case:
 * a dict with exactly the str keys of the buffer's current run of reports (in any
 * order), no "step" key, every value an exact float, int, str or None, and the rank
 * not replaying, uploading or holding an upload error.
 *
 * Nothing here runs Python code or releases the GIL (exact str keys, exact values,
 * list appends), so the whole call is atomic with respect to the rank's other
 * threads: the poll thread swaps the buffer out before or after it, never during.
 * It does not take the buffer's lock; while another thread holds it (inside the
 * Python path) it returns 0, and the caller then waits for the lock there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

static PyObject *s_upload, *s_upload_error, *s_replay, *s_reports, *s_step,
    *s_stop_requested, *s_keys, *s_width, *s_rows, *s_steps, *s_times, *s_lock,
    *s_locked, *one;

/* A borrowed-style check of one attribute; -1 on error. */
static int attr_is(PyObject *obj, PyObject *name, PyObject *value) {
    PyObject *got = PyObject_GetAttr(obj, name);
    if (got == NULL) return -1;
    int same = got == value;
    Py_DECREF(got);
    return same;
}

static int append_to(PyObject *obj, PyObject *name, PyObject *item) {
    PyObject *list = PyObject_GetAttr(obj, name);
    if (list == NULL) return -1;
    int rc = PyList_CheckExact(list) ? PyList_Append(list, item) : -1;
    if (rc < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "rtnb: report buffer is not a list");
    Py_DECREF(list);
    return rc;
}

static PyObject *fast_add(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add(runtime, metrics)");
        return NULL;
    }
    PyObject *runtime = args[0], *metrics = args[1];
    if (!PyDict_CheckExact(metrics)) return PyLong_FromLong(0);
    /* A "step" metric numbers the report itself: the Python path reads it. */
    PyObject *own_step = PyDict_GetItemWithError(metrics, s_step);
    if (own_step != NULL || PyErr_Occurred()) return own_step ? PyLong_FromLong(0) : NULL;
    int r;
    /* Another thread inside the Python path (a second reporting thread, the poll
     * thread swapping the buffer) holds the lock: wait for it there. */
    PyObject *lock = PyObject_GetAttr(runtime, s_lock);
    if (lock == NULL) return NULL;
    PyObject *held = PyObject_CallMethodNoArgs(lock, s_locked);
    Py_DECREF(lock);
    if (held == NULL) return NULL;
    Py_DECREF(held);
    if (held != Py_False) return PyLong_FromLong(0);
    if ((r = attr_is(runtime, s_upload, Py_None)) != 1 ||
        (r = attr_is(runtime, s_upload_error, Py_None)) != 1 ||
        (r = attr_is(runtime, s_replay, Py_False)) != 1)
        return r < 0 ? NULL : PyLong_FromLong(0);

    PyObject *buffer = PyObject_GetAttr(runtime, s_reports);
    if (buffer == NULL) return NULL;
    PyObject *keys = NULL, *width = NULL, *values = NULL, *step = NULL, *when = NULL,
             *result = NULL;
    keys = PyObject_GetAttr(buffer, s_keys);
    width = keys ? PyObject_GetAttr(buffer, s_width) : NULL;
    if (width == NULL) goto done;
    if (!PyTuple_CheckExact(keys) || !PyLong_CheckExact(width)) goto plain_no;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (PyDict_GET_SIZE(metrics) != n || PyLong_AsSsize_t(width) != n || n == 0) goto plain_no;
    values = PyTuple_New(n);
    if (values == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(key)) goto plain_no;
        PyObject *value = PyDict_GetItemWithError(metrics, key); /* borrowed */
        if (value == NULL) {
            if (PyErr_Occurred()) goto done;
            goto plain_no; /* a key of the run is missing: another run starts */
        }
        if (!(PyFloat_CheckExact(value) || PyLong_CheckExact(value) ||
              PyUnicode_CheckExact(value) || value == Py_None))
            goto plain_no; /* a tensor or array: read by the Python path, now */
        Py_INCREF(value);
        PyTuple_SET_ITEM(values, i, value);
    }
    PyObject *last = PyObject_GetAttr(runtime, s_step);
    if (last == NULL) goto done;
    if (!PyLong_CheckExact(last)) {
        Py_DECREF(last);
        goto plain_no;
    }
    step = PyNumber_Add(last, one);
    Py_DECREF(last);
    if (step == NULL) goto done;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    when = PyFloat_FromDouble((double)now.tv_sec + (double)now.tv_nsec * 1e-9);
    if (when == NULL) goto done;

    /* From here on the report is recorded whole or the call fails loudly. */
    if (append_to(buffer, s_rows, values) < 0 || append_to(buffer, s_steps, step) < 0 ||
        append_to(buffer, s_times, when) < 0 || PyObject_SetAttr(runtime, s_step, step) < 0)
        goto done;
    PyObject *steps = PyObject_GetAttr(buffer, s_steps);
    if (steps == NULL) goto done;
    Py_ssize_t buffered = PyList_GET_SIZE(steps);
    Py_DECREF(steps);
    r = attr_is(runtime, s_stop_requested, Py_True);
    if (r < 0) goto done;
    result = PyLong_FromLong(buffered == 1 || r == 1 ? 2 : 1);
    goto done;

plain_no:
    result = PyLong_FromLong(0);
done:
    Py_XDECREF(keys);
    Py_XDECREF(width);
    Py_XDECREF(values);
    Py_XDECREF(step);
    Py_XDECREF(when);
    Py_DECREF(buffer);
    return result;
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))fast_add, METH_FASTCALL,
     "add(runtime, metrics) -> 0 (not the plain case), 1 (recorded) or 2 (recorded; "
     "wake the poll thread or stop here)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_fastreport", "rtnb.report()'s hot path in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastreport(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_upload, "_upload");
    INTERN(s_upload_error, "_upload_error");
    INTERN(s_replay, "_replay");
    INTERN(s_reports, "_reports");
    INTERN(s_step, "step");
    INTERN(s_stop_requested, "_stop_requested");
    INTERN(s_keys, "_keys");
    INTERN(s_width, "_width");
    INTERN(s_rows, "_rows");
    INTERN(s_steps, "_steps");
    INTERN(s_times, "_times");
    INTERN(s_lock, "_reports_lock");
    INTERN(s_locked, "locked");
#undef INTERN
    if ((one = PyLong_FromLong(1)) == NULL) return NULL;
    return PyModule_Create(&module_def);
}
