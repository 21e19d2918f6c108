"""repo.check_layers: scripts/check-layers on a small made-up tree: it passes a clean one and
names each include that goes up, sideways or to h2o from core."""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "check-layers")
TABLE = """# x

## Layers

| folder | may include |
| --- | --- |
| base/ | |
| core/low/ | base/ |
| core/high/ | base/ core/low/ |
| api/ | base/ core/ |

## Next
| other/ | base/ |
"""


class CheckLayersTest(unittest.TestCase):
    def tree(self, files):
        d = tempfile.mkdtemp(prefix="layers-")
        subprocess.check_call(["git", "init", "-q", d])
        with open(os.path.join(d, "ARCHITECTURE.md"), "w") as f:
            f.write(TABLE)
        for path, text in files.items():
            os.makedirs(os.path.join(d, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(d, path), "w") as f:
                f.write(text)
        subprocess.check_call(["git", "-C", d, "add", "-A"])
        return d

    def run_on(self, d):
        r = subprocess.run([sys.executable, SCRIPT, d], capture_output=True, text=True)
        return r.returncode, r.stdout

    def test_clean_tree_passes(self):
        d = self.tree({"base/a.h": "", "core/low/l.c": '#include "base/a.h"\n',
                       "core/high/h.c": '#include "core/low/l.h"\n#include "core/high/x.h"\n',
                       "api/r.c": '#include "core/high/h.h"\n#include <h2o.h>\n',
                       "e2e/t.c": '#include "api/r.h"\n',
                       "core/low/tests/t.c": '#include "api/r.h"\n'})
        self.assertEqual(self.run_on(d), (0, "check-layers: 6 files, layers hold\n"))

    def test_each_bad_include_is_named(self):
        d = self.tree({"base/a.c": '#include "core/low/l.h"\n',
                       "core/low/l.c": '#include "core/high/h.h"\n#include <h2o.h>\n',
                       "core/high/h.c": '  #  include "api/r.h"\n',
                       "other/o.c": '#include "api/r.h"\n'})
        rc, out = self.run_on(d)
        self.assertEqual(rc, 1, out)
        lines = out.splitlines()
        self.assertEqual(len(lines), 4, out)  # other/ is not in the table's section
        self.assertTrue(lines[0].startswith("base/a.c:1: base/ may not include core/low/l.h"))
        self.assertIn("core/low/l.c:1: core/low/ may not include core/high/h.h", out)
        self.assertIn("core/low/l.c:2: core/low/ may not include <h2o.h>", out)
        self.assertIn("core/high/h.c:1: core/high/ may not include api/r.h", out)


if __name__ == "__main__":
    unittest.main()
