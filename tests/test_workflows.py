"""The GitHub workflows run what the README promises: the test command (through .ci/run) on
every push and pull request, and the README's build command to publish `_build/html` to
GitHub Pages from the configured branch, only after the tests passed."""

from __future__ import annotations

import re

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


def test_tests_workflow_runs_ci_on_every_push_and_pull_request():
    workflow = _load("tests.yml")
    assert "push" in workflow["on"] and "pull_request" in workflow["on"]
    assert workflow["on"]["push"] is None, "the tests must run on pushes to every branch"
    assert re.search(r"^bash \.ci/run$", _runs(workflow), re.M)
    assert _uses(workflow, "actions/checkout")
    # The browser test needs Debian's chromium; CI fails rather than skips without it.
    assert "chromium chromium-driver" in _runs(workflow)
    job = next(iter(workflow["jobs"].values()))
    assert job.get("timeout-minutes", 360) <= 90


def test_ci_runs_the_readme_test_command_and_requires_the_browser():
    _, test = _readme_commands()
    assert test in CI.splitlines()
    assert "set -euo pipefail" in CI
    assert "command -v chromium" in CI and "apt-get install" in CI and "chromium-driver" in CI
    assert "export CI_REQUIRE_BROWSER=1" in CI
    assert CI.index("CI_REQUIRE_BROWSER=1") < CI.index(test)


def test_pages_workflow_builds_with_the_readme_command_and_publishes_build_html():
    workflow = _load("pages.yml")
    build, _ = _readme_commands()
    assert build in _runs(workflow).splitlines(), "pages.yml must build with the README's build command"
    uploads = _uses(workflow, "actions/upload-pages-artifact")
    assert [step["with"]["path"] for step in uploads] == ["_build/html"]
    assert _uses(workflow, "actions/deploy-pages")
    assert workflow["permissions"]["pages"] == "write"
    assert workflow["permissions"]["id-token"] == "write"
    python = _uses(workflow, "actions/setup-python")
    assert python and tuple(map(int, str(python[0]["with"]["python-version"]).split("."))) >= (3, 10)


def test_pages_publish_the_configured_branch_only_after_the_tests_passed():
    workflow = _load("pages.yml")
    trigger = workflow["on"]["workflow_run"]
    assert trigger["workflows"] == [_load("tests.yml")["name"]]
    assert trigger["branches"] == [book_tools.repository_branch()], (
        "Pages must publish the branch the launch buttons point to (repository.branch in _config.yml)"
    )
    build = workflow["jobs"]["build"]
    assert "github.event.workflow_run.conclusion == 'success'" in build["if"]
    checkout = _uses(workflow, "actions/checkout")[0]
    assert "workflow_run.head_sha" in checkout["with"]["ref"], "deploy the commit that was tested"
    assert workflow["jobs"]["deploy"]["needs"] == "build"
