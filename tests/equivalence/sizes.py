"""Line counts of the largest functions and classes of the package (for the architecture report).

    python tests/equivalence/sizes.py [ROOT] [N]
"""
import ast
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
n = int(sys.argv[2]) if len(sys.argv) > 2 else 15
rows = []
for path in sorted((root / "exdyna_mpi").rglob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "def"
            rows.append((node.end_lineno - node.lineno + 1, kind, f"{path.relative_to(root)}:{node.name}"))
for kind in ("class", "def"):
    print(f"largest {kind}:")
    for size, _, name in sorted((r for r in rows if r[1] == kind), reverse=True)[:n]:
        print(f"  {size:5d}  {name}")
