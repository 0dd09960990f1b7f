"""bench/_common/measured_commit.py: the commit a results file names."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "_common"))
from measured_commit import measured_commit


def git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env |= {"GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("YATT_COMMIT", raising=False)
    git(tmp_path, "init", "-q")
    (tmp_path / "bench.py").write_text("a = 1\n")
    (tmp_path / "other.py").write_text("b = 1\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def test_names_the_head_and_dirty_only_for_the_watched_files(repo):
    head = git(repo, "rev-parse", "--short", "HEAD")
    assert measured_commit(root=repo) == head
    (repo / "other.py").write_text("b = 2\n")  # not watched
    assert measured_commit(["bench.py"], root=repo) == head
    (repo / "bench.py").write_text("a = 2\n")
    assert measured_commit(["bench.py"], root=repo) == head + "+dirty"
    assert measured_commit(root=repo) == head, "nothing watched: never dirty"


def test_yatt_commit_wins_over_the_repository(repo, monkeypatch):
    # The device machine's .git HEAD can be stale: a GPU run passes the real commit.
    monkeypatch.setenv("YATT_COMMIT", "abc1234")
    assert measured_commit(["bench.py"], root=repo) == "abc1234"


def test_unknown_outside_a_repository(tmp_path, monkeypatch):
    monkeypatch.delenv("YATT_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert measured_commit(root=tmp_path) == "unknown"
