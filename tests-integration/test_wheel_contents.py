"""The built wheels and sdists pass tools/check_wheels.py, and that tool catches what it must."""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile

import pytest


def check_wheels(layout, *artifacts):
    tool = layout.REPO / "tools" / "check_wheels.py"
    return layout.run([sys.executable, tool, *artifacts], check=False)


def test_every_wheel_and_sdist_passes(built, layout):
    artifacts = [path for pair in built.values() for path in pair.values()]
    done = check_wheels(layout, *artifacts)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in artifacts:
        assert path.name in done.stdout


def test_each_wheel_holds_only_its_own_import_paths(built, layout):
    # The legacy top-level modules (amp_C, apex_C, fused_layer_norm_cuda, syncbn) belong to the
    # package whose kernels they front.
    owned = {
        "apex-mta-kernels": ("apex/__init__.py", "apex/_autocast_utils.py",
                             "apex/multi_tensor_apply/", "amp_C.py", "apex_C.py"),
        "apex-optim": ("apex/optimizers/",),
        "apex-norm": ("apex/normalization/", "fused_layer_norm_cuda.py"),
        "apex-parallel": ("apex/parallel/", "syncbn.py"),
        "apex-amp": ("apex/amp/", "apex/fp16_utils/"),
    }  # fmt: skip
    for dist, paths in owned.items():
        with zipfile.ZipFile(built[dist]["wheel"]) as zf:
            names = [n for n in zf.namelist() if ".dist-info/" not in n]
        assert names, dist
        for name in names:
            assert name.startswith(paths), f"{dist} wheel holds {name}"
        assert ("apex/__init__.py" in names) == (dist == "apex-mta-kernels")


def doctored(wheel, tmp_path, extra: dict[str, str]):
    """A copy of ``wheel`` with extra files in it."""
    out = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            dst.writestr(item, src.read(item))
        for name, text in extra.items():
            dst.writestr(name, text)
    return out


@pytest.mark.parametrize(
    ("extra", "complaint"),
    [
        ("apex/__init__.py", "holds apex/__init__.py, which is not apex-optim's to ship"),
        ("apex/amp/__init__.py", "holds apex/amp/__init__.py, which is not apex-optim's to ship"),
        ("apex/optimizers/__pycache__/x.pyc", "holds a build leftover"),
    ],
)
def test_check_wheels_refuses_a_wheel_holding_what_it_must_not(
    built, layout, tmp_path, extra, complaint
):
    bad = doctored(built["apex-optim"]["wheel"], tmp_path, {extra: ""})
    done = check_wheels(layout, bad)
    assert done.returncode == 1
    assert complaint in done.stderr
    assert f"RECORD does not list {extra}" in done.stderr


def test_check_wheels_refuses_two_wheels_holding_one_file(built, layout, tmp_path):
    bad = doctored(built["apex-amp"]["wheel"], tmp_path, {"apex/optimizers/__init__.py": ""})
    done = check_wheels(layout, built["apex-optim"]["wheel"], bad)
    assert done.returncode == 1
    assert "apex/optimizers/__init__.py is also in apex_amp-" in done.stderr


def test_check_wheels_refuses_compiled_kernels_in_an_sdist(built, layout, tmp_path):
    sdist = built["apex-mta-kernels"]["sdist"]
    bad = tmp_path / sdist.name
    top = sdist.name[: -len(".tar.gz")]
    with tarfile.open(sdist) as src, tarfile.open(bad, "w:gz") as dst:
        for member in src.getmembers():
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        extra = tarfile.TarInfo(f"{top}/src/apex/multi_tensor_apply/_prebuilt/apex_mta_C.so")
        extra.size = 4
        dst.addfile(extra, io.BytesIO(b"\x7fELF"))
    done = check_wheels(layout, bad)
    assert done.returncode == 1
    assert (
        "holds a compiled file: src/apex/multi_tensor_apply/_prebuilt/apex_mta_C.so" in done.stderr
    )
