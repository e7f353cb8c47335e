"""Count a tree's Python lines at a git revision: non-blank non-comment lines, and code-only lines
(docstrings excluded too), per file and in total.

    python scripts/count_lines.py REV PATH [PATH ...] [--per-file]
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            is_str = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
            # a leading docstring, or an attribute docstring (a bare string after a statement)
            if is_str and (i == 0 or isinstance(body[i - 1], ast.Assign | ast.AnnAssign)):
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def count(source: str) -> tuple[int, int]:
    """(non-blank non-comment lines, code-only lines) of one module."""
    plain = sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))
    docs = _docstring_lines(ast.parse(source))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _SKIP:
            code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return plain, len(code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev")
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--per-file", action="store_true")
    args = ap.parse_args()
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", args.rev, "--", *args.paths],
                           capture_output=True, text=True, check=True).stdout.split()
    total = [0, 0]
    for name in sorted(n for n in names if n.endswith(".py")):
        source = subprocess.run(["git", "show", f"{args.rev}:{name}"], capture_output=True, text=True, check=True).stdout
        plain, code = count(source)
        total[0] += plain
        total[1] += code
        if args.per_file:
            print(f"{plain:6d} {code:6d}  {name}")
    print(f"{total[0]:6d} {total[1]:6d}  total at {args.rev} (non-blank non-comment, code-only)")


if __name__ == "__main__":
    main()
