"""guest.formatters: guest/code/space_formatters.py in a real IPython kernel, and its results
read back through the pinned E2B code interpreter SDK's chart classes.

    /usr/bin/python3 guest/tests/test_formatters.py

Skips (77) without jupyter_client/ipykernel/matplotlib/pandas, or without the pinned SDK
(../shared/pysdk beside the project, or CONFORMANCE_PYSDK).
"""
import ast
import inspect
import json
import math
import os
import re
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PYSDK = os.environ.get("CONFORMANCE_PYSDK") or os.path.join(ROOT, "..", "shared", "pysdk")
sys.path.insert(0, os.path.join(ROOT, "guest", "code"))
sys.path.insert(0, PYSDK)

try:
    from jupyter_client.manager import KernelManager
    import matplotlib  # noqa: F401
    import pandas  # noqa: F401
    from e2b_code_interpreter import charts as sdk_charts
    from e2b_code_interpreter.models import Result
except ImportError as e:
    # The kernels are Debian's: run under Debian's python3 when another one was picked.
    if os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3") and \
            os.access("/usr/bin/python3", os.X_OK):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    print("guest.formatters: SKIP: %s" % e, file=sys.stderr)
    sys.exit(77)

from space_formatters import __space_code_formatters  # noqa: E402

SETUP_CODE = (inspect.getsource(__space_code_formatters)
              + "\n__space_code_formatters()\ndel __space_code_formatters\n")

TIMEOUT = 120


class Kernel:
    """A real ipykernel driven through jupyter_client."""

    def __init__(self):
        env = dict(os.environ)
        env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        env.pop("PYTHONPATH", None)
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, cwd=HERE)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=TIMEOUT)

    def close(self):
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)

    def run(self, code, store_history=True, user_expressions=None):
        """Execute code; return (reply content, list of iopub messages)."""
        msgs = []
        reply = self.kc.execute_interactive(
            code, store_history=store_history, allow_stdin=False,
            user_expressions=user_expressions or {}, timeout=TIMEOUT,
            output_hook=msgs.append)
        return reply["content"], msgs

    def setup(self, store_history=False):
        content, msgs = self.run(SETUP_CODE, store_history=store_history)
        assert content["status"] == "ok", content
        noisy = [m for m in msgs if m["msg_type"] in
                 ("stream", "error", "execute_result", "display_data")]
        assert not noisy, noisy

    def expr(self, expression):
        """Evaluate an expression in the user namespace without a cell."""
        content, _ = self.run("", store_history=False,
                              user_expressions={"v": expression})
        value = content["user_expressions"]["v"]
        assert value["status"] == "ok", value
        return ast.literal_eval(value["data"]["text/plain"])

    def bundles(self, code):
        """Run a cell, fail on errors, return (execute_result, [display_data])."""
        content, msgs = self.run(code)
        errors = [m["content"] for m in msgs if m["msg_type"] == "error"]
        stderr = [m["content"]["text"] for m in msgs
                  if m["msg_type"] == "stream" and m["content"]["name"] == "stderr"]
        if content["status"] != "ok" or errors:
            raise AssertionError("cell failed: %r %r" % (content, errors))
        if any("Traceback" in t for t in stderr):
            raise AssertionError("traceback on stderr: %s" % "".join(stderr))
        result = None
        displays = []
        for m in msgs:
            if m["msg_type"] == "execute_result":
                result = m["content"]["data"]
            elif m["msg_type"] == "display_data":
                displays.append(m["content"]["data"])
        return result, displays


def assert_plain_json(testcase, value, path="$"):
    """Only JSON types, finite floats."""
    if isinstance(value, dict):
        for k, v in value.items():
            testcase.assertIsInstance(k, str, path)
            assert_plain_json(testcase, v, "%s.%s" % (path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            assert_plain_json(testcase, v, "%s[%d]" % (path, i))
    else:
        testcase.assertIsInstance(value, (str, int, float, bool, type(None)), path)
        if isinstance(value, float):
            testcase.assertTrue(math.isfinite(value), path)
    json.dumps(value, allow_nan=False)


class FreshKernelTest(unittest.TestCase):
    """Setup hygiene: namespace and lazy imports."""

    def setUp(self):
        self.k = Kernel()

    def tearDown(self):
        self.k.close()

    def test_setup_leaves_no_names_and_plain_results_stay_plain(self):
        k = self.k
        before = k.expr("sorted(dir())")
        k.setup(store_history=False)
        after = k.expr("sorted(dir())")
        self.assertEqual(before, after)
        self.assertNotIn("__space_code_formatters", after)

        # formatters are registered and active
        active = k.expr("list(get_ipython().display_formatter.active_types)")
        for mime in ("application/json", "e2b/data", "e2b/chart"):
            self.assertIn(mime, active)
        fmt_keys = k.expr(
            "sorted(get_ipython().display_formatter.format({'a': 1})[0])")
        self.assertIn("application/json", fmt_keys)

        mods = "[m for m in ('pandas', 'matplotlib') if m in __import__('sys').modules]"
        self.assertEqual(k.expr(mods), [])
        result, displays = k.bundles("1+1")
        self.assertEqual(result, {"text/plain": "2"})
        self.assertEqual(displays, [])
        self.assertEqual(k.expr(mods), [])
        result, _ = k.bundles("'text'")
        self.assertEqual(set(result), {"text/plain"})
        self.assertEqual(k.expr(mods), [])

    def test_setup_with_history_only_adds_ipython_history_names(self):
        k = self.k
        before = set(k.expr("dir()"))
        k.setup(store_history=True)
        after = set(k.expr("dir()"))
        # IPython itself records the cell source as _i, _ii, _iii and _i<N>
        history = re.compile(r"^_i(\d+|i{0,2})$")
        extra = {n for n in after - before if not history.match(n)}
        self.assertEqual(extra, set())
        self.assertEqual(before - after, set())

    def test_setup_twice_is_harmless(self):
        k = self.k
        k.setup()
        k.setup()
        result, _ = k.bundles("{'a': [1, 2]}")
        self.assertEqual(result["application/json"], {"a": [1, 2]})


class FormatterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.k = Kernel()
        cls.k.setup()
        cls.k.bundles(
            "import datetime, numpy as np, pandas as pd\n"
            "import matplotlib\nimport matplotlib.pyplot as plt\n")

    @classmethod
    def tearDownClass(cls):
        cls.k.close()

    # ------------------------------------------------------------ helpers
    def chart_of(self, code):
        """The e2b/chart of the single figure a cell displays."""
        result, displays = self.k.bundles(code)
        charts = [d for d in displays if "image/png" in d]
        self.assertEqual(len(charts), 1, displays)
        self.assertIn("e2b/chart", charts[0])
        chart = charts[0]["e2b/chart"]
        assert_plain_json(self, chart)
        return chart

    def deserialize(self, chart, cls):
        obj = sdk_charts._deserialize_chart(chart)
        self.assertIs(type(obj), cls)
        self.assertIs(type(Result(text="x", chart=chart).chart), cls)
        return obj

    def assertPoints(self, actual, expected):
        self.assertEqual(len(actual), len(expected), actual)
        for (ax_, ay), (ex, ey) in zip(actual, expected):
            for a, e in ((ax_, ex), (ay, ey)):
                if isinstance(e, float):
                    self.assertAlmostEqual(a, e, places=6)
                else:
                    self.assertEqual(a, e)

    POINT_KEYS = {"type", "title", "elements", "x_label", "y_label", "x_unit",
                  "y_unit", "x_ticks", "y_ticks", "x_tick_labels",
                  "y_tick_labels", "x_scale", "y_scale"}
    KEYS_2D = {"type", "title", "elements", "x_label", "y_label", "x_unit", "y_unit"}

    # --------------------------------------------------------------- JSON
    def test_json_dict_and_list(self):
        result, _ = self.k.bundles("{'a': 1, 'b': [1, 2.5, 'x', None, True]}")
        self.assertEqual(result["application/json"],
                         {"a": 1, "b": [1, 2.5, "x", None, True]})
        self.assertIn("text/plain", result)
        self.assertEqual(Result(**{"json": result["application/json"]}).json,
                         {"a": 1, "b": [1, 2.5, "x", None, True]})
        result, _ = self.k.bundles("[1, {'k': 'v'}, [2]]")
        self.assertEqual(result["application/json"], [1, {"k": "v"}, [2]])

    def test_json_numpy_nan_and_other_values(self):
        result, _ = self.k.bundles(
            "{'i': np.int64(3), 'f': np.float32(1.5), 'b': np.bool_(True),\n"
            " 'arr': np.array([1.0, np.nan, np.inf]), 'nan': float('nan'),\n"
            " 'ninf': -float('inf'), 2: {'t': (1, 2)}, None: 'n',\n"
            " 'dt': datetime.date(2024, 1, 2), 'obj': object, 'set': {7},\n"
            " 'nested': [np.arange(2), np.float64('nan')],\n"
            " 'd64': np.array(['2024-01-01', 'NaT'], dtype='datetime64[ns]')}")
        j = result["application/json"]
        assert_plain_json(self, j)
        self.assertEqual(j, {
            "i": 3, "f": 1.5, "b": True, "arr": [1.0, None, None],
            "nan": None, "ninf": None, "2": {"t": [1, 2]}, "null": "n",
            "dt": "2024-01-02", "obj": "<class 'object'>", "set": [7],
            "nested": [[0, 1], None],
            "d64": ["2024-01-01T00:00:00.000000000", None]})

    def test_json_unconvertible_gives_no_json_and_no_error(self):
        result, displays = self.k.bundles("cyc = {'a': 1}\ncyc['self'] = cyc\ncyc")
        self.assertIn("text/plain", result)
        self.assertNotIn("application/json", result)

    def test_json_repr_json_still_used_and_scalars_ignored(self):
        result, _ = self.k.bundles(
            "class WithJson:\n"
            "    def _repr_json_(self):\n"
            "        return {'custom': True}\n"
            "WithJson()")
        self.assertEqual(result["application/json"], {"custom": True})
        for expr in ("42", "'s'", "(1, 2)", "np.float64(1.5)", "np.arange(3)"):
            result, _ = self.k.bundles(expr)
            self.assertNotIn("application/json", result, expr)
            self.assertNotIn("e2b/data", result, expr)
            self.assertNotIn("e2b/chart", result, expr)

    # --------------------------------------------------------------- data
    def test_dataframe_data(self):
        result, _ = self.k.bundles(
            "df = pd.DataFrame({'a': [1, 2, 3], 'b': [1.5, np.nan, 3.0],\n"
            "    't': pd.to_datetime(['2024-01-01', None, '2024-03-01 12:30']),\n"
            "    's': ['x', None, 'z'], 5: [True, False, True]})\n"
            "df")
        self.assertIn("text/html", result)
        data = result["e2b/data"]
        assert_plain_json(self, data)
        self.assertEqual(data, {
            "a": [1, 2, 3], "b": [1.5, None, 3.0],
            "t": ["2024-01-01T00:00:00", None, "2024-03-01T12:30:00"],
            "s": ["x", None, "z"], "5": [True, False, True]})
        self.assertNotIn("application/json", result)
        self.assertEqual(Result(text="df", data=data).data, data)
        result, _ = self.k.bundles("df['a']")
        self.assertNotIn("e2b/data", result)

    # ------------------------------------------------------------- charts
    def test_line_chart(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.plot([1, 2, 3], [2, 4, 8], label='growth')\n"
            "ax.plot(np.array([1, 2, 3]), np.array([1.0, np.nan, 1.0]), label='flat')\n"
            "ax.set_title('Growth'); ax.set_xlabel('Time (s)')\n"
            "ax.set_ylabel('Distance [m]'); ax.set_xticks([1, 2, 3]);")
        self.assertEqual(set(c), self.POINT_KEYS)
        self.assertEqual(c["type"], "line")
        self.assertEqual(c["title"], "Growth")
        self.assertEqual((c["x_label"], c["x_unit"]), ("Time (s)", "s"))
        self.assertEqual((c["y_label"], c["y_unit"]), ("Distance [m]", "m"))
        self.assertEqual([e["label"] for e in c["elements"]], ["growth", "flat"])
        self.assertPoints(c["elements"][0]["points"], [(1.0, 2.0), (2.0, 4.0), (3.0, 8.0)])
        self.assertEqual(c["elements"][1]["points"], [[1.0, 1.0], [2.0, None], [3.0, 1.0]])
        self.assertEqual(c["x_ticks"], [1.0, 2.0, 3.0])
        self.assertEqual(c["x_tick_labels"], ["1", "2", "3"])
        self.assertEqual((c["x_scale"], c["y_scale"]), ("linear", "linear"))
        self.assertTrue(c["y_ticks"])
        self.assertEqual(len(c["y_ticks"]), len(c["y_tick_labels"]))
        self.assertEqual(c["y_ticks"], sorted(c["y_ticks"]))
        self.assertTrue(all(isinstance(t, float) for t in c["y_ticks"]))
        obj = self.deserialize(c, sdk_charts.LineChart)
        self.assertEqual(obj.type, sdk_charts.ChartType.LINE)
        self.assertEqual(obj.x_scale, sdk_charts.ScaleType.LINEAR)
        self.assertEqual(obj.elements[0].label, "growth")
        self.assertEqual(obj.elements[0].points[2], (3.0, 8.0))
        self.assertEqual(obj.x_unit, "s")

    def test_line_chart_without_labels_or_units(self):
        c = self.chart_of("plt.plot([0, 1], [5, 6]);")
        self.assertEqual(c["type"], "line")
        self.assertIsNone(c["title"])
        self.assertIsNone(c["x_label"])
        self.assertIsNone(c["x_unit"])
        self.assertEqual(c["elements"][0]["label"], "_child0")
        self.deserialize(c, sdk_charts.LineChart)

    def test_datetime_line_chart(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.plot([datetime.datetime(2024, 1, 1), datetime.datetime(2024, 1, 2, 12)],\n"
            "        [1, 2], label='py')\n"
            "ax.plot(pd.date_range('2024-01-01', periods=3, freq='D').values, [3, 4, 5],\n"
            "        label='np');")
        self.assertEqual(c["x_scale"], "datetime")
        self.assertEqual(c["y_scale"], "linear")
        self.assertEqual(c["elements"][0]["points"],
                         [["2024-01-01T00:00:00", 1.0], ["2024-01-02T12:00:00", 2.0]])
        self.assertEqual([p[0] for p in c["elements"][1]["points"]],
                         ["2024-01-01T00:00:00", "2024-01-02T00:00:00",
                          "2024-01-03T00:00:00"])
        self.assertTrue(c["x_ticks"])
        self.assertTrue(all(isinstance(t, str) and t.startswith("2024-01-")
                            for t in c["x_ticks"]))
        self.assertEqual(len(c["x_ticks"]), len(c["x_tick_labels"]))
        obj = self.deserialize(c, sdk_charts.LineChart)
        self.assertEqual(obj.x_scale, sdk_charts.ScaleType.DATETIME)

    def test_pandas_time_series_plot(self):
        c = self.chart_of(
            "s = pd.Series([1.0, 2.0, 3.0], name='sales',\n"
            "              index=pd.date_range('2024-01-01', periods=3, freq='M'))\n"
            "s.plot();")
        self.assertEqual(c["type"], "line")
        self.assertEqual(c["x_scale"], "datetime")
        self.assertEqual(c["elements"][0]["label"], "sales")
        self.assertEqual([p[0] for p in c["elements"][0]["points"]],
                         ["2024-01-01T00:00:00", "2024-02-01T00:00:00",
                          "2024-03-01T00:00:00"])
        self.deserialize(c, sdk_charts.LineChart)

    def test_categorical_line_chart(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.plot(['mon', 'tue', 'wed'], [3, 1, 2], label='visits');")
        self.assertEqual(c["x_scale"], "categorical")
        self.assertEqual(c["elements"][0]["points"],
                         [["mon", 3.0], ["tue", 1.0], ["wed", 2.0]])
        self.assertEqual(c["x_ticks"], ["mon", "tue", "wed"])
        self.assertEqual(c["x_tick_labels"], ["mon", "tue", "wed"])
        obj = self.deserialize(c, sdk_charts.LineChart)
        self.assertEqual(obj.x_scale, sdk_charts.ScaleType.CATEGORICAL)

    def test_errorbar_and_reference_lines(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.errorbar([1, 2], [3, 4], yerr=[0.1, 0.2], capsize=3, label='e')\n"
            "ax.axhline(3.5); ax.axvline(1.5);")
        self.assertEqual(c["type"], "line")
        self.assertEqual(c["elements"], [{"label": "e", "points": [[1.0, 3.0], [2.0, 4.0]]}])

    def test_histogram_is_bar(self):
        c = self.chart_of("plt.hist([1, 2, 2, 3, 3, 3], bins=3);")
        self.assertEqual(c["type"], "bar")
        self.assertEqual([e["value"] for e in c["elements"]], [1.0, 2.0, 3.0])
        self.assertEqual(c["elements"][1]["label"], "2")

    def test_scales(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.plot([1, 10, 100], [1, 100, 10000])\n"
            "ax.set_yscale('log'); ax.set_xscale('symlog');")
        self.assertEqual((c["x_scale"], c["y_scale"]), ("symlog", "log"))
        self.assertIn(100.0, c["y_ticks"])
        obj = self.deserialize(c, sdk_charts.LineChart)
        self.assertEqual(obj.y_scale, sdk_charts.ScaleType.LOG)
        self.assertEqual(obj.x_scale, sdk_charts.ScaleType.SYMLOG)
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.plot([0.1, 0.5, 0.9], [1, 2, 3]); ax.set_xscale('logit');")
        self.assertEqual(c["x_scale"], "logit")

    def test_scatter_chart(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.scatter(np.array([1, 2, 3]), np.array([4.0, 5.0, 6.5]), label='pts')\n"
            "ax.plot([1.5, 2.5], [5, 6], 'o', label='markers')\n"
            "ax.set_xlabel('Weight (kg)');")
        self.assertEqual(set(c), self.POINT_KEYS)
        self.assertEqual(c["type"], "scatter")
        self.assertEqual(c["x_unit"], "kg")
        labels = [e["label"] for e in c["elements"]]
        self.assertEqual(sorted(labels), ["markers", "pts"])
        pts = c["elements"][labels.index("pts")]["points"]
        self.assertPoints(pts, [(1.0, 4.0), (2.0, 5.0), (3.0, 6.5)])
        obj = self.deserialize(c, sdk_charts.ScatterChart)
        self.assertEqual(obj.type, sdk_charts.ChartType.SCATTER)

    def test_line_plus_scatter_is_line(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.plot([1, 2], [1, 2], label='l'); ax.scatter([1], [2], label='s');")
        self.assertEqual(c["type"], "line")
        self.assertEqual(sorted(e["label"] for e in c["elements"]), ["l", "s"])

    def test_bar_chart(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.bar(['a', 'b', 'c'], [3, 5, 2], label='2023')\n"
            "ax.set_title('Sales'); ax.set_ylabel('Revenue ($)');")
        self.assertEqual(set(c), self.KEYS_2D)
        self.assertEqual(c["type"], "bar")
        self.assertEqual(c["title"], "Sales")
        self.assertEqual(c["y_unit"], "$")
        self.assertEqual(c["elements"], [
            {"label": "a", "group": "2023", "value": 3.0},
            {"label": "b", "group": "2023", "value": 5.0},
            {"label": "c", "group": "2023", "value": 2.0}])
        obj = self.deserialize(c, sdk_charts.BarChart)
        self.assertEqual([(e.label, e.group, e.value) for e in obj.elements],
                         [("a", "2023", 3.0), ("b", "2023", 5.0), ("c", "2023", 2.0)])

    def test_grouped_bar_chart(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "x = np.arange(3); w = 0.25\n"
            "for i, (name, vals) in enumerate([('A', [1, 2, 3]), ('B', [3, 2, 1]),\n"
            "                                  ('C', [2, 2, 2])]):\n"
            "    ax.bar(x + (i - 1) * w, vals, w, label=name)\n"
            "ax.set_xticks(x, ['p', 'q', 'r']); ax.legend();")
        self.assertEqual(c["type"], "bar")
        got = {(e["group"], e["label"]): e["value"] for e in c["elements"]}
        self.assertEqual(got, {
            ("A", "p"): 1.0, ("A", "q"): 2.0, ("A", "r"): 3.0,
            ("B", "p"): 3.0, ("B", "q"): 2.0, ("B", "r"): 1.0,
            ("C", "p"): 2.0, ("C", "q"): 2.0, ("C", "r"): 2.0})
        self.deserialize(c, sdk_charts.BarChart)

    def test_barh_and_numeric_bars(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.barh(['u', 'v'], [5, 6.5]); ax.set_xlabel('Count');")
        self.assertEqual(c["type"], "bar")
        self.assertEqual(c["x_label"], "Count")
        self.assertEqual(c["elements"], [
            {"label": "u", "group": "_container0", "value": 5.0},
            {"label": "v", "group": "_container0", "value": 6.5}])
        c = self.chart_of("plt.bar([1, 2, 3], [1, -2, 3], label='n');")
        self.assertEqual([(e["label"], e["value"]) for e in c["elements"]],
                         [("1", 1.0), ("2", -2.0), ("3", 3.0)])
        c = self.chart_of("plt.bar([0, 1], [4, 5], tick_label=['lo', 'hi']);")
        self.assertEqual([e["label"] for e in c["elements"]], ["lo", "hi"])
        self.deserialize(c, sdk_charts.BarChart)

    def test_pie_chart(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.pie([1, 2, 3], labels=['a', 'b', 'c']); ax.set_title('Share');")
        self.assertEqual(set(c), {"type", "title", "elements"})
        self.assertEqual(c["type"], "pie")
        self.assertEqual(c["title"], "Share")
        self.assertEqual([e["label"] for e in c["elements"]], ["a", "b", "c"])
        for e, angle in zip(c["elements"], (60.0, 120.0, 180.0)):
            self.assertAlmostEqual(e["angle"], angle, places=3)
            self.assertEqual(e["radius"], 1.0)
        obj = self.deserialize(c, sdk_charts.PieChart)
        self.assertEqual(obj.elements[1].label, "b")
        self.assertAlmostEqual(obj.elements[2].angle, 180.0, places=3)
        c = self.chart_of("plt.pie([1, 1], radius=0.5);")
        self.assertEqual([(e["label"], round(e["angle"], 3), e["radius"])
                          for e in c["elements"]], [("", 180.0, 0.5), ("", 180.0, 0.5)])

    BOX_DATA = "[[1, 2, 3, 4, 5, 20], [2, 3, 4, 5, 6]]"
    BOX_STATS = [(1.0, 2.25, 3.5, 4.75, 5.0, [20.0]), (2.0, 3.0, 4.0, 5.0, 6.0, [])]

    def assertBoxes(self, c, labels):
        self.assertEqual(c["type"], "box_and_whisker")
        self.assertEqual(set(c), self.KEYS_2D)
        self.assertEqual(len(c["elements"]), len(self.BOX_STATS))
        for e, label, (lo, q1, med, q3, hi, out) in zip(c["elements"], labels, self.BOX_STATS):
            self.assertEqual(e["label"], label)
            for key, val in (("min", lo), ("first_quartile", q1), ("median", med),
                             ("third_quartile", q3), ("max", hi)):
                self.assertAlmostEqual(e[key], val, places=9, msg=key)
            self.assertEqual(e["outliers"], out)

    def test_box_plot(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.boxplot(%s, labels=['x', 'y'])\n"
            "ax.set_title('Spread'); ax.set_ylabel('Score (pt)');" % self.BOX_DATA)
        self.assertBoxes(c, ["x", "y"])
        self.assertEqual(c["title"], "Spread")
        self.assertEqual(c["y_unit"], "pt")
        obj = self.deserialize(c, sdk_charts.BoxAndWhiskerChart)
        self.assertEqual(obj.elements[0].median, 3.5)
        self.assertEqual(obj.elements[0].outliers, [20.0])
        self.assertEqual(obj.elements[1].third_quartile, 5.0)

    def test_box_plot_variants(self):
        # horizontal, notched (notch reaches beyond the hinges), patch boxes,
        # mean markers (the mean of the first box lies beyond its whisker)
        c = self.chart_of(
            "plt.boxplot(%s, vert=False, notch=True, patch_artist=True,\n"
            "            showmeans=True);" % self.BOX_DATA)
        self.assertBoxes(c, ["1", "2"])
        c = self.chart_of(
            "plt.boxplot(%s, showmeans=True, meanline=True, showcaps=False);"
            % self.BOX_DATA)
        self.assertBoxes(c, ["1", "2"])
        self.deserialize(c, sdk_charts.BoxAndWhiskerChart)

    def test_superchart(self):
        c = self.chart_of(
            "fig, (a1, a2, a3) = plt.subplots(1, 3)\n"
            "a1.plot([1, 2], [3, 4], label='l'); a1.set_title('left')\n"
            "a2.bar(['a'], [1]); a3.pie([1, 3])\n"
            "fig.suptitle('Overview');")
        self.assertEqual(set(c), {"type", "title", "elements"})
        self.assertEqual(c["type"], "superchart")
        self.assertEqual(c["title"], "Overview")
        self.assertEqual([e["type"] for e in c["elements"]], ["line", "bar", "pie"])
        self.assertEqual(c["elements"][0]["title"], "left")
        obj = self.deserialize(c, sdk_charts.SuperChart)
        self.assertEqual([type(e) for e in obj.elements],
                         [sdk_charts.LineChart, sdk_charts.BarChart, sdk_charts.PieChart])
        c = self.chart_of(
            "fig, (a1, a2) = plt.subplots(2)\n"
            "a1.plot([1, 2]); a2.scatter([1], [1]);")
        self.assertEqual(c["type"], "superchart")
        self.assertIsNone(c["title"])

    def test_single_chart_axes_plus_colorbar(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "sc = ax.scatter([1, 2], [3, 4], c=[0.1, 0.9]); fig.colorbar(sc);")
        self.assertEqual(c["type"], "scatter")

    def test_unknown_chart(self):
        c = self.chart_of(
            "fig, ax = plt.subplots()\n"
            "ax.imshow(np.eye(3)); ax.set_title('Image');")
        self.assertEqual(c, {"type": "unknown", "title": "Image", "elements": []})
        obj = self.deserialize(c, sdk_charts.Chart)
        self.assertEqual(obj.type, sdk_charts.ChartType.UNKNOWN)
        # the inline backend publishes an empty figure without a PNG
        _, displays = self.k.bundles("fig = plt.figure()")
        self.assertEqual([d["e2b/chart"] for d in displays],
                         [{"type": "unknown", "title": None, "elements": []}])

    def test_figure_as_result_and_plain_types(self):
        result, displays = self.k.bundles(
            "fig, ax = plt.subplots()\n"
            "ax.plot(np.arange(3), np.array([1.5, np.nan, np.float32(2)]))\n"
            "fig")
        self.assertIn("image/png", result)
        self.assertEqual(result["e2b/chart"]["type"], "line")
        self.assertEqual(result["e2b/chart"]["elements"][0]["points"],
                         [[0.0, 1.5], [1.0, None], [2.0, 2.0]])
        # inspect the formatter's raw return value inside the kernel
        result, _ = self.k.bundles(
            "def _leaves(v):\n"
            "    if isinstance(v, dict):\n"
            "        return [x for k in v for x in [type(k)] + _leaves(v[k])]\n"
            "    if isinstance(v, list):\n"
            "        return [x for i in v for x in _leaves(i)]\n"
            "    return [type(v)]\n"
            "_raw = get_ipython().display_formatter.formatters['e2b/chart'](fig)\n"
            "sorted({t.__name__ for t in _leaves(_raw)})")
        self.assertEqual(ast.literal_eval(result["text/plain"]),
                         ["NoneType", "float", "str"])

    def test_broken_figure_never_raises(self):
        result, displays = self.k.bundles(
            "from matplotlib.figure import Figure\n"
            "class Weird(Figure):\n"
            "    def get_axes(self):\n"
            "        raise RuntimeError('boom')\n"
            "get_ipython().display_formatter.formatters['e2b/chart'](Weird())")
        self.assertIsNone(result)
        result, _ = self.k.bundles(
            "fig, ax = plt.subplots()\n"
            "ax.get_lines = lambda: 1 / 0\n"
            "get_ipython().display_formatter.formatters['e2b/chart'](fig)")
        # a failing axes is skipped: the figure degrades to "unknown"
        self.assertEqual(ast.literal_eval(result["text/plain"]),
                         {"type": "unknown", "title": None, "elements": []})


if __name__ == "__main__":
    unittest.main()
