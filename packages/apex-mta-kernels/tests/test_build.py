"""The extension builder: CUDA discovery, cache keys, the lock, fallback, AOT and the report."""

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from apex.multi_tensor_apply.build import aot, cuda_home, loader
from apex.multi_tensor_apply.build.spec import (
    KernelSpec,
    arch_covers,
    build_key,
    normalize_archs,
)

HERE = Path(__file__).parent
SRC = HERE.parent / "src"
TINY = KernelSpec(
    name="apex_test_tiny", package="", sources=("tiny.cpp",), directory=str(HERE / "data" / "tiny")
)


def run_py(code, env_extra=None, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("APEX_CACHE_DIR", str(d))
    loader.reset_for_tests()
    yield d
    loader.reset_for_tests()


# ---- CUDA discovery ------------------------------------------------------------------------------


def fake_toolkit(root: Path, version: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {version}, V{version}.1'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return root


@pytest.fixture
def no_cuda_env(monkeypatch, tmp_path):
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", "/bin:/usr/bin")
    monkeypatch.setattr(cuda_home, "DEFAULT_CUDA_HOME", tmp_path / "no-such-cuda")
    monkeypatch.setattr(cuda_home, "_site_dirs", lambda: [])
    cuda_home.find_toolkit.cache_clear()
    yield
    cuda_home.find_toolkit.cache_clear()


def test_cuda_home_env_wins(no_cuda_env, monkeypatch, tmp_path):
    home = fake_toolkit(tmp_path / "tk", "13.0")
    fake_toolkit(tmp_path / "onpath", "13.0")
    monkeypatch.setenv("PATH", f"{tmp_path / 'onpath' / 'bin'}:/bin:/usr/bin")
    monkeypatch.setenv("CUDA_HOME", str(home))
    tk = cuda_home.find_toolkit("13.0")
    assert tk.home == home and tk.version == "13.0" and tk.reason == "CUDA_HOME is set"


def test_cuda_home_nvcc_on_path_then_pip_wheel(no_cuda_env, monkeypatch, tmp_path):
    site = tmp_path / "site-packages"
    pip_home = fake_toolkit(site / "nvidia" / "cu13", "13.0")
    monkeypatch.setattr(cuda_home, "_site_dirs", lambda: [site])
    tk = cuda_home.find_toolkit("13.0")
    assert tk.home == pip_home and "pip wheel" in tk.reason
    cuda_home.find_toolkit.cache_clear()
    path_home = fake_toolkit(tmp_path / "onpath", "13.0")
    monkeypatch.setenv("PATH", f"{path_home / 'bin'}:/bin:/usr/bin")
    tk = cuda_home.find_toolkit("13.0")
    assert tk.home == path_home and tk.reason.startswith("nvcc on PATH")


def test_cuda_major_mismatch_refused_with_the_fix(no_cuda_env, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "tk", "12.4")))
    with pytest.raises(cuda_home.ToolkitError) as err:
        cuda_home.find_toolkit("13.0")
    msg = str(err.value)
    assert "is CUDA 12.4 but torch was built with CUDA 13.0" in msg
    assert "pip install 'cuda-toolkit[nvcc,cccl]==13.0.*'" in msg


def fake_dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_pip_toolkit_with_skewed_compiler_parts_refused_with_the_fix(
    no_cuda_env, monkeypatch, tmp_path
):
    # cuda-toolkit[nvcc]==13.0.2 leaves nvidia-nvvm and nvidia-cuda-crt unpinned: a 13.5 cicc
    # emits PTX 9.5, which the 13.0 ptxas rejects in the middle of the build.
    site = tmp_path / "site-packages"
    fake_toolkit(site / "nvidia" / "cu13", "13.0")
    fake_dist(site, "nvidia-cuda-nvcc", "13.0.88")
    fake_dist(site, "nvidia-nvvm", "13.5.37")
    fake_dist(site, "nvidia-cuda-crt", "13.5.37")
    monkeypatch.setattr(cuda_home, "_site_dirs", lambda: [site])
    with pytest.raises(cuda_home.ToolkitError) as err:
        cuda_home.find_toolkit("13.0")
    msg = str(err.value)
    assert "nvidia-cuda-nvcc 13.0.88, nvidia-nvvm 13.5.37, nvidia-cuda-crt 13.5.37" in msg
    assert (
        "pip install 'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*' 'nvidia-cuda-crt==13.0.*'"
        in msg
    )
    # Once they agree, the same toolkit is taken.
    for part in ("nvidia_nvvm-13.5.37", "nvidia_cuda_crt-13.5.37"):
        shutil.rmtree(site / f"{part}.dist-info")
    fake_dist(site, "nvidia-nvvm", "13.0.88")
    fake_dist(site, "nvidia-cuda-crt", "13.0.88")
    cuda_home.find_toolkit.cache_clear()
    assert cuda_home.find_toolkit("13.0").home == site / "nvidia" / "cu13"


def test_no_toolkit_says_what_was_tried(no_cuda_env):
    with pytest.raises(cuda_home.ToolkitError, match="no CUDA compiler \\(nvcc\\) found. Tried"):
        cuda_home.find_toolkit("13.0")


def test_cudart_shim_for_pip_toolkits(tmp_path):
    home = fake_toolkit(tmp_path / "cu13", "13.0")
    (home / "lib").mkdir()
    (home / "lib" / "libcudart.so.13").write_text("")
    tk = cuda_home.CudaToolkit(home, home / "bin" / "nvcc", "13.0", "test")
    shim = cuda_home.cudart_link_dir(tk, tmp_path / "shim")
    assert (shim / "libcudart.so").resolve() == (home / "lib" / "libcudart.so.13").resolve()


def test_cudart_shim_survives_a_deleted_toolkit(tmp_path):
    # CI regression: a shim left pointing into a deleted venv made `-lcudart` fail to link.
    def toolkit(name):
        home = fake_toolkit(tmp_path / name, "13.0")
        (home / "lib").mkdir()
        (home / "lib" / "libcudart.so.13").write_text("")
        return cuda_home.CudaToolkit(home, home / "bin" / "nvcc", "13.0", "test")

    old = toolkit("old-venv")
    stale = cuda_home.cudart_link_dir(old, tmp_path / "shim")
    shutil.rmtree(old.home)
    assert (stale / "libcudart.so").is_symlink() and not (stale / "libcudart.so").exists()
    new = toolkit("new-venv")
    shim = cuda_home.cudart_link_dir(new, tmp_path / "shim")
    assert (shim / "libcudart.so").exists()
    assert (shim / "libcudart.so").resolve() == (new.home / "lib" / "libcudart.so.13").resolve()
    # the same toolkit deleted and recreated in place: the link is valid again, still one answer
    shutil.rmtree(new.home)
    new = toolkit("new-venv")
    assert (
        cuda_home.cudart_link_dir(new, tmp_path / "shim") == shim
        and (shim / "libcudart.so").exists()
    )


# ---- keys -----------------------------------------------------------------------------------------


def test_archs_and_keys():
    assert normalize_archs("9.0;8.0") == ("8.0", "9.0")
    assert normalize_archs(["sm_90", "80", "8.0"]) == ("8.0", "9.0")
    assert arch_covers(("8.0", "9.0"), "9.0") and arch_covers(("8.0",), "8.6")
    assert not arch_covers(("8.0",), "9.0") and not arch_covers(("9.0",), "8.0")
    k1 = build_key(TINY, "2.14.1+cu130", "13.0", ("8.0", "9.0"))
    k2 = build_key(TINY, "2.14.1+cu130", "13.0", ("9.0",))
    k3 = build_key(TINY, "2.13.0", "13.0", ("9.0",))
    assert len({k1, k2, k3}) == 3 and "torch2.14.1-cu130" in k1 and k1.endswith("sm80_90")


def test_nvcc_threads_only_where_ninja_leaves_cores_idle(monkeypatch):
    two = ("8.0", "9.0")
    monkeypatch.setenv("MAX_JOBS", "2")
    assert loader._nvcc_threads(["layer_norm.cu"], two) == ["--threads=2"]
    assert loader._nvcc_threads(["a.cu", "b.cu", "c.cpp"], two) == []  # ninja runs both
    assert loader._nvcc_threads(["layer_norm.cu"], ("9.0",)) == []
    assert loader._nvcc_threads(["plan.cpp"], two) == []
    monkeypatch.setenv("MAX_JOBS", "16")
    assert loader._nvcc_threads(["a.cu", "b.cu"], ("8.0", "8.6", "9.0")) == ["--threads=3"]


def test_unity_units_only_where_ninja_has_fewer_jobs_than_cu_files(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"a.cu": 900, "b.cu": 500, "c.cu": 400, "d.cu": 300, "e.cu": 100}
    for name, size in sizes.items():
        (src / name).write_text("//" + "x" * size + "\n")
    (src / "plan.cpp").write_text("//\n")
    sources = [str(src / n) for n in [*sizes, "plan.cpp"]]
    out = tmp_path / "build"
    out.mkdir()
    assert loader._unity_sources(sources, out, 5) == sources  # a job per .cu file: unchanged
    assert loader._unity_sources(sources, out, 16) == sources
    units = loader._unity_sources(sources, out, 2)
    assert units[0] == str(src / "plan.cpp") and len(units) == 3
    included = []
    for unit in units[1:]:
        lines = Path(unit).read_text().splitlines()
        included.append([line.split('"')[1] for line in lines])
        assert Path(unit).parent == out and all(line.startswith("#include") for line in lines)
    # every .cu exactly once; largest first onto the lighter group: 900 + 300 against
    # 500 + 400 + 100
    assert sorted(Path(f).name for g in included for f in g) == sorted(sizes)
    assert sorted(sorted(Path(f).name for f in g) for g in included) == [
        ["a.cu", "d.cu"],
        ["b.cu", "c.cu", "e.cu"],
    ]
    # A unit rewritten with the same text keeps its mtime (ninja would rebuild it otherwise).
    before = [Path(u).stat().st_mtime_ns for u in units[1:]]
    assert loader._unity_sources(sources, out, 2) == units
    assert [Path(u).stat().st_mtime_ns for u in units[1:]] == before
    one = loader._unity_sources(sources, out, 1)
    assert len(one) == 2 and len(Path(one[1]).read_text().splitlines()) == 5
    monkeypatch.setenv("APEX_UNITY_BUILD", "0")
    assert loader._unity_sources(sources, out, 1) == sources


# ---- fallback --------------------------------------------------------------------------------------

BROKEN = KernelSpec(
    name="apex_test_broken", package="", sources=("broken.cu",), directory=str(HERE / "data")
)


def test_fallback_warns_once_and_strict_raises(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("APEX_CUDA_ARCHS", "9.0")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    monkeypatch.delenv("APEX_STRICT_KERNELS", raising=False)
    cuda_home.find_toolkit.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert loader.load(BROKEN) is None
        assert loader.load(BROKEN) is None
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "reference path" in msgs[0] and "APEX_STRICT_KERNELS=1" in msgs[0]
    monkeypatch.setenv("APEX_STRICT_KERNELS", "1")
    with pytest.raises(loader.KernelsUnavailable, match="apex_test_broken is unavailable"):
        loader.load(BROKEN)
    # Failed first under strict mode, then asked without it: the one warning comes then.
    loader.reset_for_tests()
    with pytest.raises(loader.KernelsUnavailable):
        loader.load(BROKEN)
    monkeypatch.delenv("APEX_STRICT_KERNELS")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert loader.load(BROKEN) is None
        assert loader.load(BROKEN) is None
    assert [w.category for w in seen] == [RuntimeWarning], [str(w.message) for w in seen]


def test_post_load_hooks_run_once_after_a_load_and_not_after_a_failure(cache, monkeypatch):
    spec = KernelSpec(name="apex_test_hooked", package="", sources=("broken.cu",))
    ext = loader.Extension(spec, Path("/nowhere/apex_test_hooked.so"), "cache", ())
    calls = []
    monkeypatch.setitem(loader._post_load, spec.name, [calls.append])
    monkeypatch.setattr(loader, "_load", lambda s: ext)
    try:
        assert loader.load(spec) is ext and loader.load(spec) is ext
        assert calls == [ext]
    finally:
        loader._loaded.pop(spec.name, None)

    # A hook that raises (a warning made an error): the caller sees it, the library stays loaded.
    def raising(extension):
        raise UserWarning("APEX_NORM_TUNE: unknown knob 'bogus' ignored")

    monkeypatch.setitem(loader._post_load, spec.name, [raising, calls.append])
    try:
        with pytest.raises(UserWarning, match="bogus"):
            loader.load(spec)
        assert loader.load(spec) is ext and loader.loaded(spec) is ext
        assert spec.name not in loader._failed and calls == [ext, ext]  # the next hook ran
    finally:
        loader._loaded.pop(spec.name, None)
    monkeypatch.setitem(loader._post_load, spec.name, [calls.append])
    monkeypatch.delenv("APEX_STRICT_KERNELS", raising=False)
    monkeypatch.setattr(loader, "_load", lambda s: (_ for _ in ()).throw(OSError("no library")))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert loader.load(spec) is None
        assert calls == [ext, ext]
    finally:
        loader._failed.pop(spec.name, None)


def test_a_cache_that_cannot_be_marked_still_serves_the_loaded_library(cache, monkeypatch, caplog):
    """Once the compiled library is open (its kernels registered), failing to write the cache's
    marker (a full or read-only disk) must not count as a failed load: that would put the
    reference back over the kernels. The entry stays unmarked, so it is not reused."""
    from torch.utils import cpp_extension

    spec = KernelSpec(name="apex_test_unmarked", package="", sources=("tiny.cpp",),
                      directory=str(HERE / "data" / "tiny"))  # fmt: skip
    opened = []

    def build(**kw):  # the library "built and opened"
        Path(kw["build_directory"], kw["name"] + loader.LIB_SUFFIX).touch()
        opened.append(kw["name"])

    monkeypatch.setattr(cpp_extension, "load", build)
    write_text = Path.write_text

    def refuse_marker(self, text, *args, **kwargs):
        if self.name.startswith(loader.MARKER):  # as a full disk: the file made, then the error
            write_text(self, "", *args, **kwargs)
            raise OSError(28, "No space left on device")
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refuse_marker)
    monkeypatch.setenv("APEX_STRICT_KERNELS", "1")
    try:
        with caplog.at_level("WARNING", logger="apex.multi_tensor_apply.build"):
            ext = loader.load(spec)
        assert opened == [spec.name] and ext is not None and ext.origin == "compiled"
        assert spec.name not in loader._failed
        assert "could not mark it in the cache" in caplog.text
        assert loader.find_cached(spec, ()) is None  # not reused (no empty marker either)
        # An ahead-of-time build refuses the unmarked library rather than ship it.
        with pytest.raises(OSError, match="not marked"):
            aot.build("", specs=[spec])
    finally:
        loader._loaded.pop(spec.name, None)


def _hooked_build(monkeypatch, spec, events, opens: bool):
    """cpp_extension.load faked: "compile", then (``opens``) open the library through
    torch.ops.load_library as cpp_extension does, itself a recorder here; spec's pre-load hook
    records too."""
    import torch
    from torch.utils import cpp_extension

    def build(**kw):
        lib = Path(kw["build_directory"], kw["name"] + loader.LIB_SUFFIX)
        lib.touch()
        events.append("compile")
        # Another library opened meanwhile (another thread's) passes straight through.
        torch.ops.load_library("/elsewhere/other" + loader.LIB_SUFFIX)
        if opens:
            torch.ops.load_library(str(lib))

    def load_library(path):
        events.append(("open", Path(path).name))

    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.setattr(torch.ops, "load_library", load_library)
    monkeypatch.setitem(loader._pre_load, spec.name, [lambda: events.append("pre-load")])
    return load_library


def _load_fails_leniently(monkeypatch, spec):
    """loader.load(spec) without strict mode gives None (its warning ignored), and forgets."""
    monkeypatch.delenv("APEX_STRICT_KERNELS", raising=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert loader.load(spec) is None
    finally:
        loader._failed.pop(spec.name, None)


@pytest.mark.parametrize("opens", [True, False])
def test_pre_load_hooks_run_at_the_open_not_before_the_compile(cache, monkeypatch, opens):
    """The stand-ins step aside right before the compiled library opens, not while nvcc runs
    (another thread's first call must meet them then and wait, not find the reference); where
    cpp_extension opened the library some other way, the hooks still run once it returns."""
    import torch

    spec = KernelSpec(name="apex_test_preload", package="", sources=("tiny.cpp",),
                      directory=str(HERE / "data" / "tiny"))  # fmt: skip
    events = []
    recorder = _hooked_build(monkeypatch, spec, events, opens)
    try:
        assert loader.load(spec) is not None
    finally:
        loader._loaded.pop(spec.name, None)
    other = ("open", "other" + loader.LIB_SUFFIX)
    lib = ("open", spec.name + loader.LIB_SUFFIX)
    assert (
        events == ["compile", other, "pre-load", lib] if opens else ["compile", other, "pre-load"]
    )
    assert torch.ops.load_library is recorder  # what was there before, back


def test_a_failed_compile_runs_no_pre_load_hook(cache, monkeypatch):
    """The stand-ins stay when nvcc fails: the reference serves, with the one warning."""
    import torch
    from torch.utils import cpp_extension

    spec = KernelSpec(name="apex_test_preload_fail", package="", sources=("tiny.cpp",),
                      directory=str(HERE / "data" / "tiny"))  # fmt: skip
    events = []
    recorder = _hooked_build(monkeypatch, spec, events, True)

    def fail(**kw):
        events.append("compile")
        raise RuntimeError("nvcc: error")

    monkeypatch.setattr(cpp_extension, "load", fail)
    _load_fails_leniently(monkeypatch, spec)
    assert events == ["compile"]
    assert torch.ops.load_library is recorder


def test_an_open_that_fails_after_the_hooks_puts_load_library_back(cache, monkeypatch):
    import torch

    spec = KernelSpec(name="apex_test_preload_open", package="", sources=("tiny.cpp",),
                      directory=str(HERE / "data" / "tiny"))  # fmt: skip
    events = []
    _hooked_build(monkeypatch, spec, events, True)

    def refuse(path):  # this library's open fails (another's passes)
        if Path(path).name != spec.name + loader.LIB_SUFFIX:
            return events.append(("open", Path(path).name))
        events.append("open refused")
        raise OSError("undefined symbol")

    monkeypatch.setattr(torch.ops, "load_library", refuse)
    _load_fails_leniently(monkeypatch, spec)
    assert events == ["compile", ("open", "other" + loader.LIB_SUFFIX), "pre-load", "open refused"]
    assert torch.ops.load_library is refuse


# ---- compile once, cache, lock ---------------------------------------------------------------------

LOAD_TINY = """
import time, torch
from test_build import TINY
from apex.multi_tensor_apply.build import loader
t = time.perf_counter()
ext = loader.load(TINY)
dt = time.perf_counter() - t
assert torch.equal(torch.ops.apex_test_tiny.add_one(torch.ones(3)), torch.full((3,), 2.0))
print("ORIGIN", ext.origin, "SECONDS", dt)
"""


@pytest.mark.slow
def test_eight_processes_compile_once_then_cache_loads_fast(cache):
    env = {"APEX_CACHE_DIR": str(cache), "APEX_STRICT_KERNELS": "1", "MAX_JOBS": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD_TINY],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])},
        )
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    origins = [o[0].split()[1] for o in outs]
    assert origins.count("compiled") == 1 and origins.count("cache") == 7, origins
    logs = "".join(o[1] for o in outs)
    assert logs.count("apex: compiling apex_test_tiny") == 1
    assert "apex: built apex_test_tiny in" in logs
    # a later process loads from the cache, without compiling, in well under half a second
    r = run_py(LOAD_TINY, env)
    assert r.returncode == 0, r.stderr
    _, origin, _, seconds = r.stdout.split()
    assert origin == "cache" and float(seconds) < 0.5, r.stdout
    assert "compiling" not in r.stderr


@pytest.mark.slow
def test_killed_lock_holder_and_stale_torch_lock_never_hang(cache):
    env = {"APEX_CACHE_DIR": str(cache), "APEX_STRICT_KERNELS": "1"}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
            import sys, time
            from apex.multi_tensor_apply.build.lock import FileLock
            from apex.multi_tensor_apply.build.spec import cache_root
            with FileLock(cache_root() / "apex_test_tiny.lock"):
                print("locked", flush=True)
                time.sleep(600)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env, "PYTHONPATH": str(SRC)},
    )
    assert holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)  # dies holding the lock
    holder.wait(timeout=30)
    # also leave torch's own O_EXCL build lock behind, as a killed torch<=2.13 build does
    key = build_key(TINY, torch.__version__, torch.version.cuda, ())
    (cache / key).mkdir(parents=True)
    (cache / key / "lock").write_text("")
    t = time.time()
    r = run_py(LOAD_TINY, env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ORIGIN compiled" in r.stdout and time.time() - t < 300


@pytest.mark.slow
def test_aot_build_into_package_is_found_as_prebuilt(cache, tmp_path):
    import shutil

    from apex.multi_tensor_apply.build import aot

    pkg = tmp_path / "pkg"
    shutil.copytree(HERE / "data" / "tiny", pkg)
    spec = KernelSpec(name="apex_test_tiny", package="", sources=("tiny.cpp",), directory=str(pkg))
    libs = aot.build("8.0;9.0", specs=[spec], into_package=True)
    assert libs == [pkg / "_prebuilt" / f"apex_test_tiny{loader.LIB_SUFFIX}"]
    assert loader.find_prebuilt(spec, ()) == libs[0]
    shutil.rmtree(cache)  # nothing cached: the package's own copy is what loads
    assert loader.find_cached(spec, ()) is None
    aot.clean_package([spec])
    assert not (pkg / "_prebuilt").exists()


# ---- import cost and the report ------------------------------------------------------------------


def test_import_is_cheap_compiles_nothing_and_leaves_cuda_alone(tmp_path):
    r = run_py(
        """
        import time, torch
        t = time.perf_counter()
        import apex.multi_tensor_apply, amp_C, apex_C
        dt = time.perf_counter() - t
        import os
        print(dt, torch.cuda.is_initialized(), os.path.exists(os.environ["APEX_CACHE_DIR"]))
        """,
        {"APEX_CACHE_DIR": str(tmp_path / "c")},
    )
    assert r.returncode == 0, r.stderr
    dt, cuda_init, cache_made = r.stdout.split()
    assert float(dt) < 0.3 and cuda_init == "False" and cache_made == "False", r.stdout


def test_report_runs(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "apex.multi_tensor_apply"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "APEX_CACHE_DIR": str(tmp_path)},
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for words in (
        "torch",
        "CUDA toolkit",
        "apex-mta-kernels",
        "apex_mta_C",
        "cache dir",
        "status                     ok",
    ):
        assert words in r.stdout


def test_report_fails_on_a_foreign_apex(tmp_path):
    site = tmp_path / "site"
    (site / "apex").mkdir(parents=True)
    meta = site / "apex-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: apex\nVersion: 0.1\n")
    r = subprocess.run(
        [sys.executable, "-m", "apex.multi_tensor_apply"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(site)])},
    )
    assert r.returncode == 1
    assert "NVIDIA apex 0.1" in r.stdout and "apex namespace is broken" in r.stdout


def test_pre_load_hooks_follow_cpp_extensions_rebuild_names(monkeypatch):
    """A rebuild in one process with other arguments opens name_v1.so: the hooks run before it
    (once), not after; name_v1x.so or another name is not it."""
    import torch

    events = []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: events.append(Path(path).name))
    monkeypatch.setitem(loader._pre_load, "apex_x", [lambda: events.append("pre-load")])
    suffix = loader.LIB_SUFFIX
    with loader._pre_load_at_open("apex_x"):
        for name in ("apex_x_v1x", "apex_xy", "apex_x_v1", "apex_x_v2"):
            torch.ops.load_library(f"/cache/{name}{suffix}")
    assert events == [f"apex_x_v1x{suffix}", f"apex_xy{suffix}", "pre-load",
                      f"apex_x_v1{suffix}", f"apex_x_v2{suffix}"]  # fmt: skip
