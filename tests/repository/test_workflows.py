"""The GitHub workflows run what the README promises: the test command (through .ci/run) once
for every change; a release from a `v*` tag that checks the tag against the package version
and the changelog, publishes the package and the book of that tag; and every workflow
validates against GitHub's workflow schema and uses actions that run on node24."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

import book_tools

WORKFLOWS = book_tools.ROOT / ".github" / "workflows"
README = (book_tools.ROOT / "README.md").read_text()
CI = (book_tools.ROOT / ".ci" / "run").read_text()


def _readme_commands() -> tuple[str, str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    build, test = (line.split("#")[0].strip() for line in block)
    return build, test


def _load(name: str) -> dict:
    workflow = yaml.safe_load((WORKFLOWS / name).read_text())
    workflow["on"] = workflow.pop(True, workflow.get("on"))  # YAML 1.1 reads the key `on` as True
    return workflow


def _steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def _runs(workflow: dict) -> str:
    return "\n".join(step.get("run", "") for step in _steps(workflow))


def _uses(workflow: dict, action: str) -> list[dict]:
    return [step for step in _steps(workflow) if step.get("uses", "").split("@")[0] == action]


def _all_uses(workflow: dict) -> list[str]:
    """Every `uses:` of a workflow: its steps' actions and the jobs that call reusable workflows."""
    return [step["uses"] for step in _steps(workflow) if "uses" in step] + [
        job["uses"] for job in workflow["jobs"].values() if "uses" in job
    ]


WORKFLOW_FILES = sorted(WORKFLOWS.glob("*.yml"))
RUNTIMES = yaml.safe_load((book_tools.ROOT / "tests" / "data" / "action_runtimes.yml").read_text())
LOCK_PYTHONS = ((3, 11), (3, 13))  # scripts/lock.sh: the lock is for Python 3.11-3.13



def test_tests_workflow_runs_ci_once_for_every_change():
    workflow = _load("tests.yml")
    assert workflow["on"]["push"] == {"branches": ["**"]}, "every push to a branch is tested (tags: release.yml)"
    assert "pull_request" in workflow["on"] and "workflow_call" in workflow["on"]
    assert set(workflow["jobs"]) == {"test", "stacks"}
    job, stacks = workflow["jobs"]["test"], workflow["jobs"]["stacks"]
    # A pull request from a branch of this repository was tested by its push already.
    for each in (job, stacks):
        assert each["if"] == (
            "github.event_name != 'pull_request' || github.event.pull_request.head.repo.full_name != github.repository"
        )
    # The other stacks run in a job of their own, with the Pythons they need.
    assert job["steps"][-1]["env"] == {"CI_SKIP_STACKS": "1"}
    assert stacks["steps"][-1]["run"] == "bash .ci/stacks.sh"
    (python,) = _uses({"jobs": {"s": stacks}}, "actions/setup-python")
    assert {"3.10", "3.13"} <= set(python["with"]["python-version"].split())
    assert re.search(r"^bash \.ci/run$", _runs(workflow), re.M)
    assert _uses(workflow, "actions/checkout")
    # The browser test needs Debian's chromium; CI fails rather than skips without it.
    assert "chromium chromium-driver" in _runs(workflow)
    assert job.get("timeout-minutes", 360) <= 90
    python = tuple(map(int, re.search(r"python:(\d+)\.(\d+)", job["container"]).groups()))
    assert LOCK_PYTHONS[0] <= python <= LOCK_PYTHONS[1], f"the lock is not for Python {python}"


def test_pip_downloads_are_cached_under_a_key_of_the_lock():
    cache = _uses({"jobs": {"t": _load("tests.yml")["jobs"]["test"]}}, "actions/cache")[0]
    assert cache["with"]["path"] == "~/.cache/pip"
    assert "hashFiles('requirements.txt')" in cache["with"]["key"]
    for name in ("pages.yml", "release.yml"):
        for step in _uses(_load(name), "actions/setup-python"):
            if "cache" in step["with"]:
                assert step["with"]["cache"] == "pip"
                assert step["with"]["cache-dependency-path"] in {"requirements.txt", "requirements-book.txt"}


def test_ci_runs_the_readme_test_command_and_requires_the_browser():
    _, test = _readme_commands()
    assert test in CI.splitlines()
    assert "set -euo pipefail" in CI
    assert "command -v chromium" in CI and "apt-get install" in CI and "chromium-driver" in CI
    assert "export CI_REQUIRE_BROWSER=1" in CI
    assert CI.index("CI_REQUIRE_BROWSER=1") < CI.index(test)
    # The README's commands must work with the pip that Python brings: CI does not upgrade it.
    locked_env = CI[CI.index("python3 -m venv .venv\n"):CI.index(test)]
    assert not re.search(r"pip install .*(--upgrade|-U) pip", locked_env)


def test_pages_build_a_release_tag_with_only_the_book_lock_and_publish_build_html():
    workflow = _load("pages.yml")
    # Only a release publishes the book: never a push to a branch.
    assert set(workflow["on"]) == {"workflow_call", "workflow_dispatch"}
    for trigger in workflow["on"].values():
        assert trigger["inputs"]["tag"]["required"] is True
    checkout = _uses(workflow, "actions/checkout")[0]
    assert checkout["with"]["ref"] == "refs/tags/${{ inputs.tag }}"
    runs = _runs(workflow).splitlines()
    assert "pip install -r requirements-book.txt && jupyter-book build . -W -n --keep-going" in runs
    # The launch buttons open the notebooks of that tag: repository.branch is set to it first.
    pin = runs.index('python scripts/release.py pin-branch "${{ inputs.tag }}"')
    assert pin < runs.index("pip install -r requirements-book.txt && jupyter-book build . -W -n --keep-going")
    uploads = _uses(workflow, "actions/upload-pages-artifact")
    assert [step["with"]["path"] for step in uploads] == ["_build/html"]
    assert _uses(workflow, "actions/deploy-pages")
    assert workflow["permissions"]["pages"] == "write"
    assert workflow["permissions"]["id-token"] == "write"
    assert workflow["jobs"]["deploy"]["needs"] == "build"
    python = _uses(workflow, "actions/setup-python")
    assert LOCK_PYTHONS[0] <= tuple(map(int, str(python[0]["with"]["python-version"]).split("."))) <= LOCK_PYTHONS[1]


def test_release_checks_the_tag_then_tests_builds_publishes_and_publishes_the_book_of_the_tag():
    workflow = _load("release.yml")
    assert workflow["on"] == {"push": {"tags": ["v*"]}}
    jobs = workflow["jobs"]
    assert 'python scripts/release.py check "$GITHUB_REF_NAME"' in _runs({"jobs": {"c": jobs["check"]}})
    assert jobs["tests"] == {"needs": "check", "uses": "./.github/workflows/tests.yml"}
    dist = _runs({"jobs": {"d": jobs["dist"]}})
    assert "python -m build --outdir dist" in dist and jobs["dist"]["needs"] == "tests"
    pypi = jobs["pypi"]
    assert pypi["needs"] == "dist" and pypi["permissions"] == {"id-token": "write"}  # trusted publishing
    assert pypi["environment"]["name"] == "pypi"
    assert [s["uses"] for s in pypi["steps"]][-1] == "pypa/gh-action-pypi-publish@release/v1"
    release = jobs["github-release"]
    assert release["needs"] == "pypi" and release["permissions"] == {"contents": "write"}
    notes = _runs({"jobs": {"r": release}})
    assert 'scripts/release.py notes "$GITHUB_REF_NAME" > release-notes.md' in notes
    assert "gh release create" in notes and "--notes-file release-notes.md" in notes
    book = jobs["book"]
    assert book["needs"] == "github-release" and book["uses"] == "./.github/workflows/pages.yml"
    assert book["with"] == {"tag": "${{ github.ref_name }}"}
    assert book["permissions"]["pages"] == "write" and book["permissions"]["id-token"] == "write"


# --- every workflow is valid and runs on node24 ---------------------------------------------


def _check_jsonschema(schema: str, *files) -> subprocess.CompletedProcess:
    """check-jsonschema with one of the schemas it ships (no download)."""
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, *map(str, files)],
        capture_output=True, text=True, timeout=120,
    )


def test_every_workflow_validates_against_the_github_workflow_schema(tmp_path):
    assert {p.name for p in WORKFLOW_FILES} >= {"tests.yml", "pages.yml", "release.yml"}
    result = _check_jsonschema("vendor.github-workflows", *WORKFLOW_FILES)
    assert result.returncode == 0, result.stdout + result.stderr
    # The schema does reject a broken workflow (a job without `runs-on` or `uses`).
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  test:\n    steps:\n      - run: true\n")
    assert _check_jsonschema("vendor.github-workflows", broken).returncode == 1


def test_issue_templates_validate_against_the_issue_form_schemas():
    forms = sorted((book_tools.ROOT / ".github" / "ISSUE_TEMPLATE").glob("*.yml"))
    config = [p for p in forms if p.name == "config.yml"]
    forms = [p for p in forms if p.name != "config.yml"]
    names = {yaml.safe_load(p.read_text())["name"] for p in forms}
    assert names == {"Bug in the companion package", "Error in the book", "Question"}
    result = _check_jsonschema("vendor.github-issue-forms", *forms)
    assert result.returncode == 0, result.stdout + result.stderr
    result = _check_jsonschema("vendor.github-issue-config", *config)
    assert result.returncode == 0, result.stdout + result.stderr


def _node_version(using: str) -> int | None:
    match = re.fullmatch(r"node(\d+)", str(using))
    return int(match.group(1)) if match else None


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=[p.name for p in WORKFLOW_FILES])
def test_no_action_used_declares_a_node_runtime_older_than_node24(path):
    pending = [u for u in _all_uses(_load(path.name)) if not u.startswith("./")]
    assert pending or path.name != "tests.yml"
    seen = set()
    while pending:
        action = pending.pop()
        if action in seen:
            continue
        seen.add(action)
        assert action in RUNTIMES, (
            f"{path.name} uses {action}, whose action.yml is not in tests/data/action_runtimes.yml: "
            "read its `runs.using` (see that file) and add it"
        )
        using = RUNTIMES[action]["using"]
        assert using in {"composite", "docker"} or (_node_version(using) or 0) >= 24, (
            f"{action} declares runs.using: {using}; move to a version that declares node24"
        )
        pending.extend(RUNTIMES[action].get("uses", []))


def test_the_runtime_table_records_a_commit_for_every_action():
    for action, entry in RUNTIMES.items():
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]), action
        assert entry["using"] in {"composite", "docker"} or _node_version(entry["using"]), action
