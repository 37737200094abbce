"""Share of the package's lines that are docstrings or comments (Python via ast/tokenize, C by `//` and `/* */`).

Usage: python scripts/prose_ratio.py [root] [--per-file N]  — prints the total and the N files with the most prose.
"""
import ast
import io
import pathlib
import sys
import tokenize


def python_prose_lines(text: str) -> set[int]:
    lines: set[int] = set()
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
    return lines


def c_prose_lines(text: str) -> set[int]:
    lines: set[int] = set()
    in_block = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if in_block:
            lines.add(number)
            in_block = "*/" not in stripped
        elif "/*" in stripped:
            lines.add(number)
            in_block = "*/" not in stripped.split("/*", 1)[1]
        elif "//" in stripped:
            lines.add(number)
    return lines


def measure(root: pathlib.Path) -> list[tuple[str, int, int]]:
    rows = []
    for path in sorted(root.rglob("*")):
        if path.suffix == ".py":
            text = path.read_text()
            prose = python_prose_lines(text)
        elif path.suffix in (".c", ".h"):
            text = path.read_text()
            prose = c_prose_lines(text)
        else:
            continue
        rows.append((str(path), len(prose), len(text.splitlines())))
    return rows


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    root = pathlib.Path(args[0] if args else "pagedllm")
    top = int(sys.argv[sys.argv.index("--per-file") + 1]) if "--per-file" in sys.argv else 0
    rows = measure(root)
    prose = sum(r[1] for r in rows)
    total = sum(r[2] for r in rows)
    print(f"{root}: {prose} prose lines of {total} ({100 * prose / total:.1f}%) in {len(rows)} files")
    for name, p, t in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"  {p:5d}/{t:5d} {100 * p / max(t, 1):5.1f}%  {name}")


if __name__ == "__main__":
    main()
