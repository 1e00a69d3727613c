"""The `apex` namespace over every install subset, installed as wheels, editable, or from src/.

Each ``case`` (see conftest.CASES) is one interpreter with some of the apex-* packages; one probe
subprocess per case records what `apex.<area>`, `hasattr(apex, area)`, `from apex import <area>`
and `import apex.<area>` do there. One test per case, so that one probe serves all its checks
whichever pytest-xdist worker runs it.
"""

from __future__ import annotations

from pathlib import Path


def test_namespace(case, probes, envs, layout):
    out = probes(case)
    mta = envs.location(case, layout.MTA)

    # apex/__init__.py is apex-mta-kernels' own, and every installed package's apex/ folder is
    # merged into apex.__path__, whatever the order on sys.path.
    assert Path(out["apex_file"]) == mta / "apex" / "__init__.py"
    for dist in case.dists:
        assert str(envs.location(case, dist) / "apex") in out["apex_path"], dist

    # Each area is there exactly when its distribution is.
    for dist, areas in layout.AREAS.items():
        for area in areas:
            got = out["areas"][area]
            if dist in case.dists:
                where = str(envs.location(case, dist) / "apex" / area / "__init__.py")
                assert got["attr"] == {"ok": True, "file": where}, (area, "lazy apex.<area>")
                assert got["hasattr"] and got["in_dir"], area
                assert got["from_import"]["ok"], (area, got["from_import"])
                assert got["import"] == {"ok": True, "file": where}, area
            else:
                assert not got["hasattr"] and not got["in_dir"], area
                assert "AttributeError" in got["attr"]["types"], (area, got["attr"])
                for how in ("import", "from_import"):
                    failure = got[how]
                    assert not failure["ok"], (area, how)
                    assert "ImportError" in failure["types"], (area, how, failure)
                    assert f"apex.{area} is not installed" in failure["message"], failure
                    assert f"`pip install {dist}`" in failure["message"], failure

    # apex-mta-kernels' private module and the legacy top-level modules come with it.
    autocast = out["areas"]["_autocast_utils"]["import"]
    assert autocast == {"ok": True, "file": str(mta / "apex" / "_autocast_utils.py")}
    for name in ("amp_C", "apex_C"):
        assert out[name] == {"ok": True, "file": str(mta / f"{name}.py")}, out[name]
