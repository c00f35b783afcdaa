"""README.md's Python quick start, as it is printed, against a real server."""

from __future__ import annotations

import re

import numpy as np

from conftest import ROOT, run_python


def test_readme_python_quick_start_runs(server):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "README.md has no Python block"
    code = blocks[0]
    assert "127.0.0.1:7000" in code
    p = run_python(code.replace("127.0.0.1:7000", server.address))
    assert p.returncode == 0, p.stdout + p.stderr
    import remote_dram

    with remote_dram.Client(server.address) as c:
        assert c.get("weights/layer0") == np.arange(1024, dtype=np.float32).tobytes()
