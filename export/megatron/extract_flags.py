#!/usr/bin/env python3
"""Megatron-LM's command-line flag names at a release tag, read statically from its source.

Usage: extract_flags.py MEGATRON_GIT_DIR TAG > export/megatron/flags/TAG.txt

Megatron-LM's argument parser (megatron/training/arguments.py) is not on the Python
registry, so shardwright records each supported release's flag names as data and checks
its exports against them in the normal test run. The names come from two places:

- literal `add_argument('--name', ...)` calls in megatron/training/arguments.py;
- from core_v0.16 on, `ArgumentGroupFactory(ConfigClass, exclude=[...])` groups, which
  turn every dataclass field (inherited ones included, `init=False` and excluded ones
  skipped) into `--field-name`, a bool field whose default is not False into
  `--no-field-name` and `--disable-field-name` (store_false), and take
  `metadata={"argparse_meta": {"arg_names": [...]}}` over both
  (megatron/training/argument_utils.py).

Only the standard library and `git show` are used: nothing of Megatron is imported.
"""
import ast
import subprocess
import sys

GIT, TAG = sys.argv[1], sys.argv[2]


def show(path):
    r = subprocess.run(["git", "-C", GIT, "show", f"{TAG}:{path}"], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def module_file(mod):
    base = mod.replace(".", "/")
    for p in (base + ".py", base + "/__init__.py"):
        if show(p) is not None:
            return p
    return None


def imports_of(tree, path):
    """name -> module it is imported from (relative imports resolved against path)."""
    out = {}
    pkg = path.rsplit("/", 1)[0].replace("/", ".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                mod = ".".join(parts + ([mod] if mod else []))
            for a in node.names:
                out[a.asname or a.name] = mod
    return out


def find_class(name, path, depth=0):
    """(ClassDef, file) of `name` as seen from `path`, following imports and re-exports."""
    src = show(path)
    if src is None or depth > 6:
        return None
    tree = ast.parse(src)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, path
    mod = imports_of(tree, path).get(name)
    if mod is None:
        return None
    f = module_file(mod)
    return find_class(name, f, depth + 1) if f else None


def lit_list(node, scope):
    if node is None:
        return []
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    if isinstance(node, ast.Name):
        vals = []
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets):
                vals = lit_list(n.value, scope)
        return vals
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return lit_list(node.left, scope) + lit_list(node.right, scope)
    raise SystemExit(f"{TAG}: cannot read the exclude list {ast.dump(node)[:200]}")


def is_bool(ann):
    if isinstance(ann, ast.Name):
        return ann.id == "bool"
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return is_bool(ann.slice)
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return is_bool(ann.left) and isinstance(ann.right, ast.Constant) and ann.right.value is None
    return False


def field_default(value):
    """(default constant or a marker, init flag, argparse arg_names or None)."""
    if value is None:
        return ("MISSING", True, None)
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
        default, init, names = "MISSING", True, None
        for k in value.keywords:
            if k.arg == "default":
                default = k.value.value if isinstance(k.value, ast.Constant) else "EXPR"
            elif k.arg == "init" and isinstance(k.value, ast.Constant):
                init = k.value.value
            elif k.arg == "metadata" and isinstance(k.value, ast.Dict):
                for mk, mv in zip(k.value.keys, k.value.values):
                    if isinstance(mk, ast.Constant) and mk.value == "argparse_meta" and isinstance(mv, ast.Dict):
                        for ak, av in zip(mv.keys, mv.values):
                            if isinstance(ak, ast.Constant) and ak.value == "arg_names":
                                names = lit_list(av, mv)
        return (default, init, names)
    if isinstance(value, ast.Constant):
        return (value.value, True, None)
    return ("EXPR", True, None)


def class_fields(name, path):
    found = find_class(name, path)
    if found is None:
        raise SystemExit(f"{TAG}: class {name} not found from {path}")
    cls, cpath = found
    fields = {}
    for b in cls.bases:
        bname = b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)
        if bname and bname not in ("object", "ABC"):
            try:
                fields.update(class_fields(bname, cpath))
            except SystemExit:
                pass
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            ann = ast.unparse(node.annotation)
            if "ClassVar" in ann or "InitVar" in ann:
                continue
            default, init, names = field_default(node.value)
            fields[node.target.id] = (node.annotation, default, init, names)
    return fields


def flag(name, prefix=None):
    return "--" + ((prefix + "_" + name) if prefix else name).replace("_", "-")


def main():
    path = "megatron/training/arguments.py"
    tree = ast.parse(show(path))
    flags = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for call in ast.walk(fn):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr == "add_argument":
                for a in call.args:
                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"):
                        flags.add(a.value)
            if isinstance(f, ast.Name) and f.id == "ArgumentGroupFactory":
                cls = call.args[0].id
                exclude = set()
                for k in call.keywords:
                    if k.arg == "exclude":
                        exclude = set(lit_list(k.value, fn))
                for fname, (ann, default, init, names) in class_fields(cls, path).items():
                    if fname in exclude or init is False:
                        continue
                    if names:
                        flags.update(n for n in names if n.startswith("--"))
                    elif is_bool(ann) and default is not False:
                        flags.update([flag(fname, "no"), flag(fname, "disable")])
                    else:
                        flags.add(flag(fname))
    for f in sorted(flags):
        print(f)


main()
