"""tools/release.py in a scratch clone: bump, changelog, commit and tag; what it refuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip


@pytest.fixture
def clone(tmp_path):
    """A copy of the committed tree of the two files each release touches, plus the tool."""
    dst = tmp_path / "repo"
    pkg = dst / "packages" / "apex-optim"
    (pkg / "src" / "apex" / "optimizers").mkdir(parents=True)
    (dst / "tools").mkdir()
    (dst / "tools" / "release.py").write_text((REPO / "tools" / "release.py").read_text())
    (pkg / "src" / "apex" / "optimizers" / "_version.py").write_text('__version__ = "0.1.0"\n')
    (pkg / "CHANGELOG.md").write_text(
        "# Changelog\n\n## 0.2.0 — unreleased\n\n- new\n\n## 0.1.0 — 2026-01-01\n\n- old\n"
    )
    git(dst, "init", "-q")
    git(dst, "add", ".")
    git(dst, "commit", "-qm", "init")
    return dst


def release(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com", "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "tools/release.py", *args, "--no-build", "--date", "2026-12-02"],
        cwd=repo, capture_output=True, text=True, env=env,
    )  # fmt: skip


def test_release_bumps_dates_commits_and_tags(clone):
    done = release(clone, "apex-optim", "0.2.0")
    assert done.returncode == 0, done.stderr
    pkg = clone / "packages" / "apex-optim"
    assert (pkg / "src/apex/optimizers/_version.py").read_text() == '__version__ = "0.2.0"\n'
    changelog = (pkg / "CHANGELOG.md").read_text()
    assert "## 0.2.0 — 2026-12-02\n" in changelog and "## 0.1.0 — 2026-01-01" in changelog
    assert git(clone, "tag", "--list") == "apex-optim/v0.2.0"
    assert git(clone, "log", "-1", "--format=%s") == "apex-optim 0.2.0"
    assert git(clone, "status", "--porcelain") == ""
    # The same release twice, and a release with no changelog entry, are refused.
    again = release(clone, "apex-optim", "0.2.0")
    assert again.returncode != 0 and "tag apex-optim/v0.2.0 exists already" in again.stderr
    bare = release(clone, "apex-optim", "0.2.1")
    assert bare.returncode != 0 and "write the changes under '## 0.2.1 — unreleased'" in bare.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("apex-optim", "0.3.0"), "the unreleased section is for 0.2.0, not 0.3.0"),
        (("apex-optim", "1.0"), "is not X.Y.Z"),
        (("apex-nope", "0.2.0"), "no package apex-nope"),
    ],
)
def test_release_refuses(clone, args, message):
    done = release(clone, *args)
    assert done.returncode != 0 and message in done.stderr
    assert git(clone, "tag", "--list") == ""


def test_release_refuses_uncommitted_changes(clone):
    (clone / "packages/apex-optim/CHANGELOG.md").write_text("edited\n")
    done = release(clone, "apex-optim", "0.2.0")
    assert done.returncode != 0 and "uncommitted changes" in done.stderr
