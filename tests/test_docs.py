"""The README's example runs as written, and the docs it links to exist."""

import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    loss, grads = namespace["loss"], namespace["grads"]
    assert np.isfinite(float(loss)) and float(loss) > 0
    kernel_grad = np.asarray(grads["up"]["kernel"][...])
    assert kernel_grad.shape == (64, 256) and np.abs(kernel_grad).max() > 0


def test_linked_docs_exist():
    links = re.findall(r"\]\(([^)#]+\.md)\)", README)
    assert {"docs/api.md", "docs/training.md", "docs/measurement.md",
            "docs/errors.md"} <= set(links)
    for link in links:
        assert (ROOT / link).is_file(), link
