"""space_formatters.py - IPython display formatters that give E2B-compatible rich results.

Loaded by space-code (installed beside it in /usr/local/lib/space-code): every Python
context it starts runs this function's source once, silently.

``__space_code_formatters`` is meant to be shipped into a running IPython
kernel as source text::

    src = inspect.getsource(__space_code_formatters)
    code = src + "\\n__space_code_formatters()\\ndel __space_code_formatters\\n"

It is fully self-contained (imports and helpers live inside the function), so
after the ``del`` no new names remain in the user namespace.

What it registers on ``get_ipython().display_formatter``:

``application/json``
    Replaces IPython's ``JSONFormatter`` with a subclass that keeps the usual
    lookup order (registered printers, then ``_repr_json_``) and additionally
    renders plain ``dict`` / ``list`` objects as their JSON value.  numpy
    scalars/arrays are converted with ``.item()`` / ``.tolist()``, NaN/+-Inf
    become ``None``, other non-JSON values become ``str(value)``, keys are
    stringified like ``json.dumps`` does.  Anything that fails (cycles,
    recursion limits, ...) yields no JSON instead of raising.

``e2b/data``
    For ``pandas.DataFrame`` (only if pandas is already imported):
    ``df.to_dict(orient="list")`` with column names stringified, datetimes as
    ``isoformat()``, numpy scalars as Python scalars and NaN/NaT/NA as None.

``e2b/chart``
    For ``matplotlib.figure.Figure`` (only if matplotlib is already
    imported).  Dict shapes (every key read by ``e2b_code_interpreter.charts``
    is always present; unknown values are ``None``):

    * line / scatter (``Axes.plot`` Line2D, ``Axes.scatter`` PathCollection)::

        {"type": "line" | "scatter", "title", "x_label", "y_label",
         "x_unit", "y_unit", "x_scale", "y_scale", "x_ticks", "y_ticks",
         "x_tick_labels", "y_tick_labels",
         "elements": [{"label": str, "points": [[x, y], ...]}, ...]}

      "scatter" when every series is marker-only (PathCollection, or a Line2D
      drawn without a line style), otherwise "line".  Scale is the matplotlib
      scale name, or "datetime" / "categorical" when the axis uses a date /
      category unit converter.  On datetime axes point coordinates and tick
      positions are ISO-8601 strings (UTC, no offset, the way matplotlib
      interprets naive datetimes); on categorical axes they are the category
      strings.  Elsewhere they are floats.  Tick labels are the texts
      matplotlib's tick formatter produces (may contain the unicode minus or
      mathtext for log axes).  Only major ticks inside the view limits.
    * bar (BarContainer from ``bar`` / ``barh`` / ``hist``)::

        {"type": "bar", "title", "x_label", "y_label", "x_unit", "y_unit",
         "elements": [{"label": <tick label at the bar>, "group":
                       <container label>, "value": height|width}, ...]}

      The "label" is the category (categorical axis), the fixed tick label
      nearest to the bar centre (``set_xticks(..., labels)``, ``tick_label=``),
      an ISO date (date axis) or the bar centre formatted as a number.  The
      "group" is the label passed to ``bar(label=...)``; unlabeled containers
      keep matplotlib's automatic label ("_container0", ...).
    * pie (Wedge patches)::

        {"type": "pie", "title",
         "elements": [{"label", "angle": <degrees>, "radius"}, ...]}
    * box and whisker (artists drawn by ``boxplot``/``bxp``, recognised from
      their geometry: a closed box outline or PathPatch, a median line and
      two whiskers at the box centre, marker-only flier lines)::

        {"type": "box_and_whisker", "title", "x_label", "y_label", "x_unit",
         "y_unit", "elements": [{"label", "min", "first_quartile", "median",
                                 "third_quartile", "max", "outliers": [...]}]}
    * several axes yielding charts::

        {"type": "superchart", "title": <suptitle or None>,
         "elements": [<chart dict>, ...]}
    * otherwise ``{"type": "unknown", "title": ..., "elements": []}``.

    Units: an axis label ending in "(unit)" or "[unit]" gives that unit
    (e.g. "Temperature (°C)" -> "°C"); otherwise None.  The label itself is
    kept verbatim.  Empty titles/labels are None.  Numbers are plain Python
    floats, NaN/Inf become None.
"""


def __space_code_formatters():
    import math
    import re
    import sys
    import datetime as _dt

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter, JSONFormatter
    from IPython.utils.dir2 import get_real_method
    from traitlets import Unicode

    ip = get_ipython()
    if ip is None:
        return

    # ------------------------------------------------------------------ JSON
    def _key(k):
        if isinstance(k, str):
            return str(k)
        if k is None:
            return "null"
        if isinstance(k, bool):
            return "true" if k else "false"
        np = sys.modules.get("numpy")
        if np is not None and isinstance(k, np.generic):
            k = k.item()
            if isinstance(k, bool):
                return "true" if k else "false"
        if isinstance(k, float):
            if math.isnan(k):
                return "NaN"
            if math.isinf(k):
                return "Infinity" if k > 0 else "-Infinity"
            return repr(float(k))
        if isinstance(k, int):
            return str(int(k))
        return str(k)

    def _jsonable(value, iso_dates=False):
        """Convert ``value`` to plain JSON types (raises on cycles)."""
        active = set()
        pd = sys.modules.get("pandas")
        missing = ()
        if pd is not None:
            missing = tuple(
                m for m in (getattr(pd, "NaT", None), getattr(pd, "NA", None))
                if m is not None)

        def conv(v):
            if v is None or v is True or v is False:
                return v
            for m in missing:
                if v is m:
                    return None
            if isinstance(v, str):
                return str(v)
            if isinstance(v, bool):
                return bool(v)
            if isinstance(v, int):
                return int(v)
            if isinstance(v, float):
                f = float(v)
                return f if math.isfinite(f) else None
            if isinstance(v, (dict, list, tuple, set, frozenset)):
                ident = id(v)
                if ident in active:
                    raise ValueError("circular reference")
                active.add(ident)
                try:
                    if isinstance(v, dict):
                        return {_key(k): conv(x) for k, x in v.items()}
                    return [conv(x) for x in v]
                finally:
                    active.discard(ident)
            np = sys.modules.get("numpy")
            if np is not None:
                if isinstance(v, np.ndarray):
                    if v.dtype.kind in "mM":
                        # tolist() would turn datetime64[ns] into integers
                        return [conv(x) for x in v]
                    return conv(v.tolist())
                if isinstance(v, np.generic):
                    if isinstance(v, np.bool_):
                        return bool(v)
                    if isinstance(v, np.integer):
                        return int(v)
                    if isinstance(v, np.floating):
                        f = float(v)
                        return f if math.isfinite(f) else None
                    if isinstance(v, (np.datetime64, np.timedelta64)):
                        if np.isnat(v):
                            return None
                        if iso_dates and pd is not None and isinstance(v, np.datetime64):
                            return pd.Timestamp(v).isoformat()
                        return str(v)
                    item = v.item()
                    if isinstance(item, np.generic):
                        return str(v)
                    return conv(item)
            if iso_dates and isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
                return v.isoformat()
            return str(v)

        return conv(value)

    class _SpaceFormatter:
        """What the three formatters share: a printer registered for obj's type
        answers first, else the formatter's own _fallback(obj); disabled, or on
        any exception, None (a formatter must never break the display)."""

        def __call__(self, obj):
            if not self.enabled:
                return None
            try:
                try:
                    printer = self.lookup(obj)
                except KeyError:
                    printer = None
                if printer is not None:
                    return self._check_return(printer(obj), obj)
                return self._fallback(obj)
            except Exception:
                return None

    class SpaceJSONFormatter(_SpaceFormatter, JSONFormatter):
        """JSONFormatter that also renders plain dicts and lists."""

        def _fallback(self, obj):
            method = get_real_method(obj, self.print_method)
            if method is not None:
                return self._check_return(method(), obj)
            if isinstance(obj, (dict, list)):
                return _jsonable(obj)
            return None

    # ------------------------------------------------------------ DataFrame
    def _frame_data(df):
        raw = df.to_dict(orient="list")
        return {_key(k): _jsonable(list(col), iso_dates=True)
                for k, col in raw.items()}

    class SpaceDataFormatter(_SpaceFormatter, BaseFormatter):
        format_type = Unicode("e2b/data")
        _return_type = (dict,)

        def _fallback(self, obj):
            pd = sys.modules.get("pandas")
            frame_cls = getattr(pd, "DataFrame", None) if pd else None
            if frame_cls is not None and isinstance(obj, frame_cls):
                return _frame_data(obj)
            return None

    # ---------------------------------------------------------------- charts
    unit_re = re.compile(r"[\(\[]([^\(\)\[\]]+)[\)\]]\s*$")

    def _num(v):
        try:
            f = float(v)
        except Exception:
            return None
        return f if math.isfinite(f) else None

    def _text(s):
        if s is None:
            return None
        s = str(s)
        return s if s.strip() else None

    def _unit(label):
        if not label:
            return None
        m = unit_re.search(label)
        return _text(m.group(1).strip()) if m else None

    def _close(a, b, scale=0.0):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b), abs(scale))

    def _fmt_number(v):
        r = round(float(v), 10)
        if r.is_integer() and abs(r) < 1e15:
            return str(int(r))
        return repr(r)

    def _is_data_artist(artist, ax):
        try:
            return artist.get_transform().contains_branch(ax.transData)
        except Exception:
            return False

    def _ax_title(ax):
        for loc in ("center", "left", "right"):
            t = _text(ax.get_title(loc=loc))
            if t is not None:
                return t
        return None

    def _suptitle(fig):
        getter = getattr(fig, "get_suptitle", None)
        if callable(getter):
            return _text(getter())
        st = getattr(fig, "_suptitle", None)
        return _text(st.get_text()) if st is not None else None

    class AxisInfo:
        """Per-axis helpers: label, unit, scale and value conversion."""

        def __init__(self, ax, which):
            self.axis = ax.xaxis if which == "x" else ax.yaxis
            self.label = _text(ax.get_xlabel() if which == "x" else ax.get_ylabel())
            self.unit = _unit(self.label)
            self.period_freq = None
            self.categories = {}
            self._ticks = None
            getter = getattr(self.axis, "get_converter", None)
            conv = getter() if callable(getter) else getattr(self.axis, "converter", None)
            self.kind = None
            mcat = sys.modules.get("matplotlib.category")
            if mcat is not None and isinstance(conv, mcat.StrCategoryConverter):
                self.kind = "categorical"
                mapping = getattr(self.axis.units, "_mapping", None) or {}
                self.categories = {int(i): str(c) for c, i in mapping.items()}
            elif self._is_date(conv):
                self.kind = "datetime"
                if type(conv).__name__ == "PeriodConverter":
                    self.period_freq = getattr(ax, "freq", None)
            scale = ax.get_xscale() if which == "x" else ax.get_yscale()
            self.scale = self.kind or scale

        def _is_date(self, conv):
            mdates = sys.modules.get("matplotlib.dates")
            if mdates is None:
                return False
            conv_types = tuple(t for t in (
                getattr(mdates, "DateConverter", None),
                getattr(mdates, "ConciseDateConverter", None),
                getattr(mdates, "_SwitchableDateConverter", None)) if t)
            if conv is not None and conv_types and isinstance(conv, conv_types):
                return True
            if conv is not None and "date" in type(conv).__name__.lower():
                return True
            fmt_types = tuple(t for t in (
                getattr(mdates, "DateFormatter", None),
                getattr(mdates, "AutoDateFormatter", None),
                getattr(mdates, "ConciseDateFormatter", None)) if t)
            return bool(fmt_types) and isinstance(
                self.axis.get_major_formatter(), fmt_types)

        def iso(self, f):
            if self.period_freq is not None:
                pd = sys.modules.get("pandas")
                if pd is not None:
                    p = pd.Period(ordinal=int(round(f)), freq=self.period_freq)
                    return p.start_time.isoformat()
            mdates = sys.modules["matplotlib.dates"]
            d = mdates.num2date(f, tz=_dt.timezone.utc)
            return d.replace(tzinfo=None).isoformat()

        def value(self, v):
            """A converted (float) data coordinate in the axis' domain."""
            f = _num(v)
            if f is None:
                return None
            if self.kind == "datetime":
                try:
                    return self.iso(f)
                except Exception:
                    return f
            if self.kind == "categorical":
                i = int(round(f))
                if abs(f - i) < 1e-6 and i in self.categories:
                    return self.categories[i]
            return f

        def values(self, arr):
            """Vectorised ``value`` for a 1-D float array."""
            if self.kind is None:
                return [v if math.isfinite(v) else None for v in arr.tolist()]
            return [self.value(v) for v in arr.tolist()]

        def ticks(self):
            """Major tick positions/labels inside the view limits.

            Falls back to the labelled minor ticks when no major tick is in
            view (e.g. a log axis spanning less than a decade)."""
            axis = self.axis
            lo, hi = sorted(float(x) for x in axis.get_view_interval())
            tol = (hi - lo) * 1e-9 if math.isfinite(hi - lo) else 0.0

            def visible(locs, formatter, need_text):
                locs = [float(x) for x in locs]
                labels = list(formatter.format_ticks(locs))
                out_locs, out_labels = [], []
                for loc, lab in zip(locs, labels):
                    if not (math.isfinite(loc) and lo - tol <= loc <= hi + tol):
                        continue
                    if need_text and not str(lab).strip():
                        continue
                    out_locs.append(loc)
                    out_labels.append(str(lab))
                return out_locs, out_labels

            locs, labels = visible(axis.get_majorticklocs(),
                                   axis.get_major_formatter(), False)
            if not locs:
                try:
                    locs, labels = visible(axis.get_minorticklocs(),
                                           axis.get_minor_formatter(), True)
                except Exception:
                    locs, labels = [], []
            return locs, labels

        def position_label(self, center):
            """Label of a bar/box drawn at ``center`` on this axis."""
            if self.kind == "categorical":
                i = int(round(center))
                if abs(center - i) < 0.5 and i in self.categories:
                    return self.categories[i]
            mticker = sys.modules.get("matplotlib.ticker")
            # labels set explicitly (set_xticks(pos, labels), tick_label=,
            # boxplot labels): FixedFormatter, or a FuncFormatter over a
            # FixedLocator as matplotlib < 3.7 builds in set_ticklabels
            formatter = self.axis.get_major_formatter()
            explicit = mticker is not None and (
                isinstance(formatter, mticker.FixedFormatter)
                or (isinstance(formatter, mticker.FuncFormatter)
                    and isinstance(self.axis.get_major_locator(), mticker.FixedLocator)))
            if explicit:
                if self._ticks is None:
                    self._ticks = self.ticks()
                locs, labels = self._ticks
                best = None
                for loc, lab in zip(locs, labels):
                    d = abs(loc - center)
                    if best is None or d < best[0]:
                        best = (d, lab)
                if best is not None:
                    return best[1]
            if self.kind == "datetime":
                try:
                    return self.iso(center)
                except Exception:
                    pass
            return _fmt_number(center)

    def _base2d(ax, kind, xi, yi):
        return {
            "type": kind,
            "title": _ax_title(ax),
            "x_label": xi.label,
            "y_label": yi.label,
            "x_unit": xi.unit,
            "y_unit": yi.unit,
        }

    def _no_line(ls):
        return ls in (None, "None", "none", "", " ")

    def _errorbar_parts(ax):
        """(ids of errorbar cap lines, {id(data line): container label})."""
        mcont = sys.modules.get("matplotlib.container")
        caps, labels = set(), {}
        if mcont is not None:
            for c in ax.containers:
                if isinstance(c, mcont.ErrorbarContainer):
                    data_line, cap_lines = c.lines[0], c.lines[1]
                    for cap in (cap_lines or ()):
                        caps.add(id(cap))
                    if data_line is not None:
                        labels[id(data_line)] = str(c.get_label())
        return caps, labels

    def _data_lines(ax):
        caps, _ = _errorbar_parts(ax)
        return [ln for ln in ax.get_lines()
                if id(ln) not in caps and _is_data_artist(ln, ax)]

    def _point_chart(ax, xi, yi, lines):
        np = sys.modules["numpy"]
        mcoll = sys.modules.get("matplotlib.collections")
        _, errorbar_labels = _errorbar_parts(ax)
        series = []
        for ln in lines:
            xy = np.asarray(ln.get_xydata(), dtype=float).reshape(-1, 2)
            pts = [list(p) for p in zip(xi.values(xy[:, 0]), yi.values(xy[:, 1]))]
            marker_only = _no_line(ln.get_linestyle()) and not _no_line(ln.get_marker())
            label = errorbar_labels.get(id(ln), str(ln.get_label()))
            series.append((marker_only, {"label": label, "points": pts}))
        if mcoll is not None:
            for coll in ax.collections:
                if not isinstance(coll, mcoll.PathCollection):
                    continue
                get_t = getattr(coll, "get_offset_transform", None) or coll.get_transform
                try:
                    if not get_t().contains_branch(ax.transData):
                        continue
                except Exception:
                    continue
                offs = coll.get_offsets()
                mask = np.ma.getmaskarray(offs).reshape(-1, 2)
                data = np.asarray(np.ma.getdata(offs), dtype=float).reshape(-1, 2)
                data = data[~mask.any(axis=1)]
                pts = [list(p) for p in zip(xi.values(data[:, 0]), yi.values(data[:, 1]))]
                series.append((True, {"label": str(coll.get_label()), "points": pts}))
        if not series:
            return None
        kind = "scatter" if all(s[0] for s in series) else "line"
        chart = _base2d(ax, kind, xi, yi)
        for name, info in (("x", xi), ("y", yi)):
            locs, labels = info.ticks()
            chart[name + "_ticks"] = [info.value(v if info.kind else float("%.12g" % v))
                                      for v in locs]
            chart[name + "_tick_labels"] = labels
            chart[name + "_scale"] = info.scale
        chart["elements"] = [s[1] for s in series]
        return chart

    def _bar_chart(ax, xi, yi, containers):
        elements = []
        for c in containers:
            horizontal = getattr(c, "orientation", None) == "horizontal"
            group = str(c.get_label())
            for p in c.patches:
                if horizontal:
                    center = p.get_y() + p.get_height() / 2.0
                    value = p.get_width()
                    label = yi.position_label(center)
                else:
                    center = p.get_x() + p.get_width() / 2.0
                    value = p.get_height()
                    label = xi.position_label(center)
                elements.append({"label": label, "group": group, "value": _num(value)})
        chart = _base2d(ax, "bar", xi, yi)
        chart["elements"] = elements
        return chart

    def _pie_chart(ax, wedges):
        return {
            "type": "pie",
            "title": _ax_title(ax),
            "elements": [{"label": str(w.get_label()),
                          "angle": _num(w.theta2 - w.theta1),
                          "radius": _num(w.r)} for w in wedges],
        }

    def _find_boxes(ax, lines, vertical):
        """Recognise boxplot artists; returns [(position, stats dict)]."""
        np = sys.modules["numpy"]
        mpatches = sys.modules.get("matplotlib.patches")

        def frame(arr):
            a = np.asarray(arr, dtype=float).reshape(-1, 2)
            return a if vertical else a[:, ::-1]

        line_data = [(ln, frame(ln.get_xydata())) for ln in lines]
        candidates = []
        for ln, a in line_data:
            if len(a) >= 5 and np.all(np.isfinite(a)) and np.allclose(a[0], a[-1]):
                candidates.append((ln, a))
        if mpatches is not None:
            for p in ax.patches:
                if isinstance(p, mpatches.PathPatch) and _is_data_artist(p, ax):
                    a = frame(p.get_path().vertices)
                    if len(a) >= 5 and np.all(np.isfinite(a)):
                        candidates.append((p, a))
        segments = [(ln, a) for ln, a in line_data if len(a) == 2 and np.all(np.isfinite(a))]
        boxes = []
        for art, a in candidates:
            p0, p1 = float(a[:, 0].min()), float(a[:, 0].max())
            if not p1 > p0:
                continue
            width = p1 - p0
            pos = (p0 + p1) / 2.0
            # the quartiles are the edges spanning the whole box width (a
            # notch may reach beyond them, so the bounding box is not enough)
            edges = []
            for (pa, va), (pb, vb) in zip(a[:-1], a[1:]):
                if va == vb and min(pa, pb) <= p0 + width * 1e-9 \
                        and max(pa, pb) >= p1 - width * 1e-9:
                    edges.append(float(va))
            if not edges:
                continue
            v0, v1 = min(edges), max(edges)
            vscale = max(abs(v0), abs(v1), v1 - v0)
            lo_w = hi_w = None
            for ln, s in segments:
                if not (_close(s[0, 0], pos, width) and _close(s[1, 0], pos, width)):
                    continue
                ends = [float(s[0, 1]), float(s[1, 1])]
                if lo_w is None and any(_close(e, v0, vscale) for e in ends) \
                        and min(ends) <= v0 + 1e-9 * max(1.0, vscale):
                    lo_w = (ln, min(ends))
                    continue
                if hi_w is None and any(_close(e, v1, vscale) for e in ends) \
                        and max(ends) >= v1 - 1e-9 * max(1.0, vscale):
                    hi_w = (ln, max(ends))
            if lo_w is None or hi_w is None:
                continue
            lo, hi = lo_w[1], hi_w[1]
            med_full = med_inner = med_any = None
            tol_p = width * 1e-6
            tol_v = 1e-9 * max(1.0, vscale, abs(lo), abs(hi))

            def across_box(s):
                """A horizontal segment crossing the box centre."""
                if len(s) != 2 or not _close(s[0, 1], s[1, 1], vscale):
                    return False
                sp0, sp1 = float(s[:, 0].min()), float(s[:, 0].max())
                return p0 - tol_p <= sp0 < pos < sp1 <= p1 + tol_p

            def horizontal_in_box(s):
                return across_box(s) and v0 - tol_v <= float(s[0, 1]) <= v1 + tol_v

            for ln, s in segments:
                if ln is lo_w[0] or ln is hi_w[0] or not horizontal_in_box(s):
                    continue
                v = float(s[0, 1])
                sp0, sp1 = float(s[:, 0].min()), float(s[:, 0].max())
                if med_full is None and _close(sp0, p0, width) and _close(sp1, p1, width):
                    med_full = (ln, v)
                if med_inner is None and not (_close(v, lo, vscale) or _close(v, hi, vscale)):
                    med_inner = (ln, v)
                if med_any is None:
                    med_any = (ln, v)
            median = next((m for m in (med_full, med_inner, med_any) if m is not None), None)
            if median is None:
                continue
            # bxp draws, after the median: the mean (marker or dashed line,
            # optional) and then the fliers (marker-only line at the box
            # position, possibly empty).
            markers = []
            index = next(i for i, (ln, _) in enumerate(line_data) if ln is median[0])
            for ln, s in line_data[index + 1:index + 3]:
                if _no_line(ln.get_linestyle()) and all(
                        _close(float(x), pos, width) for x in s[:, 0]):
                    markers.append(s)
                elif across_box(s):
                    continue
                else:
                    break
            outliers = []
            if markers:
                values = [float(x) for x in markers[-1][:, 1] if math.isfinite(x)]
                if len(markers) == 1:
                    # could be a lone mean marker: keep values beyond whiskers
                    values = [x for x in values if x < lo - tol_v or x > hi + tol_v]
                outliers = values
            boxes.append((pos, {"min": _num(lo), "first_quartile": _num(v0),
                                "median": _num(median[1]), "third_quartile": _num(v1),
                                "max": _num(hi), "outliers": outliers}))
        return boxes

    def _box_chart(ax, xi, yi, lines):
        for vertical in (True, False):
            boxes = _find_boxes(ax, lines, vertical)
            if boxes:
                pos_info = xi if vertical else yi
                chart = _base2d(ax, "box_and_whisker", xi, yi)
                elements = []
                for pos, stats in boxes:
                    el = {"label": pos_info.position_label(pos)}
                    el.update(stats)
                    elements.append(el)
                chart["elements"] = elements
                return chart
        return None

    def _axes_chart(ax):
        if not ax.get_visible():
            return None
        xi, yi = AxisInfo(ax, "x"), AxisInfo(ax, "y")
        lines = _data_lines(ax)
        chart = _box_chart(ax, xi, yi, lines)
        if chart is not None:
            return chart
        mcont = sys.modules.get("matplotlib.container")
        bars = [c for c in ax.containers
                if mcont is not None and isinstance(c, mcont.BarContainer)]
        if bars:
            return _bar_chart(ax, xi, yi, bars)
        mpatches = sys.modules.get("matplotlib.patches")
        wedges = [p for p in ax.patches
                  if mpatches is not None and isinstance(p, mpatches.Wedge)]
        if wedges:
            return _pie_chart(ax, wedges)
        return _point_chart(ax, xi, yi, lines)

    def _figure_chart(fig):
        charts = []
        first_title = None
        for ax in fig.get_axes():
            try:
                if first_title is None:
                    first_title = _ax_title(ax)
                chart = _axes_chart(ax)
            except Exception:
                chart = None
            if chart is not None and chart.get("type") != "unknown":
                charts.append(chart)
        sup = _suptitle(fig)
        if not charts:
            return {"type": "unknown", "title": sup or first_title, "elements": []}
        if len(charts) == 1:
            chart = charts[0]
            if chart.get("title") is None and sup is not None:
                chart["title"] = sup
            return chart
        return {"type": "superchart", "title": sup, "elements": charts}

    class SpaceChartFormatter(_SpaceFormatter, BaseFormatter):
        format_type = Unicode("e2b/chart")
        _return_type = (dict,)

        def _fallback(self, obj):
            if "matplotlib" not in sys.modules or "numpy" not in sys.modules:
                return None
            mfig = sys.modules.get("matplotlib.figure")
            if mfig is None or not isinstance(obj, mfig.Figure):
                return None
            return _figure_chart(obj)

    # -------------------------------------------------------------- register
    display_formatter = ip.display_formatter
    formatters = display_formatter.formatters
    old_json = formatters.get("application/json")
    new_json = SpaceJSONFormatter(parent=display_formatter)
    if old_json is not None:
        new_json.type_printers.update(old_json.type_printers)
        new_json.deferred_printers.update(old_json.deferred_printers)
        new_json.singleton_printers.update(old_json.singleton_printers)
        new_json.enabled = old_json.enabled
    formatters["application/json"] = new_json
    formatters["e2b/data"] = SpaceDataFormatter(parent=display_formatter)
    formatters["e2b/chart"] = SpaceChartFormatter(parent=display_formatter)

    active = list(display_formatter.active_types)
    changed = False
    for mime in ("application/json", "e2b/data", "e2b/chart"):
        if mime not in active:
            active.append(mime)
            changed = True
    if changed:
        display_formatter.active_types = active
    else:
        for mime in ("application/json", "e2b/data", "e2b/chart"):
            formatters[mime].enabled = True
