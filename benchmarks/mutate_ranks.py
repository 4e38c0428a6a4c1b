"""Which rank-safety mechanism does a test pin? ``python mutate_ranks.py NAME CHECKOUT`` switches
one mechanism off in a copy of the checkout (its function returns at once, or its condition
reads False); ``control`` changes nothing (the same load, no mutation: what fails there is no
evidence). ``mutate_ranks.sh NAME...`` runs the rank tests on each, all at once (a 16-CPU
host). Session 20 ran five of them on 2 cores
(``results/mutations_rank_safety_b23615a_2026-12-07/``, its script in git history)."""
import ast, sys
from pathlib import Path

FUNCS = {  # name: (file, function, what it returns at once)
    "evidence": ("agreement.py", "_evidence", "None"),
    "uncompiled": ("agreement.py", "_uncompiled", "None"),
    "busy": ("agreement.py", "_busy", "None"),
    "gone": ("store.py", "gone", "None"),
    "guarded_apart": ("agreement.py", "_guarded_apart", "None"),
    "module_value": ("agreement.py", "_module_value", "None"),
    "varied": ("agreement.py", "_varied", "None"),
    "misplaced": ("agreement.py", "_misplaced", "None"),
    "inside": ("agreement.py", "_inside", "None"),
    "runs_original": ("hooks.py", "_runs_original", "False"),
    "limit_name": ("hooks.py", "_limit", "None"),
    "cut_at": ("agreement.py", "cut_at", "None"),
}
REPLACE = {  # name: (file, old, new)
    "covered": ("../checked.py", "                self.covered.add(group)", "                pass"),
    "alone": ("agreement.py", "        if (alone := self.family if self.family in self.env.alone else self.inside):",
              "        if False and (alone := self.family if self.family in self.env.alone else self.inside):"),
    "logging_reordered": ("hooks.py", "    if not env.rewritten or family(",
                          "    if True or not env.rewritten or family("),
    "half_timeout": ("agreement.py", "            if t is not None and t / 2 < limit:", "            if False:"),
    "recut_wait": ("agreement.py",
                   "        if (self.marked or self.later or self.checked_only) and RECUT_WAIT_S < limit:",
                   "        if False:"),
}


def func(path: Path, name: str, value: str) -> None:
    src = path.read_text()
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == name)
    first = node.body[0]
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    lines = src.splitlines(keepends=True)
    at = first.end_lineno if doc else first.lineno - 1
    indent = " " * first.col_offset
    lines.insert(at, f"{indent}return {value}  # MUTATION\n")
    path.write_text("".join(lines))


m, ROOT = sys.argv[1], Path(sys.argv[2]) / "fxcoalesce" / "ranks"
if m == "control":
    pass
elif m in FUNCS:
    f, name, value = FUNCS[m]
    func(ROOT / f, name, value)
else:
    f, old, new = REPLACE[m]
    p = ROOT / f
    s = p.read_text()
    assert s.count(old) == 1, (m, s.count(old))
    p.write_text(s.replace(old, new))
print("applied", m)
