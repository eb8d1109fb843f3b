"""Static source policy: the first of the evaluator's two lines of defence.

A candidate is kernel code. It has no business introspecting the evaluator (frames, gc),
starting threads or processes, touching files or the clock, patching modules, or defining
tensor subclasses that compute lazily. Such code is rejected before it runs, with a reason.
It is a filter, not the boundary: an AST check can be dodged by enough obfuscation, so
nothing the evaluator concludes depends on it (the red-team tests run with it off). The
boundary is the process, its isolation and the checks in evaluator.py.
"""

from __future__ import annotations

import ast

FORBIDDEN_MODULES = frozenset({
    "gc", "inspect", "ctypes", "cffi", "threading", "_thread", "multiprocessing", "concurrent",
    "subprocess", "signal", "socket", "asyncio", "os", "sys", "pathlib", "io", "shutil",
    "tempfile", "pickle", "marshal", "importlib", "builtins", "time", "resource", "code",
    "codeop", "types", "atexit", "sched", "faulthandler", "mmap", "secrets", "random",
    "posix", "nt", "pkgutil", "_posixsubprocess", "_ctypes", "_signal", "_socket", "_io",
    "runpy", "zipimport", "pty", "fcntl", "termios", "select", "selectors", "_posixshmem",
    "traceback", "string",
})  # fmt: skip
FORBIDDEN_PREFIXES = ("wanka.lab", "torch.multiprocessing", "torch.cuda.streams")
FORBIDDEN_CALLS = frozenset({
    "eval", "exec", "compile", "__import__", "globals", "locals", "vars", "open", "setattr",
    "delattr", "breakpoint", "input", "memoryview",
})  # fmt: skip
# Builtins that must only appear as the function of a call (`E = exec` or passing getattr
# to functools.partial would hide every later use from the call checks).
ALIASABLE = FORBIDDEN_CALLS | {"getattr", "hasattr", "type"}
# Frame / code / subclass walking, lazy tensor hooks, side streams.
FORBIDDEN_ATTRS = frozenset({
    "f_back", "f_locals", "f_globals", "tb_frame", "gi_frame", "_getframe", "Stream",
    "stream", "set_stream", "__torch_function__", "__torch_dispatch__", "Thread",
})  # fmt: skip
ALLOWED_DUNDERS = frozenset({"__init__", "__name__", "__doc__"})
# Names that reach processes, files, the interpreter or the thread pool however they are
# reached: `torch.os._exit`, `np.sys.modules[...]`, `getattr(torch, "os")`, `from torch import
# os`. Denied as attributes, constant getattr/setattr names and imported names, anywhere.
DENIED_NAMES = frozenset({
    "os", "sys", "subprocess", "ctypes", "cffi", "builtins", "importlib", "gc", "inspect",
    "threading", "_thread", "multiprocessing", "signal", "socket", "shutil", "pathlib",
    "tempfile", "pickle", "marshal", "mmap", "resource", "faulthandler", "atexit",
    "_exit", "exit", "abort", "fork", "forkpty", "_fork", "system", "popen", "Popen",
    "posix_spawn", "posix_spawnp", "kill", "killpg", "modules", "dlopen", "CDLL", "PyDLL",
    "cdll", "pydll", "pythonapi", "set_num_threads", "set_num_interop_threads",
    "_set_num_threads", "_set_num_interop_threads", "cpp_extension", "load_inline", "hub",
    "load_library", "fdopen", "unlink", "write_text", "write_bytes", "chdir", "setrlimit",
    "environ", "putenv", "dup2", "save", "savez", "savez_compressed", "savetxt", "tofile",
    "_open_file", "_open_zipfile_writer", "methodcaller", "attrgetter", "lab", "worker",
    "evaluator", "servers", "sandbox", "zygote", "resolve_name", "import_module", "setsid",
    "memfd_create", "prctl", "_libc", "shm_open", "walk_stack", "walk_tb", "get_field",
    "f_back", "f_locals", "f_globals", "f_code", "tb_frame", "gi_frame", "_getframe",
})  # fmt: skip
DENIED_PREFIXES = ("exec", "spawn", "_exec", "_spawn")
# Dunders that are fine to read in kernel code but reach the interpreter when read or
# written: any dunder outside ALLOWED_DUNDERS is denied already; these are listed for the
# constant-string getattr/setattr case.
DENIED_DUNDERS = frozenset({
    "__file__", "__code__", "__globals__", "__builtins__", "__dict__", "__class__",
    "__subclasses__", "__loader__", "__spec__", "__closure__", "__import__",
})  # fmt: skip


def denied_name(name: str) -> bool:
    """A name that must not appear as an attribute (or constant getattr name) anywhere."""
    if name in DENIED_NAMES or name in DENIED_DUNDERS or name in FORBIDDEN_ATTRS:
        return True
    if name.startswith("__") and name not in ALLOWED_DUNDERS:
        return True
    return name.startswith(DENIED_PREFIXES)


def check_source(source: str) -> list[str]:
    """Violations of the policy (empty when the source may run). Syntax errors count."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [f"syntax error line {e.lineno}: {e.msg}"]
    out: list[str] = []
    modules = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
               if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}  # fmt: skip

    def bad_module(name: str) -> bool:
        if name.startswith("wanka.lab.tasks."):  # task references, as importable as wanka.ops
            return False
        return name.split(".")[0] in FORBIDDEN_MODULES or name.startswith(FORBIDDEN_PREFIXES)

    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import of {a.name}" for a in node.names if bad_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level or bad_module(mod):
                out.append(f"{where}: import from {'.' * node.level}{mod}")
            out += [f"{where}: import of {a.name} from {mod}" for a in node.names
                    if a.name == "*" or denied_name(a.name)]  # fmt: skip
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name == "type" and len(node.args) == 3:
                out.append(f"{where}: type() with 3 arguments (a class built at run time)")
            if name in FORBIDDEN_CALLS:
                out.append(f"{where}: call of {name}()")
            elif name in ("getattr", "hasattr"):
                key = node.args[1] if len(node.args) >= 2 else None
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    out.append(f"{where}: {name}() with a computed attribute name")
                elif denied_name(key.value):
                    out.append(f"{where}: {name}() of {key.value}")
        elif isinstance(node, ast.Attribute):
            if denied_name(node.attr):
                out.append(f"{where}: attribute {node.attr}")
        elif isinstance(node, ast.Name) and node.id in ALIASABLE and id(node) not in called:
            out.append(f"{where}: {node.id} used other than by calling it (an alias)")
        elif isinstance(node, ast.Name) and (
            node.id in ("__builtins__", "__loader__", "__spec__", "__file__")
            or (node.id.startswith("__") and node.id not in ALLOWED_DUNDERS)
        ):
            out.append(f"{where}: name {node.id}")
        elif isinstance(node, ast.FunctionDef) and node.name in FORBIDDEN_ATTRS:
            out.append(f"{where}: defines {node.name}")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:  # monkey-patching: assigning into an imported module or class
                root = t
                while isinstance(root, ast.Attribute | ast.Subscript):
                    root = root.value
                if t is not root and isinstance(root, ast.Name) and root.id in modules:
                    out.append(f"{where}: assigns into imported {root.id}")
    if not any(isinstance(n, ast.FunctionDef | ast.ImportFrom | ast.Assign) for n in tree.body):
        out.append("defines nothing: a candidate must provide kernel(...)")
    return out
