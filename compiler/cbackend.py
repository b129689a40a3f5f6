"""The C backend: a Relax module -> kernels object + generated C entry points -> native library.

Route (chosen over implementing tvm-ffi's object model for ``exec_mode="compiled"``): the
Relax module is lowered with TVM's default pipeline, which plans every buffer statically
(``R.vm.alloc_storage`` / ``alloc_tensor`` with constant sizes). The kernels (TIR PrimFuncs)
are compiled by TVM's LLVM backend for the preset's own target dict into one object file
(so tuned schedules and vector ISAs such as RVV apply), and each Relax function becomes a
plain C function, generated here, that places the planned buffers in one caller-provided
workspace and calls the kernels in order through their packed ``__tvm_ffi_<name>`` ABI with
DLTensor pointers. The small runtime in ``compiler/cruntime`` supplies what kernels call
(error parts, workspace allocation, a pthreads pool for parallel loops). No TVM runtime, no C++, no
serialized executable: the same sources build with any C compiler for any board.

Outputs (per build, cached by the hash of every input under ``.cache/cbackend``):

    libmodel.so   the model, for ctypes (:class:`CLibrary`)
    fractal-run   a runner: ``fractal-run FUNC IN_DIR OUT_DIR`` on .npy files (see fractal_run.c)

Functions whose parameters are tuples (the training optimizer) take their leaves flattened,
depth first; tuple results are returned flattened the same way.

An entry point can check inputs before any kernel runs (:class:`InputCheck`): the training step's
class ids must lie in [0, classes) (the loss kernels index memory by them) and regression targets
must be finite. The check is compiled into the library, so every caller (ctypes, the runner, a
program that links ``libmodel.so``) gets an error instead of an out-of-bounds access.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compiler.clib import LIB_NAME, RUNNER_NAME, CLibrary, CSignature, TensorDesc
from compiler.errors import CompilerError, ModelError, TargetError

__all__ = ["CSignature", "TensorDesc", "InputCheck", "generate_entry", "lower", "build_native", "compile_c",
           "CLibrary", "NativeBuild", "RUNTIME_DIR", "LIB_NAME", "RUNNER_NAME", "c_compiler_for"]

RUNTIME_DIR = Path(__file__).resolve().parent / "cruntime"
_CACHE_ENV = "FRACTAL_CBACKEND_CACHE"
_REPO_ROOT = Path(__file__).resolve().parent.parent
_MAX_DIMS = 8
_C_CC = {"x86_64": "gcc", "aarch64": "aarch64-linux-gnu-gcc", "riscv64": "riscv64-linux-gnu-gcc"}
# DLPack type codes
_DL_CODES = {"int": 0, "uint": 1, "float": 2, "bool": 6}
_IGNORED_EXTERNS = {"vm.builtin.check_tensor_info", "vm.builtin.match_shape", "vm.builtin.check_tuple_info",
                    "vm.builtin.check_shape_info", "vm.builtin.check_prim_value_info"}


# --------------------------------------------------------------------------------------------
# lowering and entry-point generation


@dataclass(frozen=True)
class InputCheck:
    """A check an entry point runs on one flattened input before any kernel.

    ``index``: the input (negative: from the end). ``classes``: the input holds int64 class ids
    that must lie in [0, classes); None: the input holds floats that must be finite."""

    index: int
    what: str
    classes: int | None = None


def lower(mod: Any, target: Any) -> Any:
    """Relax's default build pipeline (legalize, plan memory, lower to VM builtins) under ``target``."""
    from tvm import relax

    try:
        with target:
            return relax.get_pipeline("default")(mod)
    except Exception as exc:
        raise CompilerError(f"TVM failed to lower the model: {' '.join(str(exc).split())[:300]}",
                            hint="report the model") from None


def _dtype_parts(dtype: str) -> tuple[int, int]:
    if dtype == "bool":
        return _DL_CODES["bool"], 8
    for kind in ("uint", "int", "float"):
        if dtype.startswith(kind) and dtype[len(kind):].isdigit():
            return _DL_CODES[kind], int(dtype[len(kind):])
    raise ModelError(f"the C backend does not support dtype {dtype}", hint="use a float/int model")


def _static_shape(shape: Any, what: str) -> tuple[int, ...]:
    dims = []
    for d in shape:
        if not hasattr(d, "value"):
            raise ModelError(f"the C backend needs static shapes; {what} has a symbolic dimension {d}",
                             hint="fix every dimension with --shape NAME=D0,D1,... (the batch too)")
        dims.append(int(d.value))
    if len(dims) > _MAX_DIMS:
        raise ModelError(f"{what} has rank {len(dims)}; the C backend supports up to {_MAX_DIMS}",
                         hint="reshape the model")
    return tuple(dims)


def _tensor_desc(ty: Any, what: str) -> TensorDesc:
    from tvm import relax

    if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
        raise ModelError(f"the C backend needs tensors of known rank; {what} is {ty}",
                         hint="fix the model's shapes with --shape")
    return TensorDesc(_static_shape(ty.shape.values, what), str(ty.dtype))


class _Tensor:
    """A C DLTensor variable in the generated code."""

    def __init__(self, cname: str, desc: TensorDesc) -> None:
        self.cname, self.desc = cname, desc


class _Emitter:
    """Generates one C entry point from one lowered Relax function."""

    def __init__(self, mod: Any, fname: str, func: Any, consts: list[str], const_ids: dict[str, str],
                 checks: tuple[InputCheck, ...] = ()) -> None:
        self.mod, self.fname, self.func = mod, fname, func
        self.checks = checks
        self.lines: list[str] = []
        self.decls: list[str] = []
        self.env: dict[Any, Any] = {}
        self.storages: dict[Any, int] = {}  # storage var -> byte offset in the workspace
        self.ws = 0
        self.n = 0
        self.consts, self.const_ids = consts, const_ids
        self.kernels: set[str] = set()
        self.inputs: list[TensorDesc] = []

    def _new(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def _dltensor(self, data_expr: str, desc: TensorDesc) -> _Tensor:
        name = self._new("t")
        code, bits = _dtype_parts(desc.dtype)
        shape = self._new("s")
        dims = ", ".join(str(d) for d in desc.shape) or "0"
        self.decls.append(f"  static int64_t {shape}[] = {{{dims}}};")
        self.lines.append(f"  fr_tensor {name} = {{{data_expr}, {{1, 0}}, {len(desc.shape)}, "
                          f"{{{code}, {bits}, 1}}, {shape}, NULL, 0}};")
        return _Tensor(name, desc)

    def _bind_param(self, ty: Any, what: str) -> Any:
        from tvm import relax

        if isinstance(ty, relax.TupleType):
            return tuple(self._bind_param(f, f"{what}[{i}]") for i, f in enumerate(ty.fields))
        desc = _tensor_desc(ty, what)
        idx = len(self.inputs)
        self.inputs.append(desc)
        return self._dltensor(f"in[{idx}]", desc)

    def _const(self, c: Any) -> _Tensor:
        arr = c.value.numpy()
        # keyed by content: Python wrappers of the same constant are not the same object
        key = f"{arr.dtype}{arr.shape}{hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()}"
        name = self.const_ids.get(key)
        if name is None:
            name = f"fr_const{len(self.consts)}"
            raw = np.ascontiguousarray(arr).tobytes() or b"\0"
            body = ",".join(str(b) for b in raw)
            self.consts.append(f"static uint8_t {name}[{len(raw)}] __attribute__((aligned(64))) = "
                               f"{{{body}}};")
            self.const_ids[key] = name
        return self._dltensor(name, TensorDesc(tuple(int(d) for d in arr.shape), str(arr.dtype)))

    def _value(self, e: Any) -> Any:
        from tvm import relax

        if isinstance(e, relax.Var):
            if e not in self.env:
                raise ModelError(f"the C backend met an unbound variable {e.name} in {self.fname}",
                                 hint="report the model")
            return self.env[e]
        if _is_tensor_const(e):
            return self._const(e)
        if isinstance(e, relax.Tuple):
            return tuple(self._value(f) for f in e.fields)
        if isinstance(e, relax.TupleGetItem):
            return self._value(e.tuple_value)[int(e.index)]
        raise ModelError(f"the C backend cannot handle the expression {type(e).__name__} in {self.fname}",
                         hint="this model needs the Relax VM; compile for an x86_64/aarch64 preset")

    def _kernel_arg(self, a: Any, slot: str) -> str:
        from tvm import relax

        if not isinstance(a, (relax.Var, relax.Tuple, relax.TupleGetItem)) and not _is_tensor_const(a):
            v = _scalar(a)
            if isinstance(v, float):
                return f"{slot}.type_index = FR_ANY_FLOAT; {slot}.v.v_float64 = {v!r};"
            return f"{slot}.type_index = FR_ANY_INT; {slot}.v.v_int64 = {int(v)};"
        t = self._value(a)
        if not isinstance(t, _Tensor):
            raise ModelError(f"the C backend cannot pass {type(a).__name__} to a kernel in {self.fname}",
                             hint="this model needs the Relax VM; compile for an x86_64/aarch64 preset")
        return f"{slot}.type_index = FR_ANY_DLTENSOR_PTR; {slot}.v.v_ptr = &{t.cname};"

    def _call_kernel(self, gv: Any, args: list[Any]) -> None:
        from tvm import tirx

        prim = self.mod[gv]
        if not isinstance(prim, tirx.PrimFunc):
            raise ModelError(f"the C backend cannot call the Relax function {gv.name_hint} from {self.fname}",
                             hint="inline it, or compile for an x86_64/aarch64 preset (Relax VM)")
        attrs = prim.attrs or {}
        sym = str(attrs["global_symbol"]) if "global_symbol" in attrs else gv.name_hint
        self.kernels.add(sym)
        a = self._new("a")
        self.lines.append(f"  {{ fr_any {a}[{max(1, len(args))}];")
        for i, arg in enumerate(args):
            self.lines.append(f"    {a}[{i}].zero_padding = 0; {self._kernel_arg(arg, f'{a}[{i}]')}")
        self.lines.append(f'    if (fr_call((fr_packed)__tvm_ffi_{sym}, "{sym}", {a}, {len(args)}) != 0) '
                          "return -1; }")

    def _binding(self, var: Any, value: Any) -> None:
        from tvm import ir, relax

        if not isinstance(value, relax.Call):
            self.env[var] = self._value(value)
            return
        op = value.op
        if isinstance(op, ir.GlobalVar):
            self._call_kernel(op, list(value.args))
            self.env[var] = None
            return
        if isinstance(op, relax.ExternFunc):
            sym = str(op.global_symbol)
            if sym in _IGNORED_EXTERNS:  # static shapes: checked once at generation time
                self.env[var] = None
                return
            if sym == "vm.builtin.reshape":
                src = self._value(value.args[0])
                shape = _static_shape(value.args[1].values, f"a reshape in {self.fname}")
                self.env[var] = self._dltensor(f"{src.cname}.data", TensorDesc(shape, src.desc.dtype))
                return
            if sym == "vm.builtin.copy":
                self.env[var] = self._value(value.args[0])  # Relax is pure: aliasing is a copy
                return
            raise ModelError(f"the C backend does not implement the builtin {sym} (in {self.fname})",
                             hint="compile for an x86_64/aarch64 preset (Relax VM), or report the model")
        name = op.name
        if name in ("relax.null_value", "relax.vm.kill_object"):
            self.env[var] = None
        elif name == "relax.vm.alloc_storage":
            size = _static_shape(value.args[0].values, "a storage")[0]
            self.storages[var] = self.ws
            self.ws += (size + 63) // 64 * 64
            self.env[var] = ("storage", self.storages[var])
        elif name == "relax.vm.alloc_tensor":
            storage = self.env[value.args[0]]
            offset = int(_scalar(value.args[1]))
            shape = _static_shape(value.args[2].values, "a tensor")
            dtype = str(value.args[3].value)
            self.env[var] = self._dltensor(f"(char*)ws + {storage[1] + offset}", TensorDesc(shape, dtype))
        else:
            raise ModelError(f"the C backend does not implement the operator {name} (in {self.fname})",
                             hint="compile for an x86_64/aarch64 preset (Relax VM), or report the model")

    def _check(self, chk: InputCheck) -> str:
        n_in = len(self.inputs)
        idx = chk.index + n_in if chk.index < 0 else chk.index
        if not 0 <= idx < n_in:
            raise CompilerError(f"input check {chk} is out of range for {self.fname} ({n_in} inputs)",
                                hint="report the model")
        d = self.inputs[idx]
        n = int(np.prod(d.shape, dtype=np.int64))
        what = _c_ident(chk.what)
        if chk.classes is not None:
            if d.dtype != "int64" or chk.classes < 1:
                raise CompilerError(f"{self.fname} input {idx} ({d.dtype}) cannot hold class ids "
                                    f"of {chk.classes} classes", hint="report the model")
            return (f'  if (fr_check_class_ids((const int64_t*)in[{idx}], {n}, {int(chk.classes)}, '
                    f'"{what}") != 0) return -1;')
        code, bits = _dtype_parts(d.dtype)
        if code != _DL_CODES["float"] or bits not in (16, 32, 64):
            raise CompilerError(f"{self.fname} input {idx} is {d.dtype}, not a float to check",
                                hint="report the model")
        return f'  if (fr_check_finite(in[{idx}], {n}, {bits}, "{what}") != 0) return -1;'

    def emit(self) -> tuple[str, CSignature]:
        from tvm import relax

        f = self.func
        for p in f.params:
            self.env[p] = self._bind_param(p.ty, f"{self.fname} parameter {p.name}")
        for chk in self.checks:
            self.lines.append(self._check(chk))
        body = f.body
        for block in body.blocks:
            for b in block.bindings:
                if not isinstance(b, relax.VarBinding):
                    raise ModelError(f"the C backend cannot handle {type(b).__name__} in {self.fname}",
                                     hint="fix the model's shapes with --shape")
                self._binding(b.var, b.value)
        result = self._value(body.body)
        leaves: list[_Tensor] = []

        def flatten(v: Any) -> None:
            if isinstance(v, tuple):
                for x in v:
                    flatten(x)
            elif isinstance(v, _Tensor):
                leaves.append(v)
            else:
                raise ModelError(f"{self.fname} returns a non-tensor value", hint="return tensors only")

        flatten(result)
        for i, t in enumerate(leaves):
            self.lines.append(f"  memcpy(out[{i}], {t.cname}.data, {t.desc.nbytes});")
        src = [f"static int fr_entry_{_c_ident(self.fname)}(void* const* in, void* const* out, void* ws) {{",
               "  (void)in; (void)ws;", *self.decls, *self.lines, "  return 0;", "}"]
        sig = CSignature(self.fname, tuple(self.inputs), tuple(t.desc for t in leaves), self.ws)
        return "\n".join(src), sig


def _is_tensor_const(e: Any) -> bool:
    from tvm import relax, runtime

    return isinstance(getattr(e, "value", None), runtime.Tensor) and isinstance(e.ty, relax.TensorType)


def _scalar(e: Any) -> int | float:
    """The Python number inside a PrimValue / IntImm / FloatImm (TVM 0.27 unwraps some itself)."""
    for _ in range(3):
        if isinstance(e, (int, float)) and not isinstance(e, bool):
            return e
        if isinstance(e, bool):
            return int(e)
        if not hasattr(e, "value"):
            break
        e = e.value
    raise ModelError(f"the C backend needs a constant here, got {e}",
                     hint="fix the model's shapes with --shape")


def _c_ident(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _desc_init(d: TensorDesc) -> str:
    code, bits = _dtype_parts(d.dtype)
    dims = ", ".join(str(x) for x in d.shape) or "0"
    return f"{{{len(d.shape)}, {{{code}, {bits}, 1}}, {{{dims}}}}}"


def generate_entry(low: Any, funcs: list[str], model_name: str,
                   checks: dict[str, tuple[InputCheck, ...]] | None = None
                   ) -> tuple[str, list[CSignature], set[str]]:
    """C source of the entry points for the Relax functions ``funcs`` of the lowered module;
    ``checks[name]``: what the entry point of ``name`` checks before running.

    Returns (source, signatures, kernel symbols used). ModelError on anything not static."""
    from tvm import relax

    consts: list[str] = []
    const_ids: dict[str, str] = {}
    bodies, sigs, kernels = [], [], set()
    for name in funcs:
        gv = next((g for g in low.get_global_vars() if g.name_hint == name), None)
        if gv is None or not isinstance(low[gv], relax.Function):
            raise ModelError(f"the module has no Relax function {name!r}", hint="report the model")
        em = _Emitter(low, name, low[gv], consts, const_ids, (checks or {}).get(name, ()))
        body, sig = em.emit()
        bodies.append(body)
        sigs.append(sig)
        kernels |= em.kernels
    out = ["/* Generated by fractal-edge compiler/cbackend.py: do not edit. */",
           '#include "fractal_rt.h"', "#include <string.h>", ""]
    out += [f"extern int32_t __tvm_ffi_{k}(void*, const fr_any*, int32_t, fr_any*);" for k in sorted(kernels)]
    out += consts
    out += bodies
    for s in sigs:
        ident = _c_ident(s.name)
        ins = ", ".join(_desc_init(d) for d in s.inputs) or "{0}"
        outs = ", ".join(_desc_init(d) for d in s.outputs) or "{0}"
        out.append(f"static const fr_tensor_desc fr_ins_{ident}[] = {{{ins}}};")
        out.append(f"static const fr_tensor_desc fr_outs_{ident}[] = {{{outs}}};")
    rows = []
    for s in sigs:
        ident = _c_ident(s.name)
        rows.append(f'  {{"{s.name}", {len(s.inputs)}, {len(s.outputs)}, fr_ins_{ident}, fr_outs_{ident}, '
                    f"{s.workspace}u, fr_entry_{ident}}}")
    table = ",\n".join(rows)
    safe_name = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "._-+ ") else "_" for ch in model_name)
    out += [f"static const fr_function fr_functions[] = {{\n{table}\n}};",
            f"int32_t fr_num_functions(void) {{ return {len(sigs)}; }}",
            "const fr_function* fr_get_function(int32_t i) { return (i >= 0 && i < fr_num_functions()) ? "
            "&fr_functions[i] : NULL; }",
            f'const char* fr_model_name(void) {{ return "{safe_name}"; }}', ""]
    return "\n".join(out), sigs, kernels


def build_kernels(low: Any, target: Any, path: Path) -> Path:
    """Compile every TIR kernel of ``low`` with TVM's LLVM backend for ``target`` into object ``path``."""
    import tvm
    from tvm import tirx

    prims = {gv: f for gv, f in low.functions_items() if isinstance(f, tirx.PrimFunc)}
    try:
        rt = tvm.tirx.build(tvm.IRModule(prims, attrs=low.attrs), target=target)
        rt.write_to_file(str(path))
    except Exception as exc:
        raise CompilerError(f"TVM failed to compile the kernels: {' '.join(str(exc).split())[:300]}",
                            hint="report the model; try another target preset") from None
    return path


# --------------------------------------------------------------------------------------------
# native build (cached)


def c_compiler_for(arch: str) -> str:
    """The C compiler for ``arch`` (the host gcc for this machine's arch); TargetError if missing."""
    from compiler.targets import host_arch

    cc = "gcc" if arch == host_arch() else _C_CC[arch]
    if shutil.which(cc) is None:
        raise TargetError(f"C compiler {cc!r} for {arch} not found on PATH",
                          hint=f"install it (Debian: apt-get install gcc-{arch.replace('_', '-')}-linux-gnu)")
    return cc


def _cache_root() -> Path:
    env = os.environ.get(_CACHE_ENV)
    return Path(env) if env else _REPO_ROOT / ".cache" / "cbackend"


@dataclass(frozen=True)
class NativeBuild:
    """The products of one native build and whether they came from the cache."""

    lib: Path
    runner: Path
    cached: bool
    seconds: float


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        err = " ".join(proc.stderr.split())[:400]
        raise TargetError(f"{what} failed: {err}", hint=f"check the toolchain {cmd[0]}")


def build_native(entry_c: str, kernels_o: Path, arch: str, cflags: tuple[str, ...],
                 out_dir: Path) -> NativeBuild:
    """Compile the entry source + runtime + kernels into ``libmodel.so`` and ``fractal-run`` in
    ``out_dir``. Cached under .cache/cbackend by the sha256 of every input and the command."""
    import time

    t0 = time.perf_counter()
    cc = c_compiler_for(arch)
    flags = ["-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fPIC", "-pthread", *cflags]
    h = hashlib.sha256()
    for part in (cc, " ".join(flags), entry_c):
        h.update(part.encode() + b"\0")
    h.update(kernels_o.read_bytes())
    for src in sorted(RUNTIME_DIR.iterdir()):
        if src.suffix in (".c", ".h"):
            h.update(src.name.encode() + src.read_bytes())
    key = h.hexdigest()[:24]
    cache = _cache_root() / key
    out_dir.mkdir(parents=True, exist_ok=True)
    lib, runner = out_dir / LIB_NAME, out_dir / RUNNER_NAME
    cached = (cache / LIB_NAME).is_file() and (cache / RUNNER_NAME).is_file()
    if not cached:
        cache.parent.mkdir(parents=True, exist_ok=True)
        t = Path(tempfile.mkdtemp(prefix=".build-", dir=cache.parent))
        try:
            (t / "model.c").write_text(entry_c)
            inc = ["-I", str(RUNTIME_DIR)]
            objs = []
            for src, obj in ((t / "model.c", t / "model.o"), (RUNTIME_DIR / "fractal_rt.c", t / "rt.o")):
                _run([cc, *flags, *inc, "-c", str(src), "-o", str(obj)], f"compiling {src.name}")
                objs.append(str(obj))
            _run([cc, *flags, *inc, "-c", str(RUNTIME_DIR / "fractal_run.c"), "-o", str(t / "run.o")],
                 "compiling fractal_run.c")
            _run([cc, *flags, "-shared", "-o", str(t / LIB_NAME), *objs, str(kernels_o), "-lm"],
                 f"linking {LIB_NAME}")
            _run([cc, *flags, "-o", str(t / RUNNER_NAME), str(t / "run.o"), *objs, str(kernels_o), "-lm"],
                 f"linking {RUNNER_NAME}")
            for o in t.glob("*.o"):
                o.unlink()
            try:
                t.rename(cache)  # atomic: a concurrent build of the same key leaves one winner
            except OSError:
                pass
        finally:
            shutil.rmtree(t, ignore_errors=True)
    shutil.copy2(cache / LIB_NAME, lib)
    shutil.copy2(cache / RUNNER_NAME, runner)
    return NativeBuild(lib, runner, cached, time.perf_counter() - t0)


def _refuse_dynamic(mod: Any, preset: Any, funcs: list[str]) -> None:
    """One line naming the preset when an output's shape is decided at run time
    (:mod:`compiler.dynshape`, :mod:`compiler.dataops`): the C runner allocates every output before
    the call."""
    from tvm import relax, tirx

    for name in funcs:
        if name not in [gv.name_hint for gv in mod.functions]:
            continue
        ret = mod[name].ret_ty
        for ty in (list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]):
            if isinstance(ty, relax.TensorType) and (ty.shape is None or not all(
                    isinstance(d, tirx.IntImm) for d in ty.shape.values)):
                raise TargetError(f"preset {preset.name!r} (C backend) cannot run a model whose output "
                                  "shapes are decided at run time (a shape operand is a model input, or "
                                  "an output's length depends on the data: NonZero, Unique, ...)",
                                  hint="compile for a TVM VM preset (e.g. x86_64 or aarch64), or make the "
                                       "shape operand a constant")


def compile_c(mod: Any, preset: Any, out_dir: Path, *, funcs: list[str], model_name: str,
              prefix: str = "", checks: dict[str, tuple[InputCheck, ...]] | None = None
              ) -> tuple[NativeBuild, list[CSignature]]:
    """Lower ``mod``, generate entry points for ``funcs`` and build them for ``preset``.

    ``prefix`` names the products (``<prefix>libmodel.so``) so inference and training can share a
    directory; ``checks``: see :func:`generate_entry`. Returns the build and the signatures."""
    _refuse_dynamic(mod, preset, funcs)
    target = preset.tvm_target()
    low = lower(mod, target)
    entry, sigs, _ = generate_entry(low, funcs, model_name, checks)
    with tempfile.TemporaryDirectory(prefix="fractal-cb-") as tmp:
        kobj = build_kernels(low, target, Path(tmp) / "kernels.o")
        flags = tuple(preset.link_options) if preset.arch != "x86_64" else ()
        build = build_native(entry, kobj, preset.arch, flags, Path(tmp) / "out")
        out_dir.mkdir(parents=True, exist_ok=True)
        lib, runner = out_dir / f"{prefix}{LIB_NAME}", out_dir / f"{prefix}{RUNNER_NAME}"
        shutil.move(str(build.lib), lib)
        shutil.move(str(build.runner), runner)
    return NativeBuild(lib, runner, build.cached, build.seconds), sigs
